"""One master connection, which is one session: Hello, then requests until it closes.

A Cake master opens one connection per remote layer and sends each contiguous run as a Batch on
the run's first connection; the others see only Hello and Goodbye. A request that cannot be
served is answered WorkerError and the connection stays; bytes that are not Cake protocol
close this connection only.

The connection starts once the master has proved the cluster key, if the node has one; on a
node without one it holds a handshake place until its Hello, and only then counts as a master's
(handshakes.py). What a peer can hold is bounded: a frame may be no larger than the model can
need (`ConnectionLimits.max_payload`), its payload is read only once the node-wide BufferBudget
has room for it (shared among source addresses, with a reserve for small frames), and from
then on it must arrive within `frame_timeout` (so must the first
frame, Hello, counted from the connection's start, the wait for the budget excepted). A reply
holds the request's budget until it is written, and the master must read it within
`frame_timeout` too: one that stops reading is closed (its transport aborted, its unsent bytes
dropped) and its budget given back, so it cannot stall the other masters. A peer idle between
frames, or inside a header of 8 bytes, holds no budget.
Between frames a master may sit idle for as long as it likes (Cake masters do, between
prompts); with `session_idle_timeout` its KV state is freed after that long, and it is told
once if it then tries to continue. TCP keepalive finds a master that vanished without a FIN.

However a connection ends, the log says why, once: the node's own closes at warning (the
peer's fault) or info, a master that hangs up inside a frame or resets at info, and one that
closes cleanly between frames at debug.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cakemp import log
from cakemp.errors import BadRequest, CakempError, InternalError, PeerFault, ProtocolError, RequestError
from cakemp.front.admission import Admission
from cakemp.front.buffer_budget import BufferBudget, Held
from cakemp.front.handshakes import HelloPlace
from cakemp.front.metrics import Metrics
from cakemp.front.pool import DevicePool
from cakemp.front.session import Action, Close, Forward, Greet, Note, Refuse, Reply, Reset, Session, SessionState
from cakemp.front.tracing import TraceFile
from cakemp.ipc import trace
from cakemp.streams import FrameReader
from cakemp.wire import (
    HEADER_SIZE,
    LayerAssignment,
    LayerOp,
    Message,
    RawTensor,
    Revision,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    encode_frame,
)

# Keepalive probes after this long without traffic, then every _KEEPALIVE_INTERVAL_S, up to
# _KEEPALIVE_PROBES unanswered: a master gone without a FIN is dropped after ~2 minutes.
_KEEPALIVE_IDLE_S = 60
_KEEPALIVE_INTERVAL_S = 10
_KEEPALIVE_PROBES = 6
# A WorkerError's text never runs longer than this (a peer's own strings are clipped before).
_MAX_ERROR_CHARS = 400
_INTERNAL_ERROR = "internal error on the worker; its log has the details"
# What the master owes when the frame timeout runs out: the reason its connection is closed.
_HELLO_LATE = "no Hello within {:g} s of connecting"
_FRAME_LATE = "a frame did not arrive within {:g} s of its header"
_REPLY_UNREAD = "the master did not read its reply within {:g} s"


@dataclass(frozen=True)
class ConnectionLimits:
    max_payload: int  # bytes; a frame announcing more closes the connection
    frame_timeout: float  # seconds for a frame's payload to arrive once its header has (and for Hello, and for a reply to be read)
    session_idle_timeout: float | None = None  # seconds idle after which the session's KV is freed; None: never


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keepalive with probes sized to find a vanished master in about two minutes."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", _KEEPALIVE_PROBES)):
        if hasattr(socket, option):  # Linux names; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Connection:
    """One master connection: reads its frames within the budget and the timeouts, and carries out
    what its `Session` (session.py), which holds the session's rules, calls for."""

    def __init__(self, session_id: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 pool: DevicePool, admission: Admission, limits: ConnectionLimits,
                 budget: BufferBudget, metrics: Metrics, revision: Revision,
                 worker_info: Callable[[int], WorkerInfo], served: LayerAssignment | None = None,
                 trace_file: TraceFile | None = None, arrival: HelloPlace | None = None):
        """`trace_file`: where each request's stamps go (ipc/trace.py), when the front traces; `arrival`:
        on a node without a cluster key, the handshake place the connection holds until its Hello."""
        self.session_id = session_id  # the id devices know the session by; logs name it by its peer address
        self.busy = False  # a request is being served
        self._finishing = False  # close once the request being served is answered (the drain)
        self._writer = writer
        self._pool, self._metrics = pool, metrics
        self._limits, self._budget = limits, budget
        self._revision = revision
        self._worker_info = worker_info  # latency in ms -> WorkerInfo
        self._session = Session(admission, served=served, idle_timeout=limits.session_idle_timeout)
        # What the master owes within the frame timeout, since when: (loop time, reason if late); None: nothing.
        self._owed: tuple[float, str] | None = None
        self._frames = FrameReader(reader, revision, max_payload=limits.max_payload, limits=admission.decode_limits())
        self._frame_watch: asyncio.TimerHandle | None = None
        self._trace_file = trace_file
        self._arrival = arrival
        self._stamps: list[int] | None = None  # the message being served's stamps, when traced
        self._ended = False  # the log has said why the connection ends
        peer = writer.get_extra_info("peername")
        self._host = peer[0] if peer else "?"  # the source its frames' bytes are counted under
        self._log = log.get_logger(session=f"{peer[0]}:{peer[1]}" if peer else "?")

    def close(self) -> None:
        """Close the transport (the node stops): the read loop sees EOF and `serve` frees the session and returns."""
        self._end("info", "closing connection", error="the node is stopping")
        self._writer.close()

    def finish(self) -> None:
        """Close now if idle, else as soon as the request being served is answered."""
        self._finishing = True
        if not self.busy:
            self.close()

    async def serve(self) -> None:
        """Serve until the master closes, sends garbage, or the task is cancelled; then free the
        session. The log says why it ended."""
        try:
            await self._serve()
            self._end("debug", "connection closed by the master")
        except (ProtocolError, BadRequest) as e:  # BadRequest: a sound frame with an unusable tensor or run, before Hello
            self._end("warning", "closing connection", error=str(e), fault="peer")
        except asyncio.IncompleteReadError as e:
            self._end("info", "connection lost",
                      error=f"the master closed it inside a frame ({len(e.partial)} of {e.expected} bytes came)")
        except OSError as e:  # reset, broken pipe, keepalive unanswered (ETIMEDOUT)
            self._end("info", "connection lost", error=f"{type(e).__name__}: {e}")
        except asyncio.CancelledError:
            self._end("info", "closing connection", error="the node is stopping")
            raise
        except Exception as e:  # a bug in cakemp: this connection alone ends, the node serves on
            self._end("error", "closing connection: unexpected error", error=f"{type(e).__name__}: {e}", fault="node")
        finally:
            await self._release()

    def _end(self, level: str, event: str, **fields: object) -> None:
        """Log why the connection ends, unless that was said already (a timeout that aborted it, a
        session rule that closed it, the node stopping)."""
        if not self._ended:
            self._ended = True
            getattr(self._log, level)(event, **fields)

    async def _serve(self) -> None:
        # Hello is due within the frame timeout of the connection's start (after the key handshake).
        self._owed = (asyncio.get_running_loop().time(), _HELLO_LATE)
        self._watch_frames()
        while self._session.state is not SessionState.CLOSED and await self._answer_next():
            pass

    async def _answer_next(self) -> bool:
        """Read the next message and carry out what the session makes of it; False at EOF. The
        message's bytes are held of the budget until it is answered, and are freed with this call
        (a message kept alive while the next is awaited would be memory the budget no longer counts)."""
        try:
            received = await self._read()
        except BadRequest as e:  # the frame was sound, only its tensor or layer run is not: answer, go on
            if self._session.state is SessionState.AWAITING_HELLO:
                raise  # not a session yet: the connection closes
            self._metrics.requests.inc()
            await self._send(self._refusal(e))
            return True
        if received is None:
            return False
        message, _, read_s, held = received
        try:
            actions = self._session.received(message)
            if self._stamps is not None:
                self._stamps.append(trace.now())  # admitted
            await self._carry_out(actions, read_s)
        finally:
            self._budget.give(held)  # the message is answered: its bytes are no longer held
        return True

    async def _carry_out(self, actions: Sequence[Action], read_s: float = 0.0) -> None:
        """Do what the session asked, in order; `read_s`: how long the frame it answers took to read."""
        for action in actions:
            match action:
                case Greet():
                    if not self._greeted():
                        return
                    await self._send(self._worker_info(int(read_s * 1000)))
                case Reply(message):
                    await self._send(message)
                case Forward() | Refuse():
                    await self._serve_request(action)
                case Reset(devices):
                    await self._reset(devices)
                case Note(level, event, fields):
                    getattr(self._log, level)(event, **fields)
                case Close():
                    self._ended = True  # the session's Note before it said why
                    return

    def _greeted(self) -> bool:
        """Hello came: a keyless connection now leaves its handshake place and counts as a master's,
        unless it was displaced or --max-connections are open (logged), when it is closed."""
        arrival, self._arrival = self._arrival, None
        if arrival is None or arrival.greeted():
            return True
        self._ended = True
        self._writer.close()
        return False

    async def _serve_request(self, request: Forward | Refuse) -> None:
        self.busy = True
        try:
            start = time.perf_counter()
            reply = await self._forward(request.x, request.ops) if isinstance(request, Forward) else self._refusal(request.error)
            stamps = self._stamps
            if stamps is not None:
                stamps.append(trace.now())  # resumed
            if self._write(reply):  # (mostly the socket takes it all: nothing to wait for)
                await self._drained()
            if stamps is not None and isinstance(reply, TensorMessage) and len(stamps) > len(trace.FRONT_IN) + 1:
                stamps.append(trace.now())  # written
                self._trace_file.write(stamps)
            self._metrics.requests.inc()
            if isinstance(reply, TensorMessage):  # x: [B, T, H]
                x, ops = request.x, request.ops
                self._metrics.served(math.prod(x.shape[:-1]), ops[0].index_pos if ops else 0, len(ops),
                                     time.perf_counter() - start)
        finally:
            self.busy = False
            if self._finishing:
                self.close()

    async def _forward(self, x: RawTensor, ops: Sequence[LayerOp]) -> TensorMessage | WorkerError:
        """Pass x down the devices of its route (device to device); the bytes go on untouched (never a tensor here)."""
        try:
            route = self._pool.route(ops)
            for device in route.devices:
                if self._session.joined(device):
                    self._metrics.sessions.inc(device=self._pool.label(device))
            return TensorMessage(await self._pool.run(self.session_id, x, route, self._stamps))
        except RequestError as e:
            return self._refusal(e)
        except Exception as e:  # a bug on this request's path fails this request alone
            return self._refusal(InternalError(f"unexpected error in the front: {type(e).__name__}: {e}"))

    def _refusal(self, error: RequestError) -> WorkerError:
        """The WorkerError answering a request that cannot be served, logged and counted. The
        master reads what it did wrong, or that the node failed; a node's own error stays in the log."""
        self._metrics.errors.inc(error=type(error).__name__)
        if isinstance(error, InternalError):
            self._log.error("request failed", error=str(error), fault="node")
            return WorkerError(_INTERNAL_ERROR)
        self._log.warning("request refused", error=str(error), error_type=type(error).__name__,
                          fault="peer" if isinstance(error, PeerFault) else "node")
        text = str(error)
        return WorkerError(text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "…")

    async def _reset(self, devices: Sequence[int]) -> None:
        """Goodbye, or the session idle: drop its state on `devices`."""
        results = await asyncio.gather(*(self._pool.clear(d, self.session_id) for d in devices), return_exceptions=True)
        for error in (r for r in results if isinstance(r, BaseException)):
            self._log.warning("goodbye: could not clear caches", error=str(error))

    async def _read(self) -> tuple[Message, int, float, Held] | None:
        """The next message with the bytes read and seconds spent for it, and what it holds of the
        budget (the caller gives it back once done with the message); None at EOF.

        Raises ProtocolError when the frame is not Cake protocol, BadTensor or BadOps for a sound
        frame with a bad tensor (its budget then already given back).
        """
        size = await self._next_header()
        if size is None:
            return None
        if self._arrival is not None:
            self._arrival.progressed()  # a keyless connection's first bytes: it keeps its place until Hello
        if self._trace_file is not None:
            self._stamps = [trace.now()]  # read
        start = time.perf_counter()
        self._owed = None  # waiting for the budget is the node's doing, not the master's
        held = self._budget.take_now(size, self._host) or await self._budget.take(size, self._host)
        # The peer has frame_timeout from now for the payload.
        self._owed = (asyncio.get_running_loop().time(), _FRAME_LATE)
        try:
            message = await self._frames.message()
            if self._stamps is not None:
                self._stamps.append(trace.now())  # decoded
        except BaseException:
            self._budget.give(held)
            raise
        finally:
            self._owed = None
        self._metrics.bytes_received.inc(HEADER_SIZE + size)
        return message, HEADER_SIZE + size, time.perf_counter() - start, held

    async def _next_header(self) -> int | None:
        """The next frame's payload length, once its header is in (None at EOF between frames),
        however long the master stays idle before it; past the session idle timeout the
        session's KV state is freed meanwhile. ProtocolError for a header that is not Cake's or
        announces more than the model can need."""
        idle = self._session.idle_after()
        if idle is not None:
            try:
                async with asyncio.timeout(idle):
                    return await self._frames.header()
            except TimeoutError:
                await self._carry_out(self._session.idle())
        return await self._frames.header()

    def _watch_frames(self) -> None:
        """Close the connection once what the master owes (Hello first, then a frame's payload, or
        reading a reply) has taken longer than the frame timeout; looked at every frame_timeout
        seconds rather than timed per frame, which would cost every decode step a timer."""
        loop = asyncio.get_running_loop()
        timeout = self._limits.frame_timeout
        owed = self._owed
        if owed is None or loop.time() < owed[0] + timeout:
            self._frame_watch = loop.call_at((loop.time() if owed is None else owed[0]) + timeout, self._watch_frames)
            return
        if owed[1] == _REPLY_UNREAD:
            self._metrics.unread_replies.inc()
        self._end("warning", "closing connection", error=owed[1].format(timeout), fault="peer")
        # The read or the drain waiting on it ends at once, as a lost connection; the unsent
        # reply is dropped with the transport's buffer.
        self._writer.transport.abort()

    async def _send(self, message: Message) -> None:
        if self._write(message):
            await self._drained()

    def _write(self, message: Message) -> bool:
        """Write `message`'s frame; whether the socket left part of it for the master to read (a lost
        connection shows at the next read)."""
        buffers = encode_frame(message, self._revision)
        writer = self._writer
        writer.writelines(buffers)
        self._metrics.bytes_sent.inc(sum([memoryview(b).nbytes for b in buffers]))
        return bool(writer.transport.get_write_buffer_size())

    async def _drained(self) -> None:
        """Wait until the master has read what the socket did not take: it owes that within the frame timeout."""
        self._owed = (asyncio.get_running_loop().time(), _REPLY_UNREAD)
        try:
            await self._writer.drain()
        finally:
            self._owed = None

    async def _release(self) -> None:
        """The connection is gone: free the session on every device that saw it, then close."""
        if self._frame_watch is not None:
            self._frame_watch.cancel()
        for device in self._session.devices:
            self._metrics.sessions.dec(device=self._pool.label(device))
            try:
                done = await self._pool.end(device, self.session_id)
            except CakempError as e:
                self._log.debug("could not free session", device=device, error=str(e))
                continue
            self._log.info("session freed", device=device, device_sessions=done.sessions, kv_bytes=done.kv_bytes)
        self._writer.close()

