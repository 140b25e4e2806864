"""A live node under >= 20,000 generated and mutated frames from many connections, with a canary session.

The node's buffer budget is 1 MiB, about twelve of the largest frames this model allows, so
that the fuzzing connections also run into its backpressure.

Frames are random bytes, frames with hostile lengths, Batch and SingleOp requests with hostile
ndims, shapes, dtypes, op counts, layer names and positions, other messages (tags) out of place,
valid requests, and bit-flipped or overwritten copies of all of these. The wire codec (tested
on its own in tests/wire) says what the node must do with each: answer it (WorkerError, Tensor,
or WorkerInfo for Goodbye) and go on, or close the connection. Each connection sends a run of
answerable frames and checks it gets exactly one reply per frame, in order; then, on most, one
frame that must close it, and checks it is closed unanswered. Meanwhile a canary session
decodes and checks every reply against HF's layers, and a few slow readers send full-size
requests but never read a reply: the node must close each once a reply goes unread for the
frame timeout, and say why.

At the end: no device restarted, nothing the node logged is an error or a traceback, no frame
bytes are still held, and the front's resident memory stayed within a bound.

On the loaded 2-core test machine the run takes about a minute; FRAMES and CONCURRENCY set its size.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache

from cakemp.errors import BadRequest, ProtocolError
from cakemp.front.admission import LayerAdmission
from cakemp.wire import (
    HEADER_SIZE,
    MAGIC,
    Batch,
    DType,
    FrameDecoder,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerOp,
    ModelDataDone,
    RawTensor,
    Revision,
    SingleOp,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    WorkerReady,
    decode_payload,
    encode_frame,
)
from tests.support.checkpoints import HFLayers
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, scrape, write_topology

HIDDEN = 64
LAYERS = [0, 1, 2, 3]
NAMES = [f"model.layers.{i}" for i in LAYERS]
MAX_CONTEXT = 64
FRAMES = 20_000
CONCURRENCY = 24  # fuzzing connections open at once
SEED = 12
F32_ATOL = 1e-4
# The front's resident memory may grow this much under the fuzz (it holds at most a few frames of
# at most MAX_PAYLOAD bytes; the rest is allocator slack and log buffers).
RSS_GROWTH_BOUND = 64 << 20
BUFFER_BUDGET = 1 << 20
FRAME_TIMEOUT_S = 10
SLOW_READERS = 8
ADMISSION = LayerAdmission(frozenset(NAMES), HIDDEN, MAX_CONTEXT, frozenset(LAYERS))
MAX_PAYLOAD = ADMISSION.max_payload()
U64 = 2**64 - 1


def run(coro, timeout=600):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--max-context",
                          str(MAX_CONTEXT), "--metrics-address", "127.0.0.1:0", "--max-buffered-mib",
                          str(BUFFER_BUDGET >> 20), "--frame-timeout", str(FRAME_TIMEOUT_S))
    yield running
    assert running.stop() == 0


def frame(message) -> bytes:
    return b"".join(bytes(piece) for piece in encode_frame(message, Revision.V2))


class Fuzzer:
    """Seeded generator of frames, each one standing alone (header and payload)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def next(self) -> bytes:
        kind = self.rng.choices(
            [self.random_bytes, self.hostile_length, self.batch, self.single_op, self.out_of_place, self.valid,
             self.mutated],
            # Most frames keep their connection, so that 20,000 of them need only ~2,500 connections.
            weights=[1, 1, 52, 12, 2, 4, 14])[0]
        return kind()

    def random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randint(1, 64))

    def hostile_length(self) -> bytes:
        size = self.rng.choice([0, 1, 7, MAX_PAYLOAD, MAX_PAYLOAD + 1, 512 << 20, (512 << 20) + 1, 2**32 - 1,
                                self.rng.randrange(2**32)])
        body = self.rng.choice([b"", struct.pack(">I", self.rng.randrange(16)), self.rng.randbytes(32)])
        return struct.pack(">II", MAGIC, size) + body

    def _dim(self) -> int:
        return self.rng.choice([0, 1, 1, 2, 3, HIDDEN, HIDDEN, MAX_CONTEXT + 1, 2**32, 2**63, U64,
                                self.rng.randrange(2**64)])

    def _tensor(self) -> RawTensor:
        ndim = self.rng.choice([0, 1, 2, 3, 3, 3, 3, 4]) if self.rng.random() > 0.04 else self.rng.choice([255, 256, 300])
        shape = tuple(self._dim() for _ in range(ndim))
        if ndim == 3 and self.rng.random() < 0.5:
            shape = (1, self.rng.randint(1, 3), HIDDEN)
        dtype = self.rng.choice([*range(10), DType.F32, DType.F16, DType.BF16])
        elements = 1
        for dim in shape:
            elements *= dim
        itemsize = DType(dtype).itemsize if dtype in DType._value2member_map_ else 1
        size = elements * itemsize
        if size > 4096 or self.rng.random() < 0.2:
            size = self.rng.choice([0, 1, 3, 256, self.rng.randrange(4096)])
        return RawTensor(self.rng.randbytes(size), dtype, shape)

    def _name(self) -> str:
        return self.rng.choice([*NAMES, *NAMES, "model.layers.4", "model.layers.-1", "", "lm_head",
                                "model.layers." + "9" * 40, "\x00\x1b[2J", "é" * 300, "model.layers.0 "])

    def _position(self) -> int:
        return self.rng.choice([0, 0, 1, 5, MAX_CONTEXT - 1, MAX_CONTEXT, 2**31, 2**63, U64])

    def _ops(self) -> tuple[LayerOp, ...]:
        count = self.rng.choice([0, 1, 2, 4, 4, 5, 8]) if self.rng.random() > 0.04 else self.rng.choice([100, 1000])
        # A long run repeats a few drawn ops (drawing 1000 would be most of the test's time).
        drawn = tuple(LayerOp(self._name(), self._position(), self.rng.choice([*LAYERS, 4, 80, U64]))
                      for _ in range(min(count, 8)))
        return (drawn * (count // max(1, len(drawn)) + 1))[:count]

    def batch(self) -> bytes:
        return frame(Batch(self._tensor(), self._ops()))

    def single_op(self) -> bytes:
        return frame(SingleOp(self._name(), self._tensor(), self._position(), self.rng.choice([*LAYERS, U64])))

    def out_of_place(self) -> bytes:
        message = self.rng.choice([
            Hello(), Goodbye(), Goodbye(), WorkerReady(), ModelDataDone(), WorkerError("x" * 100),
            WorkerInfo("9", "F32", "linux", "x86_64", "cpu", 0, 2**128 - 1),
            TensorMessage(RawTensor(bytes(HIDDEN * 4), DType.F32, (1, 1, HIDDEN))),
            LayerAssignment(tuple(NAMES), "hash"),
        ])
        data = frame(message)
        if self.rng.random() < 0.3:  # a tag no revision has
            data = data[:HEADER_SIZE] + struct.pack(">I", self.rng.randrange(13, 2**32)) + data[HEADER_SIZE + 4:]
        return data

    def valid(self) -> bytes:
        tokens = self.rng.randint(1, 3)
        start = self.rng.randrange(len(LAYERS))
        x = torch.randn(1, tokens, HIDDEN).numpy().tobytes()
        ops = tuple(LayerOp(NAMES[i], 0, i) for i in LAYERS[start:start + self.rng.randint(1, 4)])
        return frame(Batch(RawTensor(x, DType.F32, (1, tokens, HIDDEN)), ops))

    def mutated(self) -> bytes:
        data = bytearray(self.rng.choice([self.batch, self.valid, self.single_op, self.out_of_place])())
        how = self.rng.randrange(4)
        if how == 0:  # bit flips anywhere, header included
            for _ in range(self.rng.randint(1, 8)):
                bit = self.rng.randrange(len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
        elif how == 1:  # a u32 or u64 overwritten with an extreme value
            width = self.rng.choice([4, 8])
            at = self.rng.randrange(max(1, len(data) - width))
            data[at:at + width] = self.rng.choice([0, 1, 2**(8 * width) - 1, 2**(8 * width - 1)]).to_bytes(width, "big")
        elif how == 2:  # truncated, the header's length kept
            data = data[:self.rng.randrange(1, len(data))]
        else:  # bytes appended inside the frame, the header fixed to match
            data += self.rng.randbytes(self.rng.randint(1, 64))
            data[4:8] = struct.pack(">I", len(data) - HEADER_SIZE)
        return bytes(data)


def answered(data: bytes) -> bool:
    """Whether the node answers `data` mid-connection and goes on (else it closes the connection)."""
    if len(data) < HEADER_SIZE:
        return False
    magic, size = struct.unpack(">II", data[:HEADER_SIZE])
    if magic != MAGIC or size > MAX_PAYLOAD or size != len(data) - HEADER_SIZE:
        return False
    try:
        message = decode_payload(data[HEADER_SIZE:], Revision.V2, ADMISSION.decode_limits())
    except BadRequest:  # a sound frame whose tensor or layer run is unusable: answered WorkerError
        return True
    except ProtocolError:
        return False
    return isinstance(message, (Batch, SingleOp, Goodbye))


async def fuzz_connection(port: int, frames: list[bytes], ending: bytes | None, source: str) -> None:
    """From the address `source`: Hello, `frames` (each must get one reply, in order), then `ending`
    (must close the connection unanswered)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    decoder = FrameDecoder(Revision.V2)
    replies = []

    async def collect(count: int) -> None:
        while len(replies) < count:
            while (message := decoder.next_message()) is not None:
                replies.append(message)
            if len(replies) >= count:
                return
            data = await reader.read(1 << 16)
            assert data, f"closed after {len(replies)} of {count} replies"
            decoder.feed(data)

    writer.write(frame(Hello()) + b"".join(frames))
    await collect(1 + len(frames))
    assert len(replies) == 1 + len(frames) and isinstance(replies[0], WorkerInfo)
    for reply in replies[1:]:
        assert isinstance(reply, (WorkerError, TensorMessage, WorkerInfo)), reply
        if isinstance(reply, WorkerError):
            assert len(reply.message) <= 401 and "Traceback" not in reply.message, reply.message
    try:
        if ending is not None:
            writer.write(ending)
        writer.write_eof()
        rest = await reader.read()
    except OSError:  # the node reset the connection (closed with our bytes unread), maybe before our EOF
        rest = b""
    assert rest == b"", f"answered a frame that must close the connection: {rest[:64]!r}"
    writer.close()


async def slow_reader(port: int) -> tuple[str, asyncio.StreamWriter]:
    """A connection that says Hello, sends 200 full-size requests (echoed: no layer to run) and
    never reads a reply; how the node names it, and its writer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it offers stays small
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    echo = frame(Batch(RawTensor(bytes(MAX_CONTEXT * HIDDEN * 4), DType.F32, (1, MAX_CONTEXT, HIDDEN)), ()))
    writer.write(frame(Hello()) + echo * 200)
    return "{}:{}".format(*sock.getsockname()[:2]), writer


def front_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_fuzzed_frames_from_many_connections_leave_the_node_and_a_canary_session_intact(node, checkpoint):
    """20,000 generated and mutated frames: each answered or closing its connection as the codec says,
    a concurrent canary session exact throughout, no restart, no error logged, bounded front memory."""
    fuzzer = Fuzzer(SEED)
    frames = [fuzzer.next() for _ in range(FRAMES)]
    answerable = [data for data in frames if answered(data)]
    endings = [data for data in frames if not answered(data)]
    assert len(endings) > 1000 and len(answerable) > 10_000  # both kinds well represented
    # One connection per closing frame, each first sending a share of the answerable ones (0..2x the mean).
    connections: list[tuple[list[bytes], bytes | None]] = []
    mean = len(answerable) // len(endings)
    taken = 0
    for ending in endings:
        share = fuzzer.rng.randint(0, 2 * mean)
        connections.append((answerable[taken:taken + share], ending))
        taken += share
    connections += [(answerable[i:i + 2 * mean], None) for i in range(taken, len(answerable), 2 * mean)]
    sent = sum(len(run_of) + (ending is not None) for run_of, ending in connections)
    assert sent == FRAMES
    ref = HFLayers(checkpoint, LAYERS, torch.float32)
    pid = node.process.pid
    mark = node.mark()

    async def canary(done: asyncio.Event) -> tuple[int, int]:
        """Decode steps checked against HF until the fuzz is done; the steps taken and the peak front RSS."""
        master = await CakeMaster.connect(node.port, LAYERS)
        steps, peak = 0, front_rss(pid)
        generator = torch.Generator().manual_seed(SEED)
        while not done.is_set() or steps < 10:
            ref.cache = DynamicCache(config=ref.config)
            x = torch.randn(1, 4, HIDDEN, generator=generator)
            torch.testing.assert_close(await master.forward(x, 0), ref(x, 0), atol=F32_ATOL, rtol=0)
            for pos in range(4, MAX_CONTEXT):
                x = torch.randn(1, 1, HIDDEN, generator=generator)
                torch.testing.assert_close(await master.forward(x, pos), ref(x, pos), atol=F32_ATOL, rtol=0)
                steps += 1
                peak = max(peak, front_rss(pid))
                if done.is_set() and steps >= 10:
                    break
            await master.goodbye()
        await master.close()
        return steps, peak

    async def main():
        before = front_rss(pid)
        done = asyncio.Event()
        checking = asyncio.create_task(canary(done))
        slow = [await slow_reader(node.port) for _ in range(SLOW_READERS)]
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one(frames, ending, source):
            async with slots:
                await fuzz_connection(node.port, frames, ending, source)

        try:  # from as many addresses as connections at once: each peer within its handshake places
            await asyncio.gather(*(one(frames, ending, f"127.0.3.{i % CONCURRENCY + 1}")
                                   for i, (frames, ending) in enumerate(connections)))
        finally:
            done.set()
        steps, peak = await checking
        for session, writer in slow:
            await asyncio.to_thread(node.wait_for, lambda e, session=session: e.get("session") == session and e.get(
                "event") == "closing connection" and "did not read its reply" in e.get("error", ""), 60, mark)
            writer.close()
        return before, steps, peak

    before, steps, peak = run(main())
    samples = scrape(node.metrics_port())
    assert sum(v for (name, _), v in samples.items() if name == "cakemp_device_restarts_total") == 0
    assert samples["cakemp_buffered_bytes", ()] == 0
    assert steps >= 10
    assert peak - before < RSS_GROWTH_BOUND, f"front RSS grew {(peak - before) >> 20} MiB"
    lines = node.lines[mark:]
    assert not any("Traceback" in line for line in lines)
    events = node.events(mark)
    assert not [e for e in events if e.get("level") in ("error", "critical")], "error logged"
    assert not [e for e in events if e.get("event") == "device restarted" or e.get("event", "").startswith("device failed")]
    refused = sum(1 for e in events if e.get("event") == "request refused")
    closed = sum(1 for e in events if e.get("event") in ("closing connection", "unexpected message, closing"))
    assert samples["cakemp_unread_replies_total", ()] == SLOW_READERS
    print(f"fuzz: {sent} frames on {len(connections)} connections ({len(endings)} ended by a closing frame), "
          f"{SLOW_READERS} slow readers closed; "
          f"{refused} refusals and {closed} closes logged; canary {steps} decode steps; "
          f"front RSS {before >> 20} MiB before, peak {peak >> 20} MiB")


def test_frames_past_the_buffer_budget_wait_unread_until_bytes_are_given_back(node, checkpoint):
    """Connections from one address holding half-sent frames fill the budget exactly, and one more
    holds that address's frame of the reserve of small frames: a master from the same address then
    waits, unread, and is served once one of them closes; a master from another address is served
    at once meanwhile (its frames pass from the reserve); nothing stays held after."""
    ref, other_ref = HFLayers(checkpoint, LAYERS, torch.float32), HFLayers(checkpoint, LAYERS, torch.float32)

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        x = torch.randn(1, 3, HIDDEN)
        torch.testing.assert_close(await master.forward(x, 0), ref(x, 0), atol=F32_ATOL, rtol=0)
        # The budget exactly, then a small frame (1 KiB): the address's one of the reserve.
        sizes = [MAX_PAYLOAD] * (BUFFER_BUDGET // MAX_PAYLOAD) + [BUFFER_BUDGET % MAX_PAYLOAD, 1 << 10]
        hogs = []
        for size in sizes:  # each announces a frame, sends one byte of it, and stalls
            reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
            writer.write(frame(Hello()) + struct.pack(">II", MAGIC, size) + b"\0")
            hogs.append(writer)
        held = BUFFER_BUDGET + (1 << 10)
        while scrape(node.metrics_port())["cakemp_buffered_bytes", ()] < held:
            await asyncio.sleep(0.05)  # the node takes the hogs' frames one by one
        assert scrape(node.metrics_port())["cakemp_buffered_bytes", ()] == held
        x = torch.randn(1, 1, HIDDEN)
        waiting = asyncio.create_task(master.forward(x, 3))
        other = await CakeMaster.connect(node.port, LAYERS, source="127.0.0.2")
        y = torch.randn(1, 2, HIDDEN)
        torch.testing.assert_close(await asyncio.wait_for(other.forward(y, 0), 60), other_ref(y, 0),
                                   atol=F32_ATOL, rtol=0)
        assert not waiting.done()  # a blocked request cannot finish however long it is given
        await other.close()
        hogs.pop().close()
        torch.testing.assert_close(await asyncio.wait_for(waiting, 60), ref(x, 3), atol=F32_ATOL, rtol=0)
        for writer in hogs:
            writer.close()
        await master.close()

    run(main(), timeout=120)
    deadline = time.monotonic() + 30
    while scrape(node.metrics_port())["cakemp_buffered_bytes", ()] != 0:  # the node sees the closes a moment later
        assert time.monotonic() < deadline, "frame bytes still held after every connection closed"
        time.sleep(0.05)
