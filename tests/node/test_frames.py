"""Frames at the size cap, full of what a decoder would have to build: a live node refuses each from
its counts (security review H3).

The node allows frames of about 16 MiB (a 65,536-position context of hidden 64 in f32). One
frame of that size full of ops, or of tensor dimensions, once made the front build every item
(8-12x the frame in memory, seconds of a blocked event loop) and log the whole shape. Each test
checks the hostile frame's answer, that a bystander session decodes exactly as HF's layers
after it, how much the front's peak memory and its log grew, and prints the Hello round trip
of a second master while the frame is decoded (not asserted: timings vary by machine).
"""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path

import pytest
import torch

from cakemp.master.client import WorkerClient
from cakemp.wire import (
    HEADER_SIZE,
    MAGIC,
    Batch,
    DType,
    Hello,
    Revision,
    WorkerError,
    WorkerInfo,
    decode_payload,
    encode_frame,
    read_header,
)
from cakemp.wire.messages import VARIANTS
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, write_topology
from tests.support.tolerance import assert_close

HIDDEN = 64
LAYERS = [0, 1]
CONTEXT = 65536  # frames up to 16 MiB of f32 activation


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", num_hidden_layers=2,
                           max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-1"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu", "--dtype", "f32", "--max-context", str(CONTEXT))
    yield running
    running.kill()


def peak_rss(node: RunningNode) -> int:
    """The front's peak resident memory (VmHWM), bytes."""
    status = Path(f"/proc/{node.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) << 10


def batch_payload(tensor: bytes, ops: int) -> bytes:
    """A Batch payload: a one-token activation, then `ops` copies of (model.layers.0, 0, 0)."""
    op = struct.pack(">I", 14) + b"model.layers.0" + struct.pack(">QQ", 0, 0)
    tag = [variant.cls for variant in VARIANTS if variant.since <= Revision.V2].index(Batch)  # speedy's: its place
    return struct.pack(">I", tag) + tensor + struct.pack(">I", ops) + op * ops


def tensor_bytes(shape: tuple[int, ...], data: bytes) -> bytes:
    """A RawTensor's encoding: data (Vec<u8>), dtype (u8), shape (Vec<usize>)."""
    return (struct.pack(">I", len(data)) + data + struct.pack(">B", DType.F32)
            + struct.pack(">I", len(shape)) + b"".join(struct.pack(">Q", d) for d in shape))


def frame(payload: bytes) -> bytes:
    return struct.pack(">II", MAGIC, len(payload)) + payload


async def answer(reader: asyncio.StreamReader):
    return decode_payload(await reader.readexactly(read_header(await reader.readexactly(HEADER_SIZE))), Revision.V2)


async def attacked(node: RunningNode, checkpoint, payload: bytes) -> tuple[str, float, int, int]:
    """Send `payload` as one frame (after Hello) on a keyless node between a bystander's prefill and its
    decode; (the WorkerError text, a second master's Hello round trip meanwhile, front peak RSS growth,
    log bytes written)."""
    ref = HFLayers(checkpoint, LAYERS, torch.float32)
    bystander = await CakeMaster.connect(node.port, LAYERS)
    x = torch.randn(1, 5, HIDDEN)
    assert_close(await bystander.forward(x, 0), ref(x, 0))
    rss, mark = peak_rss(node), node.mark()
    logged = sum(len(line) for line in node.lines)
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    writer.writelines(encode_frame(Hello(), Revision.V2))
    assert isinstance(await answer(reader), WorkerInfo)
    async with await WorkerClient.connect("127.0.0.1", node.port) as probe:
        writer.write(frame(payload))
        start = time.perf_counter()
        await probe.hello()
        hello_s = time.perf_counter() - start
        refusal = await answer(reader)
    writer.close()
    assert isinstance(refusal, WorkerError), refusal
    x = torch.randn(1, 1, HIDDEN)
    assert_close(await bystander.forward(x, 5), ref(x, 5))
    await bystander.close()
    node.wait_for(lambda e: e.get("event") == "request refused", after=mark)
    grown = sum(len(line) for line in node.lines) - logged
    return refusal.message, hello_s, peak_rss(node) - rss, grown


def test_a_frame_at_the_cap_full_of_ops_is_refused_from_its_count(node, checkpoint):
    """About 16 MiB of valid ops (493,000 of them) for a node serving 2 layers: BadOps naming both
    counts, with no op built: the front's peak memory grows by less than twice the frame (once 8x),
    and a line or two are logged."""
    ops = (16 << 20) // 34  # 34 bytes each: the frame stays under the cap
    payload = batch_payload(tensor_bytes((1, 1, HIDDEN), bytes(4 * HIDDEN)), ops)
    message, hello_s, grown_rss, logged = asyncio.run(asyncio.wait_for(attacked(node, checkpoint, payload), 120))
    print(f"ops frame: {len(payload) >> 20} MiB, Hello meanwhile {hello_s * 1e3:.1f} ms, "
          f"front peak RSS +{grown_rss >> 20} MiB, log +{logged} bytes")
    assert f"the request has {ops} ops; this worker serves 2 layers" in message
    assert grown_rss < 2 * len(payload)
    assert logged < 4096


def test_a_frame_at_the_cap_full_of_dimensions_is_refused_and_not_repeated(node, checkpoint):
    """A tensor of 2 million dimensions (16 MiB) whose bytes cannot match them: BadTensor saying how
    many, from the count; neither the answer nor the log repeats the shape (once a 21 MiB line)."""
    dims = (16 << 20) // 8
    payload = batch_payload(tensor_bytes((2,) * dims, bytes(4)), 1)
    message, hello_s, grown_rss, logged = asyncio.run(asyncio.wait_for(attacked(node, checkpoint, payload), 120))
    print(f"dims frame: {len(payload) >> 20} MiB, Hello meanwhile {hello_s * 1e3:.1f} ms, "
          f"front peak RSS +{grown_rss >> 20} MiB, log +{logged} bytes")
    assert f"shape of {dims} dimensions, at most 8" in message and len(message) < 200
    assert grown_rss < 2 * len(payload)
    assert logged < 4096


def test_the_frames_leave_a_legitimate_master_served(node, checkpoint):
    """After both frames, a new master's prefill and decode still match HF's layers."""
    ref = HFLayers(checkpoint, LAYERS, torch.float32)

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        for x, position in ((torch.randn(1, 7, HIDDEN), 0), (torch.randn(1, 1, HIDDEN), 7)):
            assert_close(await master.forward(x, position), ref(x, position))
        await master.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert node.process.poll() is None
