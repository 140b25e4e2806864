"""Sixty-four stalled masters, each from its own address, against a live keyed node: a fresh master from
another address is served while every one of them still holds what it took.

Each stalled source proves the key and says Hello on several connections, and then sends only frame
headers: large frames first, filling the buffer budget exactly (each source within its share), then a
64 KiB frame on another connection (its place in the reserve of small frames, the budget being
spent), then Hello and one more large or small header on two more connections, which wait (a
source whose place is held delays only its own small frames). A fresh master from another
address then connects (the key handshake and Hello on each of its connections) and sends a 1-token
Batch, checked against HF's layers. It must be answered while every stalled frame is still held and
every stalled connection still open: nothing of theirs is given back before the frame timeout, so
the master was served beside them, not after them. Run with the node's default budget and with
--max-buffered-mib 4; the seconds each step took are printed.
"""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import torch

from cakemp.auth import authenticate_worker
from cakemp.front.admission import LayerAdmission
from cakemp.front.buffer_budget import SMALL_FRAME
from cakemp.wire import HEADER_SIZE, MAGIC, Hello, Revision, WorkerInfo, decode_payload, encode_frame, read_header
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, scrape, write_topology

KEY = "stalled sources secret"
HIDDEN = 64
LAYERS = [0, 1]
CONTEXT = 32768  # the model's: a full-context f32 frame is a little over 8 MiB
SOURCES = [f"127.0.0.{10 + i}" for i in range(64)]
FRESH = "127.0.0.2"
F32_ATOL = 1e-4
# name -> (the flags past the model's, the budget in bytes, the context the node serves)
SETUPS = {
    "default flags": ((), 1024 << 20, CONTEXT),
    "--max-buffered-mib 4": (("--max-buffered-mib", "4", "--max-context", "8192"), 4 << 20, 8192),
}


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", num_hidden_layers=2,
                           max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request, checkpoint, tmp_path_factory):
    flags, budget, context = SETUPS[request.param]
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-1"])
    node = RunningNode(checkpoint, topology, "--gpus", "cpu", "--dtype", "f32", "--metrics-address", "127.0.0.1:0",
                       *flags, env={"CAKE_CLUSTER_KEY": KEY})
    yield request.param, node, budget, context
    node.kill()


def buffered(node: RunningNode) -> float:
    return scrape(node.metrics_port())["cakemp_buffered_bytes", ()]


async def buffered_reaches(node: RunningNode, held: int) -> None:
    """Wait until the node holds `held` frame bytes (it takes the stalled frames one by one)."""
    deadline = time.monotonic() + 60
    while (now := await asyncio.to_thread(buffered, node)) < held:
        assert time.monotonic() < deadline, f"the node holds {now} bytes, not {held}"
        await asyncio.sleep(0.05)
    assert now == held, (now, held)


async def stalled(port: int, source: str, size: int, handshakes: asyncio.Semaphore,
                  answered: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """From `source`: the key handshake (within `handshakes`: the node keeps 64 places for them), Hello
    (awaiting its answer if `answered`), then a header announcing `size` bytes and nothing more."""
    async with handshakes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        await authenticate_worker(reader, writer, KEY)
    writer.writelines(encode_frame(Hello(), Revision.V2))
    if answered:
        header = await reader.readexactly(HEADER_SIZE)
        assert isinstance(decode_payload(await reader.readexactly(read_header(header)), Revision.V2), WorkerInfo)
    writer.write(struct.pack(">II", MAGIC, size))
    await writer.drain()
    return reader, writer


def test_a_fresh_master_is_served_beside_sixty_four_stalled_sources(setup, checkpoint):
    """A fresh master's Hello and 1-token Batch are answered exactly while 64 stalled sources hold the
    whole budget, each its place in the reserve, and each has more frames waiting. (Before, the first 16
    stalled sources took the one pool of 16 small frames, and the fresh master waited for their frame
    timeout.)"""
    name, node, budget, context = setup
    max_payload = LayerAdmission(frozenset(f"model.layers.{i}" for i in LAYERS), HIDDEN, context,
                                 frozenset(LAYERS)).max_payload()
    large = 1 << (max_payload.bit_length() - 1)  # the largest power of two a frame may be: it divides the budget
    ref = HFLayers(checkpoint, LAYERS, torch.float32)

    async def main():
        handshakes = asyncio.Semaphore(32)
        started = time.monotonic()
        # The budget exactly, in large frames dealt to the sources in turn: none past its share.
        held = await asyncio.gather(*(stalled(node.port, SOURCES[i % len(SOURCES)], large, handshakes)
                                      for i in range(budget // large)))
        await buffered_reaches(node, budget)
        # The budget spent: each source's small frame holds its place in the reserve.
        held += await asyncio.gather(*(stalled(node.port, source, SMALL_FRAME, handshakes) for source in SOURCES))
        full = budget + len(SOURCES) * SMALL_FRAME
        await buffered_reaches(node, full)
        # And more of both sizes wait, on connections whose Hellos wait too: for their source's place.
        held += await asyncio.gather(*(stalled(node.port, source, size, handshakes, answered=False)
                                       for source in SOURCES for size in (large, 1 << 10)))
        stalling_s = time.monotonic() - started
        started = time.monotonic()
        master = await CakeMaster.connect(node.port, LAYERS, cluster_key=KEY, source=FRESH)
        hello_s = time.monotonic() - started
        x = torch.randn(1, 1, HIDDEN)
        started = time.monotonic()
        y = await master.forward(x, 0)
        batch_s = time.monotonic() - started
        torch.testing.assert_close(y, ref(x, 0), atol=F32_ATOL, rtol=0)
        await master.close()
        still = await asyncio.to_thread(buffered, node)
        open_ = sum(not reader.at_eof() for reader, _ in held)
        for _, writer in held:
            writer.close()
        return stalling_s, hello_s, batch_s, still, full, open_, len(held)

    stalling_s, hello_s, batch_s, still, full, open_, count = run(main())
    assert still == full, "stalled frames were given back before the fresh master was served"
    assert open_ == count
    print(f"{name}: {count} stalled connections from {len(SOURCES)} addresses holding {full / 2**20:g} MiB; "
          f"(set up in {stalling_s:.1f} s); a fresh master's connect and Hello {hello_s:.3f} s, its 1-token Batch {batch_s:.3f} s")
