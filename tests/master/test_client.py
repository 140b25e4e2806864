"""WorkerClient against a small in-test worker that speaks Cake's protocol over a real socket."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import pytest

from cakemp.auth import authenticate_master
from cakemp.errors import AuthError, ProtocolError, RemoteWorkerError
from cakemp.master import WorkerClient
from cakemp.wire import (
    Batch,
    DType,
    FrameDecoder,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOp,
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

INFO = WorkerInfo("0.1.0", "F16", "linux", "x86_64", "cpu", 0, 3)
LAYERS = {"model.layers.0", "model.layers.1"}


class EchoWorker:
    """Serves LAYERS by answering a Batch or SingleOp with its own input; records what it got.
    `needs_data` is its answer to a LayerAssignment; `hello_reply` replaces WorkerInfo."""

    def __init__(self, revision=Revision.V2, key=None, needs_data=False, hello_reply=INFO):
        self.revision = revision
        self.key = key
        self.needs_data = needs_data
        self.hello_reply = hello_reply
        self.received = []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info):
        self.server.close()
        await self.server.wait_closed()

    def replies_to(self, msg) -> list:
        if isinstance(msg, Hello):
            return [self.hello_reply]
        if isinstance(msg, Goodbye):
            return [INFO]
        if isinstance(msg, (Batch, SingleOp)):
            names = [op.layer for op in msg.batch] if isinstance(msg, Batch) else [msg.layer_name]
            unknown = [name for name in names if name not in LAYERS]
            return [WorkerError(f"could not find layer {unknown[0]}") if unknown else TensorMessage(msg.x)]
        if isinstance(msg, LayerAssignment):
            return [LayerAssignmentAck(self.needs_data)] + ([] if self.needs_data else [WorkerReady()])
        if isinstance(msg, ModelDataChunk):
            return []
        if isinstance(msg, ModelDataDone):
            return [WorkerReady()]
        raise AssertionError(f"unexpected {msg}")

    async def handle(self, reader, writer):
        if self.key is not None:
            try:
                await authenticate_master(reader, writer, self.key, 2.0)
            except AuthError:
                writer.close()
                return
        decoder = FrameDecoder(self.revision)
        while data := await reader.read(65536):
            decoder.feed(data)
            while (msg := decoder.next_message()) is not None:
                self.received.append(msg)
                replies = self.replies_to(msg)
                for reply in replies:
                    writer.writelines(encode_frame(reply, self.revision))
                await writer.drain()
                if isinstance(msg, (LayerAssignment, ModelDataDone)) and WorkerReady() in replies:
                    writer.close()  # a setup connection ends with WorkerReady
                    return
        writer.close()


def x_of(value: int) -> RawTensor:
    """A [1, 1, 4] F16 hidden state filled with one byte value."""
    return RawTensor(bytes([value]) * 8, DType.F16, (1, 1, 4))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_hello_batch_single_op_goodbye():
    """A whole inference conversation returns WorkerInfo, the worker's tensors, then WorkerInfo again."""

    async def main():
        async with EchoWorker() as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port) as client:
                info = await client.hello()
                y = await client.batch(x_of(1), [("model.layers.0", 5, 0), ("model.layers.1", 5, 1)])
                z = await client.single_op("model.layers.1", x_of(2), 6, 1)
                bye = await client.goodbye()
            return worker.received, info, y, z, bye

    received, info, y, z, bye = run(main())
    assert info == INFO and bye == INFO
    assert y == x_of(1) and z == x_of(2)
    assert received[1] == Batch(x_of(1), (LayerOp("model.layers.0", 5, 0), LayerOp("model.layers.1", 5, 1)))
    assert received[2] == SingleOp("model.layers.1", x_of(2), 6, 1)


def test_worker_error_raises_and_the_connection_stays_usable():
    """A WorkerError reply raises RemoteWorkerError with the worker's message, and the next request still works."""

    async def main():
        async with EchoWorker() as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port) as client:
                await client.hello()
                with pytest.raises(RemoteWorkerError, match="reported error: could not find layer model.layers.9"):
                    await client.batch(x_of(1), [("model.layers.9", 0, 9)])
                return await client.batch(x_of(3), [("model.layers.0", 0, 0)])

    assert run(main()) == x_of(3)


def test_concurrent_requests_are_serialized():
    """Requests issued at once on one client each get their own reply, in order."""

    async def main():
        async with EchoWorker() as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port) as client:
                return await asyncio.gather(*(client.batch(x_of(i), [("model.layers.0", i, 0)]) for i in range(8)))

    assert run(main()) == [x_of(i) for i in range(8)]


