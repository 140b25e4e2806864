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
frame, Hello, counted from the connection's start, the wait for the budget excepted). A master
may write its next frames before its reply comes (Cake's do not): they wait in the connection,
and past _READ_AHEAD bytes of them it reads no more until it has answered. A reply
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

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
from cakemp.streams import Inbox
from cakemp.wire import (
    HEADER_SIZE,
    FrameDecoder,
    LayerAssignment,
    Message,
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
# Bytes a master may send ahead of its reply (Cake's send none) before its connection stops reading
# until the message being answered is: what a connection holds beside the budget stays bounded.
_READ_AHEAD = 64 * 1024


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
    what its `Session` (session.py), which holds the session's rules, calls for.

    Driven by callbacks rather than a task awaiting each frame: the reader hands over the bytes as
    they arrive (`received`), a frame's message is answered once its bytes are all in, and what the
    connection then waits for (a request's answer, room in the budget, the master reading a reply,
    a reset) goes on from that future's callback. A decode request wakes no task and makes no
    future of its own; `serve` only waits for the connection's end."""

    def __init__(self, session_id: int, reader: Inbox, writer: asyncio.StreamWriter, *,
                 pool: DevicePool, admission: Admission, limits: ConnectionLimits,
                 budget: BufferBudget, metrics: Metrics, revision: Revision,
                 worker_info: Callable[[int], WorkerInfo], served: LayerAssignment | None = None,
                 trace_file: TraceFile | None = None, arrival: HelloPlace | None = None):
        """`trace_file`: where each request's stamps go (ipc/trace.py), when the front traces; `arrival`:
        on a node without a cluster key, the handshake place the connection holds until its Hello."""
        self.session_id = session_id  # the id devices know the session by; logs name it by its peer address
        self.busy = False  # a request is being served
        self._finishing = False  # close once the request being served is answered (the drain)
        self._reader, self._writer = reader, writer
        self._transport = writer.transport
        self._loop = asyncio.get_running_loop()
        self._pool, self._metrics = pool, metrics
        self._limits, self._budget = limits, budget
        self._revision = revision
        self._worker_info = worker_info  # latency in ms -> WorkerInfo
        self._session = Session(admission, served=served, idle_timeout=limits.session_idle_timeout)
        self._decoder = FrameDecoder(revision, limits.max_payload, admission.decode_limits())
        # The frame being read or answered: what it holds of the budget (None: none yet), its payload's
        # size, when its header came (perf_counter) and how long it took to read.
        self._held: Held | None = None
        self._frame_size = 0
        self._frame_start = self._read_s = 0.0
        self._answering = False  # its message is read: the session's actions for it are being carried out
        self._actions: deque[Action] = deque()  # those not carried out yet, in order
        self._request_start = 0.0  # perf_counter when the request being served began
        self._waiting: asyncio.Future | None = None  # what the connection waits for before it goes on
        # What the master owes within the frame timeout, since when: (loop time, reason if late); None: nothing.
        self._owed: tuple[float, str] | None = None
        self._frame_watch: asyncio.TimerHandle | None = None
        self._idle_watch: asyncio.TimerHandle | None = None  # frees the session's state once it has sat idle
        self._trace_file = trace_file
        self._arrival = arrival
        self._stamps: list[int] | None = None  # the message being served's stamps, when traced
        self._eof = False  # the master closed its end
        self._paused = False  # reading paused (bytes sent ahead of a reply)
        self._closed = False
        self._done = self._loop.create_future()  # `serve` waits on it: set once the connection is closed
        self._ended = False  # the log has said why the connection ends
        peer = writer.get_extra_info("peername")
        self._host = peer[0] if peer else "?"  # the source its frames' bytes are counted under
        self._log = log.get_logger(session=f"{peer[0]}:{peer[1]}" if peer else "?")

    def close(self) -> None:
        """Close the connection (the node stops): `serve` frees the session and returns."""
        self._close("info", "closing connection", error="the node is stopping")

    def finish(self) -> None:
        """Close now if idle, else as soon as the request being served is answered."""
        self._finishing = True
        if not self.busy:
            self.close()

    async def serve(self) -> None:
        """Serve until the master closes, sends garbage, or the task is cancelled; then free the
        session. The log says why it ended."""
        # Hello is due within the frame timeout of the connection's start (after the key handshake).
        self._owed = (self._loop.time(), _HELLO_LATE)
        self._watch_frames()
        self._reader.hand_over(self)
        try:
            await self._done
        except asyncio.CancelledError:
            self._end("info", "closing connection", error="the node is stopping")
            raise
        finally:
            self._shut()
            await self._release()

    # -- the reader's callbacks

    def received(self, data: bytes) -> None:
        """Bytes from the master, as they arrive."""
        if self._closed:
            return
        self._decoder.feed(data)
        if self._waiting is None:
            self._advance()
        elif self._decoder.buffered() > _READ_AHEAD:  # sent ahead of its reply: read on once answered
            self._pause()

    def ended(self, error: Exception | None) -> None:
        """The master closed its end (None: what it sent is still answered), or the connection was lost."""
        if self._closed:
            return
        if error is not None:  # reset, keepalive unanswered (ETIMEDOUT)
            self._close("info", "connection lost", error=f"{type(error).__name__}: {error}")
            return
        self._eof = True
        if self._waiting is None:
            self._advance()

    # -- reading frames and answering their messages

    def _advance(self, step: Callable[[], None] | None = None) -> None:
        """`step`, then go on as far as the bytes in and the waits allow: carry out the actions of
        the message being answered, read the next frame; stop at a wait, or to read more bytes."""
        try:
            if step is not None:
                step()
            while self._waiting is None and not self._closed:
                if not self._answering:
                    if not self._read():
                        return
                elif self._actions:
                    self._carry_out(self._actions.popleft())
                else:
                    self._answered()
        except (ProtocolError, BadRequest) as e:  # BadRequest: a sound frame with an unusable tensor or run, before Hello
            self._close("warning", "closing connection", error=str(e), fault="peer")
        except OSError as e:  # reset, broken pipe
            self._close("info", "connection lost", error=f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug in cakemp: this connection alone ends, the node serves on
            self._close("error", "closing connection: unexpected error", error=f"{type(e).__name__}: {e}", fault="node")

    def _read(self) -> bool:
        """Read on in the next frame: True once its message is read and the session's actions for it
        queued; False when it needs more bytes, or waits for room in the budget.

        Raises ProtocolError when the frame is not Cake protocol, BadRequest for a sound frame with a
        bad tensor or layer run before Hello (after it, that request is answered WorkerError)."""
        decoder = self._decoder
        if self._held is None:
            size = decoder.frame_size()
            if size is None:
                return self._more_bytes()
            if not self._header(size):
                return False
        try:
            message = decoder.next_message()
        except BadRequest as e:  # the frame was sound, only its tensor or layer run is not: answer, go on
            self._owed = None
            if self._session.state is SessionState.AWAITING_HELLO:
                raise  # not a session yet: the connection closes
            self._metrics.requests.inc()
            self._answer([Reply(self._refusal(e))])
            return True
        if message is None:
            return self._more_bytes()
        self._owed = None
        self._read_s = time.perf_counter() - self._frame_start
        if self._stamps is not None:
            self._stamps.append(trace.now())  # decoded
        self._metrics.bytes_received.inc(HEADER_SIZE + self._frame_size)
        self._answer(self._session.received(message))
        if self._stamps is not None:
            self._stamps.append(trace.now())  # admitted
        return True

    def _header(self, size: int) -> bool:
        """A frame's header is in: hold its payload's bytes of the budget, then owe them within the
        frame timeout. False when the budget has no room yet: reading stops until it has."""
        if self._idle_watch is not None:
            self._idle_watch.cancel()
            self._idle_watch = None
        if self._arrival is not None:
            self._arrival.progressed()  # a keyless connection's first bytes: it keeps its place until Hello
        if self._trace_file is not None:
            self._stamps = [trace.now()]  # read
        self._frame_size, self._frame_start = size, time.perf_counter()
        self._owed = None  # waiting for the budget is the node's doing, not the master's
        self._held = self._budget.take_now(size, self._host)
        if self._held is None:
            self._pause()  # the payload is read only once the budget holds it
            self._wait_for(self._loop.create_task(self._take(size)), self._granted)
            return False
        self._owed = (self._loop.time(), _FRAME_LATE)
        return True

    async def _take(self, size: int) -> None:
        self._held = await self._budget.take(size, self._host)

    def _granted(self, take: asyncio.Task) -> None:
        take.result()
        self._owed = (self._loop.time(), _FRAME_LATE)  # the peer has frame_timeout from now for the payload

    def _more_bytes(self) -> bool:
        """The frame's bytes are not all in: read on (False), unless the master has closed its end."""
        decoder = self._decoder
        if self._eof:
            if self._held is None and not decoder.buffered():
                self._close("debug", "connection closed by the master")
            else:
                got, expected = ((decoder.buffered(), HEADER_SIZE) if self._held is None
                                 else (len(decoder.received()), self._frame_size))
                self._close("info", "connection lost",
                            error=f"the master closed it inside a frame ({got} of {expected} bytes came)")
            return False
        if self._paused:
            self._paused = False
            self._transport.resume_reading()
        if self._held is None and self._idle_watch is None and (idle := self._session.idle_after()) is not None:
            # Between frames the master may sit idle as long as it likes; past `idle`, its state is freed.
            self._idle_watch = self._loop.call_later(idle, self._idled)
        return False

    def _idled(self) -> None:
        self._idle_watch = None
        self._advance(lambda: self._answer(self._session.idle()))

    def _answer(self, actions: Sequence[Action]) -> None:
        self._answering = True
        self._actions.extend(actions)

    def _answered(self) -> None:
        """The message's actions are carried out: its bytes are no longer held."""
        self._answering = False
        self._give_back()

    def _give_back(self) -> None:
        """Give back what the frame being read or answered holds of the budget, if anything."""
        if self._held is not None:
            self._budget.give(self._held)
            self._held = None

    def _carry_out(self, action: Action) -> None:
        """Do one thing the session asked (a request, a reset or a reply that must drain: a wait)."""
        match action:
            case Forward() | Refuse():
                self._request(action)
            case Greet():
                if self._greeted():
                    self._send(self._worker_info(int(self._read_s * 1000)))
            case Reply(message):
                self._send(message)
            case Reset(devices):
                self._wait_for(asyncio.gather(*(self._pool.clear(d, self.session_id) for d in devices),
                                              return_exceptions=True), self._reset)
            case Note(level, event, fields):
                getattr(self._log, level)(event, **fields)
            case Close():
                self._ended = True  # the session's Note before it said why
                self._shut()

    def _greeted(self) -> bool:
        """Hello came: a keyless connection now leaves its handshake place and counts as a master's,
        unless it was displaced or --max-connections are open (logged), when it is closed."""
        arrival, self._arrival = self._arrival, None
        if arrival is None or arrival.greeted():
            return True
        self._ended = True
        self._shut()
        return False

    def _reset(self, cleared: asyncio.Future) -> None:
        """Goodbye, or the session idle: its state dropped on its devices."""
        for error in (r for r in cleared.result() if isinstance(r, BaseException)):
            self._log.warning("goodbye: could not clear caches", error=str(error))

    # -- requests

    def _request(self, request: Forward | Refuse) -> None:
        """Pass x down the devices of its route (device to device; the bytes go on untouched, never a
        tensor here), or refuse it; then answer."""
        self.busy = True
        self._request_start = time.perf_counter()
        if isinstance(request, Refuse):
            self._reply(request, self._refusal(request.error))
            return
        try:
            route = self._pool.route(request.ops)
            for device in route.devices:
                if self._session.joined(device):
                    self._metrics.sessions.inc(device=self._pool.label(device))
            running = self._pool.run(self.session_id, request.x, route, self._stamps)
        except Exception as e:
            self._reply(request, self._failure(e))
            return
        self._wait_for(running, partial(self._ran, request))

    def _ran(self, request: Forward, running: asyncio.Future) -> None:
        error = running.exception()
        self._reply(request, TensorMessage(running.result()) if error is None else self._failure(error))

    def _reply(self, request: Forward | Refuse, reply: TensorMessage | WorkerError) -> None:
        if self._stamps is not None:
            self._stamps.append(trace.now())  # resumed
        self._send(reply, partial(self._replied, request, reply))

    def _replied(self, request: Forward | Refuse, reply: TensorMessage | WorkerError) -> None:
        """The master has the request's reply: count it, and close if the node is draining."""
        stamps = self._stamps
        if stamps is not None and isinstance(reply, TensorMessage) and len(stamps) > len(trace.FRONT_IN) + 1:
            stamps.append(trace.now())  # written
            self._trace_file.write(stamps)
        self._metrics.requests.inc()
        if isinstance(reply, TensorMessage):  # x: [B, T, H]
            x, ops = request.x, request.ops
            self._metrics.served(math.prod(x.shape[:-1]), ops.positions[0] if ops else 0, len(ops),
                                 time.perf_counter() - self._request_start)
        self.busy = False
        if self._finishing:
            self.close()

    def _failure(self, error: Exception) -> WorkerError:
        """The WorkerError answering a request that failed on its way: a bug on its path fails it alone."""
        if not isinstance(error, RequestError):
            error = InternalError(f"unexpected error in the front: {type(error).__name__}: {error}")
        return self._refusal(error)

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

    # -- writing, waiting, ending

    def _send(self, message: Message, then: Callable[[], None] | None = None) -> None:
        """Write `message`'s frame, then `then()`: at once when the socket took all of it, else once the
        master has read the rest, which it owes within the frame timeout."""
        buffers = encode_frame(message, self._revision)
        transport = self._transport
        transport.writelines(buffers)
        self._metrics.bytes_sent.inc(sum([memoryview(b).nbytes for b in buffers]))
        if transport.get_write_buffer_size():
            self._owed = (self._loop.time(), _REPLY_UNREAD)
            self._wait_for(self._loop.create_task(self._writer.drain()), partial(self._drained, then))
        elif then is not None:
            then()

    def _drained(self, then: Callable[[], None] | None, drain: asyncio.Task) -> None:
        self._owed = None
        drain.result()  # OSError: the connection was lost meanwhile
        if then is not None:
            then()

    def _wait_for(self, future: asyncio.Future, then: Callable[[asyncio.Future], None]) -> None:
        """Go on with `then(future)` once `future` is done; meanwhile the master's bytes are held, up to
        _READ_AHEAD, and not read."""
        self._waiting = future
        future.add_done_callback(partial(self._resume, then))

    def _resume(self, then: Callable[[asyncio.Future], None], future: asyncio.Future) -> None:
        if future is self._waiting:  # (else the connection was closed, and stopped waiting)
            self._waiting = None
            self._advance(partial(then, future))

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def _watch_frames(self) -> None:
        """Close the connection once what the master owes (Hello first, then a frame's payload, or
        reading a reply) has taken longer than the frame timeout; looked at every frame_timeout
        seconds rather than timed per frame, which would cost every decode step a timer."""
        loop = self._loop
        timeout = self._limits.frame_timeout
        owed = self._owed
        if owed is None or loop.time() < owed[0] + timeout:
            self._frame_watch = loop.call_at((loop.time() if owed is None else owed[0]) + timeout, self._watch_frames)
            return
        if owed[1] == _REPLY_UNREAD:
            self._metrics.unread_replies.inc()
        self._end("warning", "closing connection", error=owed[1].format(timeout), fault="peer")
        self._transport.abort()  # the unsent reply is dropped with the transport's buffer
        self._shut()

    def _end(self, level: str, event: str, **fields: object) -> None:
        """Log why the connection ends, unless that was said already (a timeout that aborted it, a
        session rule that closed it, the node stopping)."""
        if not self._ended:
            self._ended = True
            getattr(self._log, level)(event, **fields)

    def _close(self, level: str, event: str, **fields: object) -> None:
        self._end(level, event, **fields)
        self._shut()

    def _shut(self) -> None:
        """Close the transport and stop waiting (a request still running is answered to no one);
        `serve` then frees the session."""
        if self._closed:
            return
        self._closed = True
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()
        self._writer.close()
        if not self._done.done():
            self._done.set_result(None)

    async def _release(self) -> None:
        """The connection is gone: give back what its frame held, and free the session on every
        device that saw it."""
        for watch in (self._frame_watch, self._idle_watch):
            if watch is not None:
                watch.cancel()
        self._give_back()
        for device in self._session.devices:
            self._metrics.sessions.dec(device=self._pool.label(device))
            try:
                done = await self._pool.end(device, self.session_id)
            except CakempError as e:
                self._log.debug("could not free session", device=device, error=str(e))
                continue
            self._log.info("session freed", device=device, device_sessions=done.sessions, kv_bytes=done.kv_bytes)
