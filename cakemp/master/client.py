"""A protocol-level Cake master: one TCP connection to one worker, as Cake's `Client` holds it.

Cake's master opens one connection per remote layer, says Hello, then sends one request at a
time and waits for its reply (docs/protocol.md, Sessions and connections). `WorkerClient` does
the same and turns the replies into return values or exceptions; `cakemp probe`, `cakemp generate`, the benchmarks and the
tests drive workers through it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable, Sequence

from cakemp.auth import authenticate_worker
from cakemp.errors import BadTensor, ProtocolError, RemoteWorkerError
from cakemp.streams import FrameReader
from cakemp.wire import (
    Batch,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOps,
    Message,
    ModelDataChunk,
    ModelDataDone,
    RawTensor,
    Revision,
    SingleOp,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    WorkerReady,
    encode_frame,
)

# What a master without a key tells of a worker that never answered its Hello: a node started with
# a key reads a Hello frame as the start of the handshake's 32 bytes and waits for the rest.
NO_KEY_HINT = (" (does it expect a cluster key? A node started with one waits for the handshake before any Hello:"
               " give CAKE_CLUSTER_KEY the same key here)")


class WorkerClient:
    """One connection to a Cake worker. Requests are serialized: each waits for its reply
    before the next is sent, since replies carry no request id."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, revision: Revision, address: str
    ) -> None:
        self.revision = Revision(revision)
        self.address = address
        self._frames = FrameReader(reader, revision)
        self._writer = writer
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        cluster_key: str | None = None,
        revision: Revision = Revision.V2,
        timeout: float = 10.0,
        source: str | None = None,
    ) -> WorkerClient:
        """Connect (from the local address `source`, if given) and, with a cluster key, run the
        handshake; `timeout` bounds each of the two.

        Sends nothing else: call `hello()` (inference) or `assign_layers()` (setup) next.
        Requests themselves have no timeout, as in Cake: a long prefill is not a fault.
        """
        local = None if source is None else (source, 0)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=local), timeout)
        # asyncio already sets TCP_NODELAY; set it explicitly since a decode step is one small
        # frame each way and Nagle's delay would be most of its latency.
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if cluster_key is not None:
            try:
                await authenticate_worker(reader, writer, cluster_key, timeout)
            except BaseException:
                writer.close()
                raise
        return cls(reader, writer, revision, f"{host}:{port}")

    @property
    def local_address(self) -> str:
        """Our end of the connection as "host:port": how the worker's logs name this session (their `session` field)."""
        host, port = self._writer.get_extra_info("sockname")[:2]
        return f"{host}:{port}"

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def send(self, msg: Message) -> None:
        """Write one frame (raw use: no reply is read)."""
        self._writer.writelines(encode_frame(msg, self.revision))
        await self._writer.drain()

    async def receive(self) -> Message:
        """Read one frame; ProtocolError when it is malformed or the worker closed the stream."""
        try:
            if await self._frames.header() is None:
                raise ProtocolError(f"worker {self.address} closed the connection between frames")
            return await self._frames.message()
        except asyncio.IncompleteReadError:
            raise ProtocolError(f"worker {self.address} closed the connection in the middle of a frame") from None
        except BadTensor as exc:  # a worker's unusable tensor is no request to answer, here: not Cake protocol
            raise ProtocolError(str(exc)) from None

    async def _request(self, msg: Message, kind: type) -> Message:
        """Send `msg` and return the worker's reply, which must be a `kind`."""
        async with self._lock:
            await self.send(msg)
            return self._check(await self.receive(), kind)

    def _check(self, reply: Message, kind: type) -> Message:
        if isinstance(reply, kind):
            return reply
        if isinstance(reply, WorkerError):
            raise RemoteWorkerError(f"worker {self.address} reported error: {reply.message}")
        raise ProtocolError(f"worker {self.address} sent {type(reply).__name__}, expected {kind.__name__}")

    async def hello(self) -> WorkerInfo:
        """Hello → WorkerInfo: the first request of an inference connection."""
        return await self._request(Hello(), WorkerInfo)

    async def batch(self, x: RawTensor, ops: Sequence[tuple[str, int, int]]) -> RawTensor:
        """Run the layers `ops` (layer, index_pos, block_idx) in order on x [1, T, H]."""
        reply = await self._request(Batch(x, LayerOps.of(ops)), TensorMessage)
        return reply.tensor

    async def single_op(self, layer_name: str, x: RawTensor, index_pos: int, block_idx: int) -> RawTensor:
        """Run one layer on x (the message Cake uses for image models)."""
        reply = await self._request(SingleOp(layer_name, x, index_pos, block_idx), TensorMessage)
        return reply.tensor

    async def goodbye(self) -> WorkerInfo:
        """End a chat request: the worker clears this connection's KV cache."""
        return await self._request(Goodbye(), WorkerInfo)

    async def assign_layers(
        self, layers: Sequence[str], model_hash: str, chunks: Iterable[ModelDataChunk] = ()
    ) -> bool:
        """The setup exchange (docs/protocol.md, Setup exchange) on a fresh connection: LayerAssignment → Ack, then
        `chunks` and ModelDataDone if the worker asked for data, then WorkerReady.

        Returns whether the worker needed the data. The worker closes the connection after.
        """
        async with self._lock:
            await self.send(LayerAssignment(tuple(layers), model_hash))
            ack = self._check(await self.receive(), LayerAssignmentAck)
            if ack.needs_data:
                for chunk in chunks:
                    await self.send(chunk)
                await self.send(ModelDataDone())
            self._check(await self.receive(), WorkerReady)
        return ack.needs_data

    async def close(self) -> None:
        """Close the connection (the worker frees this session's state)."""
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # the worker may have reset the connection first; it is closed either way