def test_unexpected_reply_is_a_protocol_error():
    """A reply of the wrong kind (WorkerReady to Hello) raises ProtocolError naming both."""

    async def main():
        async with EchoWorker(hello_reply=WorkerReady()) as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port) as client:
                with pytest.raises(ProtocolError, match="sent WorkerReady, expected WorkerInfo"):
                    await client.hello()

    run(main())


def test_worker_hanging_up_is_a_protocol_error():
    """When the worker closes the connection instead of replying, the request raises ProtocolError."""

    async def main():
        async def hang_up(reader, writer):
            await reader.readexactly(12)  # the Hello frame
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        async with server:
            async with await WorkerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1]) as client:
                with pytest.raises(ProtocolError, match="closed the connection between frames"):
                    await client.hello()

    run(main())


def test_a_worker_tensor_that_does_not_match_its_shape_is_a_protocol_error():
    """A worker's TensorMessage whose bytes do not fit its shape raises ProtocolError (for the master a
    broken reply, not a request to answer), naming the fault."""

    async def main():
        async def answer_short(reader, writer):
            decoder = FrameDecoder(Revision.V2)
            decoder.feed(await reader.read(65536))
            decoder.next_message()
            writer.writelines(encode_frame(TensorMessage(RawTensor(bytes(7), DType.F16, (1, 1, 4))), Revision.V2))
            await writer.drain()

        server = await asyncio.start_server(answer_short, "127.0.0.1", 0)
        async with server:
            async with await WorkerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1]) as client:
                with pytest.raises(ProtocolError, match=r"data is 7 bytes, shape \[1, 1, 4\] of F16 needs 8"):
                    await client.batch(x_of(1), [("model.layers.0", 0, 0)])

    run(main())


@pytest.mark.parametrize("revision", [Revision.V1, Revision.V2])
def test_setup_without_data(revision):
    """assign_layers gets Ack(needs_data=False) then WorkerReady, sends no data, and returns False."""

    async def main():
        async with EchoWorker(revision=revision) as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port, revision=revision) as client:
                needed = await client.assign_layers(["model.layers.0"], "deadbeef", [ModelDataChunk("x", 0, 1, b"x")])
            return needed, worker.received

    needed, received = run(main())
    assert needed is False
    assert received == [LayerAssignment(("model.layers.0",), "deadbeef")]


@pytest.mark.parametrize("revision", [Revision.V1, Revision.V2])
def test_setup_with_data(revision):
    """When the worker needs data, assign_layers sends every chunk then ModelDataDone, waits for WorkerReady, returns True."""
    checksum = 0x55BC801D if revision == Revision.V2 else 0
    chunks = [ModelDataChunk("config.json", 0, 3, b"\x01\x02\x03", checksum=checksum),
              ModelDataChunk("model.safetensors", 0, 2, b"ab", checksum=checksum)]  # fmt: skip

    async def main():
        async with EchoWorker(revision=revision, needs_data=True) as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port, revision=revision) as client:
                needed = await client.assign_layers(["model.layers.0", "model.layers.1"], "deadbeef", chunks)
            return needed, worker.received

    needed, received = run(main())
    assert needed is True
    assert received == [LayerAssignment(("model.layers.0", "model.layers.1"), "deadbeef"), *chunks, ModelDataDone()]


def test_connect_with_cluster_key():
    """With the worker's cluster key the client authenticates and then talks normally."""

    async def main():
        async with EchoWorker(key="k") as worker:
            async with await WorkerClient.connect("127.0.0.1", worker.port, cluster_key="k") as client:
                return await client.hello()

    assert run(main()) == INFO


def test_connect_refuses_a_worker_that_reflects_the_masters_own_challenge():
    """A "worker" that proves the key for the master's nonce (got from another node, say) and then
    challenges with that same nonce is refused before the master MACs it: AuthError, connection closed."""

    async def main():
        seen_after = []

        async def reflecting(reader, writer):
            nonce_m = await reader.readexactly(32)
            writer.write(hmac.new(b"k", nonce_m, hashlib.sha256).digest() + nonce_m)
            await writer.drain()
            seen_after.append(await reader.read())  # the MAC of nonce_m it hoped for; b"" when closed
            writer.close()

        server = await asyncio.start_server(reflecting, "127.0.0.1", 0)
        async with server:
            with pytest.raises(AuthError, match="reflection"):
                await WorkerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1], cluster_key="k")
            while not seen_after:
                await asyncio.sleep(0.01)
        return seen_after

    assert run(main()) == [b""]


def test_connect_with_wrong_cluster_key():
    """With a key other than the worker's, connect raises AuthError."""

    async def main():
        async with EchoWorker(key="k") as worker:
            with pytest.raises(AuthError, match="worker authentication failed"):
                await WorkerClient.connect("127.0.0.1", worker.port, cluster_key="not-k")

    run(main())
