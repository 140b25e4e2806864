"""One master connection, which is one session: auth, handshake, then requests until it closes.

A Cake master opens one connection per remote layer and sends each contiguous run as a Batch on
the run's first connection; the others see only Hello and Goodbye. A request that cannot be
served is answered WorkerError and the connection stays; bytes that are not Cake protocol
close this connection only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

from cakemp import log
from cakemp.auth import authenticate_master
from cakemp.errors import AuthError, CakempError, MalformedTensor, ProtocolError, RequestError
from cakemp.front.metrics import Metrics
from cakemp.front.pool import DevicePool
from cakemp.front.router import Router
from cakemp.front.stats import Stats
from cakemp.wire import (
    Batch, FrameDecoder, Goodbye, Hello, LayerAssignment, LayerAssignmentAck, LayerOp, Message, RawTensor,
    Revision, SingleOp, TensorMessage, WorkerError, WorkerInfo, WorkerReady, encode_frame,
)

_READ_SIZE = 1 << 20


class Connection:
    def __init__(self, session: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 pool: DevicePool, router: Router, metrics: Metrics, revision: Revision, cluster_key: str | None,
                 worker_info: Callable[[int], WorkerInfo], served: LayerAssignment | None = None):
        self.session = session
        self.busy = False  # a request is being served
        self._finishing = False  # close once the request being served is answered (the drain)
        self._reader, self._writer = reader, writer
        self._pool, self._router, self._metrics = pool, router, metrics
        self._revision, self._cluster_key = revision, cluster_key
        self._worker_info = worker_info  # latency in ms -> WorkerInfo
        self._served = served  # zero-config: the assignment this node was set up with
        self._decoder = FrameDecoder(revision)
        self._devices: set[int] = set()  # devices that may hold state of this session
        self._stats = Stats()
        peer = writer.get_extra_info("peername")
        self._log = log.get_logger(conn=f"{peer[0]}:{peer[1]}" if peer else "?", session=session)

    def close(self) -> None:
        """Close the transport: the read loop sees EOF and `serve` frees the session and returns."""
        self._writer.close()

    def finish(self) -> None:
        """Close now if idle, else as soon as the request being served is answered."""
        self._finishing = True
        if not self.busy:
            self.close()

    async def serve(self) -> None:
        """Serve until the master closes, sends garbage, or the task is cancelled; then free the session."""
        try:
            if self._cluster_key is not None:
                await authenticate_master(self._reader, self._writer, self._cluster_key)
            await self._serve()
        except AuthError as e:
            self._log.warning("authentication failed", error=str(e))
        except ProtocolError as e:
            self._log.warning("closing connection: not Cake protocol", error=str(e))
        except (ConnectionError, asyncio.IncompleteReadError):
            self._log.debug("connection lost")
        finally:
            await self._release()

    async def _serve(self) -> None:
        first = await self._read()
        if first is None:
            return
        message, _, read_s = first
        if isinstance(message, LayerAssignment):
            # The master restarted and re-runs setup: we already hold the layers (seed behaviour).
            # A zero-config node knows what it was set up with and refuses another model or
            # layer set, rather than answer WorkerReady and fail every request that follows.
            if self._served is not None and message != self._served:
                self._log.warning("master re-setup with another assignment: refused", layers=len(message.layers),
                                  model_hash=message.model_hash)
                await self._send(WorkerError(
                    f"this node serves {_span(self._served.layers)} of model {self._served.model_hash or '(no hash)'}; "
                    f"restart it to take {_span(message.layers)} of model {message.model_hash or '(no hash)'}"))
                return
            self._log.info("master re-setup: accepting layer assignment", layers=len(message.layers))
            await self._send(LayerAssignmentAck(needs_data=False))
            await self._send(WorkerReady())
            return
        if not isinstance(message, Hello):
            self._log.warning("unexpected first message (expected Hello)", message=type(message).__name__)
            return
        await self._send(self._worker_info(int(read_s * 1000)))
        while True:
            try:
                received = await self._read()
            except MalformedTensor as e:  # the frame was sound, only its tensor is not: answer, go on
                self._metrics.requests.inc()
                await self._send(self._refusal(e))
                continue
            if received is None:
                return
            message, read_bytes, read_s = received
            if isinstance(message, Goodbye):
                await self._goodbye()
                await self._send(self._worker_info(int(read_s * 1000)))
            elif isinstance(message, Batch):
                await self._serve_request(message.x, message.batch, read_bytes, read_s)
            elif isinstance(message, SingleOp):
                op = LayerOp(message.layer_name, message.index_pos, message.block_idx)
                await self._serve_request(message.x, (op,), read_bytes, read_s)
            else:
                self._log.warning("unhandled message, closing", message=type(message).__name__)
                return

    async def _serve_request(self, x: RawTensor, ops: Sequence[LayerOp], read_bytes: int, read_s: float) -> None:
        self.busy = True
        try:
            start = time.perf_counter()
            reply = await self._run(x, ops)
            computed = time.perf_counter()
            written = await self._send(reply)
            write_s = time.perf_counter() - computed
            self._metrics.requests.inc()
        finally:
            self.busy = False
            if self._finishing:
                self.close()
        if isinstance(reply, TensorMessage):
            line = self._stats.add(len(ops), computed - start, read_bytes, read_s, written, write_s)
            if line is not None:
                self._log.info(line)

    async def _run(self, x: RawTensor, ops: Sequence[LayerOp]) -> TensorMessage | WorkerError:
        """Pass x through each device's leg in order; the bytes go on untouched (never a tensor here)."""
        try:
            data = x.data
            for leg in self._router.plan(ops):
                self._devices.add(leg.device)
                data = (await self._pool.forward(leg.device, self.session, x.dtype, x.shape, leg.ops, data)).data
            return TensorMessage(RawTensor(data, x.dtype, x.shape))
        except RequestError as e:
            return self._refusal(e)

    def _refusal(self, error: RequestError | MalformedTensor) -> WorkerError:
        """The WorkerError answering a request that cannot be served, logged and counted."""
        self._log.warning("request failed", error=str(error))
        self._metrics.errors.inc(error=type(error).__name__)
        return WorkerError(str(error))

    async def _goodbye(self) -> None:
        results = await asyncio.gather(*(self._pool.clear(d, self.session) for d in sorted(self._devices)),
                                       return_exceptions=True)
        for error in (r for r in results if isinstance(r, BaseException)):
            self._log.warning("goodbye: could not clear caches", error=str(error))

    async def _read(self) -> tuple[Message, int, float] | None:
        """The next message with the bytes read and seconds spent for it, or None at EOF."""
        start, nbytes = time.perf_counter(), 0
        while (message := self._decoder.next_message()) is None:
            data = await self._reader.read(_READ_SIZE)
            if not data:
                return None
            nbytes += len(data)
            self._metrics.bytes_received.inc(len(data))
            self._decoder.feed(data)
        return message, nbytes, time.perf_counter() - start

    async def _send(self, message: Message) -> int:
        buffers = encode_frame(message, self._revision)
        self._writer.writelines(buffers)
        await self._writer.drain()
        written = sum(memoryview(b).nbytes for b in buffers)
        self._metrics.bytes_sent.inc(written)
        return written

    async def _release(self) -> None:
        """The connection is gone: free the session on every device that saw it, then close."""
        for device in sorted(self._devices):
            try:
                done = await self._pool.end(device, self.session)
            except CakempError as e:
                self._log.debug("could not free session", device=device, error=str(e))
                continue
            self._log.info("session freed", device=device, device_sessions=done.sessions, kv_bytes=done.kv_bytes)
        self._writer.close()


def _span(layers: Sequence[str]) -> str:
    """How a message names a layer list: "model.layers.0..model.layers.15 (16 layers)"."""
    if not layers:
        return "no layers"
    return f"{layers[0]}..{layers[-1]} ({len(layers)} layers)" if len(layers) > 1 else layers[0]
