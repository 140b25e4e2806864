"""A Qwen3.5-MoE checkpoint served by `cakemp run --gpus cpu:2`, driven by a Cake-style master over TCP.

Layers 0-3 (linear, linear, linear, full attention; every layer MoE) are split over two CPU
device processes, 0-1 and 2-3, so each request crosses the device boundary and both layer
kinds run. One node, at protocol revision 2 (Cake's, since Qwen3.5-MoE came after fa7d08a):
the revisions differ only in tags the wire tests cover, and a node costs ~30 s to start on a
loaded machine (revisions x dtypes are covered at the block level, not by a node per combination).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers.cache_utils import DynamicCache

from cakemp.errors import RemoteWorkerError
from cakemp.wire import Revision
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, scrape, write_topology
from tests.support.tolerance import F32_REL, rel_error

PREFIX = "model.language_model.layers"
LAYERS = [0, 1, 2, 3]
HIDDEN = 64
BUDGET_MIB = 1  # per device: a 5000-token prompt needs 1.2 MiB of K/V rows on device 1


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3_5_moe", shards=3)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", [f"{PREFIX}.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--protocol", "2",
                          "--kv-budget-mib", str(BUDGET_MIB), "--max-context", "8192",
                          "--metrics-address", "127.0.0.1:0")
    yield running
    assert running.stop() == 0


async def connect(node) -> CakeMaster:
    return await CakeMaster.connect(node.port, LAYERS, revision=Revision.V2, prefix=PREFIX)


def kv_bytes(node) -> list[float]:
    seen = scrape(node.metrics_port())
    return [seen.get(("cakemp_kv_cache_bytes", (("device", f"cpu:{d}"),)), 0.0) for d in (0, 1)]


def test_prompt_in_3_token_chunks_then_decode_match_hf_across_both_devices(node, checkpoint):
    """A 9-token prompt sent as three 3-token chunks, then 8 decode steps, match HF's layers 0-3;
    so does a 7-token prefill on a second session; Goodbye frees every session's state."""
    ref = HFLayers(checkpoint, LAYERS, torch.float32)
    generator = torch.Generator().manual_seed(3)

    async def main():
        chunked, whole = await connect(node), await connect(node)
        position = 0
        for T in [3, 3, 3] + [1] * 8:
            x = torch.randn(1, T, HIDDEN, generator=generator)
            assert rel_error(await chunked.forward(x, position), ref(x, position)) <= F32_REL
            position += T
        x = torch.randn(1, 7, HIDDEN, generator=generator)
        ref.cache = DynamicCache(config=ref.config)  # HF's side of the second session
        assert rel_error(await whole.forward(x, 0), ref(x, 0)) <= F32_REL
        assert all(held > 0 for held in kv_bytes(node))
        await chunked.goodbye()
        await whole.goodbye()
        assert kv_bytes(node) == [0, 0]
        await chunked.close()
        await whole.close()

    run(main())


def test_rewind_to_a_middle_position_is_refused_by_name(node):
    """After 6 positions, a request at index_pos 3 gets a WorkerError saying the recurrent state cannot be rewound."""

    async def main():
        master = await connect(node)
        await master.forward(torch.randn(1, 6, HIDDEN), 0)
        with pytest.raises(RemoteWorkerError, match="cannot be rewound.*consumed 6 positions"):
            await master.forward(torch.randn(1, 1, HIDDEN), 3)
        await master.forward(torch.randn(1, 1, HIDDEN), 6)  # continuing still works
        await master.close()

    run(main())


def test_budget_error_is_a_worker_error_and_a_closed_connection_frees_the_state(node):
    """A prompt whose K/V rows pass the budget is refused; closing the connection frees what the session held."""

    async def main():
        master = await connect(node)
        with pytest.raises(RemoteWorkerError, match="budget"):
            await master.forward(torch.randn(1, 5000, HIDDEN), 0)
        await master.forward(torch.randn(1, 4, HIDDEN), 0)
        assert all(held > 0 for held in kv_bytes(node))
        await master.close()

    run(main())
    deadline = time.monotonic() + 30  # the front frees a closed session's state after the close
    while kv_bytes(node) != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_bytes(node) == [0, 0]


def test_a_prompt_failing_part_way_leaves_no_half_applied_state(node):
    """A 5000-token prompt goes in chunks and passes the budget on device 1 well after its first chunks ran
    both devices' linear layers: the session is told once that its state there was dropped, nothing then
    continues from a half-applied recurrence, and a fresh prompt is served."""

    async def main():
        master = await connect(node)
        with pytest.raises(RemoteWorkerError, match="budget"):
            await master.forward(torch.randn(1, 5000, HIDDEN), 0)
        with pytest.raises(RemoteWorkerError, match="failed part-way.*dropped rather than kept half-applied.*fresh prefill"):
            await master.forward(torch.randn(1, 1, HIDDEN), 128)
        with pytest.raises(RemoteWorkerError, match="does not follow the 0 positions"):  # dropped, not kept
            await master.forward(torch.randn(1, 1, HIDDEN), 128)
        await master.forward(torch.randn(1, 4, HIDDEN), 0)
        await master.forward(torch.randn(1, 1, HIDDEN), 4)
        await master.close()

    run(main())


def test_a_request_failing_part_way_is_answered_once_every_device_dropped_its_state(node):
    """A decode that device 0 ran and device 1 refuses (device 1 is a position behind: the request before it
    named device 0's layers alone) leaves device 0's linear state half-applied: it is dropped on both devices,
    and the master is answered only once they have dropped it. Told earlier, its next request could reach a
    device (handed on by the one before it) ahead of the drop, and have its new state dropped after it."""

    async def main():
        master = await connect(node)
        await master.forward(torch.randn(1, 4, HIDDEN), 0)
        await CakeMaster(master.clients, [0, 1], PREFIX).forward(torch.randn(1, 1, HIDDEN), 4)  # device 0 alone: 5 in
        device0, device1 = node.device_pid(0), node.device_pid(1)
        os.kill(device1, signal.SIGSTOP)
        try:
            failing = asyncio.ensure_future(master.forward(torch.randn(1, 1, HIDDEN), 5))
            await asyncio.sleep(1.0)  # device 0 runs it and hands it on to device 1, stopped
            os.kill(device0, signal.SIGSTOP)
            os.kill(device1, signal.SIGCONT)  # device 1 refuses it: 4 positions in, not 5
            done, _ = await asyncio.wait({failing}, timeout=1.0)
            assert not done, "answered while device 0, stopped, still held the half-applied state"
        finally:
            os.kill(device0, signal.SIGCONT)
            os.kill(device1, signal.SIGCONT)
        with pytest.raises(RemoteWorkerError, match="does not follow the 4 positions"):
            await failing
        await master.forward(torch.randn(1, 4, HIDDEN), 0)  # a fresh prompt, then its decode
        await master.forward(torch.randn(1, 1, HIDDEN), 4)
        await master.close()

    run(main())
