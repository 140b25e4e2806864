"""Flags of `cakemp run` seen from outside a running node: the default --dtype (f16),
--kv-budget-mib through the front, --cpu-threads in the device process, and --drain-timeout
running out.

One node (one CPU device, every flag but the drain's) serves the module; the drain test ends
its own node.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from cakemp.errors import RemoteWorkerError
from cakemp.master.client import WorkerClient
from tests.support.checkpoints import HFLayers
from tests.support.master import CakeMaster, from_raw, to_raw
from tests.support.node import (
    RunningNode,
    kv_bytes,
    quiescent,
    scrape,
    wait_gone,
    wait_until,
    wait_waiting,
    write_topology,
)
from tests.support.tolerance import assert_close, half_bound

HIDDEN = 64
LAYERS = [0, 1, 2, 3]
OPS = [(f"model.layers.{i}", 0, i) for i in LAYERS]
BUDGET_MIB = 1
# The tiny checkpoint in f16: 2 (K and V) * 2 kv heads * 16 dims * 2 bytes = 128 bytes per
# position and layer; a PROMPT-token prompt takes 16 blocks of 16 positions (kv_cache.BLOCK) in each
# of the 4 layers, 128 KiB, so 8 sessions fill the 1 MiB budget exactly.
PROMPT = 255
SESSION_BYTES = 128 * 256 * len(LAYERS)
SESSIONS_IN_BUDGET = BUDGET_MIB * 2**20 // SESSION_BYTES
# Not what the node would choose by itself (the cores divided among its one CPU device).
THREADS = len(os.sched_getaffinity(0)) + 1


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    return write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])


@pytest.fixture(scope="module")
def node(checkpoint, topology):
    """One CPU device, no --dtype (so f16), a 1 MiB KV budget, THREADS torch threads."""
    running = RunningNode(checkpoint, topology, "--gpus", "cpu", "--kv-budget-mib", str(BUDGET_MIB),
                          "--cpu-threads", str(THREADS), "--metrics-address", "127.0.0.1:0")
    yield running
    assert running.stop() == 0


def test_the_default_dtype_is_f16(node, checkpoint):
    """Without --dtype the node says F16 and computes within 8 f16 eps of HF's f32 layers."""
    ref = HFLayers(checkpoint, LAYERS, torch.float32)

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            assert (await client.hello()).dtype == "F16"
            x = torch.randn(1, 5, HIDDEN).half()
            return x, from_raw(await client.batch(to_raw(x, torch.float16), OPS))

    x, y = run(main())
    assert_close(y, ref(x.float(), 0), half_bound(torch.float16))


def test_the_device_runs_cpu_threads_torch_threads(node):
    """--cpu-threads reaches the device process: torch there runs that many intra-op threads."""
    ready = node.wait_for(lambda e: e.get("event") == "device ready")
    assert ready["threads"] == THREADS


def test_the_front_and_the_device_take_what_they_loaded_out_of_the_garbage_collectors_passes(node):
    """Each process says how many objects it froze once loaded: torch's alone are tens of thousands."""
    ready = node.wait_for(lambda e: e.get("event") == "device ready")
    listening = node.wait_for(lambda e: e.get("event") == "listening")
    assert ready["frozen_objects"] > 50_000 and listening["frozen_objects"] > 5_000


def test_the_kv_budget_refuses_a_session_until_another_closes(node):
    """With the budget full, a new session's prefill gets WorkerError naming the budget while the
    sessions already in keep their caches, and decode within their last blocks but not into new
    ones (refused alike); once one of them closes the refused ones are served on the same connections."""
    port = node.metrics_port()
    assert kv_bytes(quiescent(port), "cpu:0") == 0  # no connection open: no cache held

    async def main():
        clients = []
        for _ in range(SESSIONS_IN_BUDGET + 1):  # each says Hello as it connects, as a Cake master's do
            clients.append(client := await WorkerClient.connect("127.0.0.1", node.port))
            await client.hello()
        *admitted, refused = clients
        for client in admitted:
            await client.batch(to_raw(torch.randn(1, PROMPT, HIDDEN), torch.float16), OPS)
        full = await asyncio.to_thread(scrape, port)
        with pytest.raises(RemoteWorkerError, match=r"only 0 B of this device.s 1\.0 MiB budget is left"):
            await refused.batch(to_raw(torch.randn(1, 1, HIDDEN), torch.float16), OPS)
        # A session already in decodes on within its last block, but not into a new one.
        await admitted[0].batch(to_raw(torch.randn(1, 1, HIDDEN), torch.float16), [(n, PROMPT, i) for n, _, i in OPS])
        opening = [(n, PROMPT + 1, i) for n, _, i in OPS]  # the first row of a 17th block in every layer
        with pytest.raises(RemoteWorkerError, match=r"only 0 B of this device.s 1\.0 MiB budget is left"):
            await admitted[0].batch(to_raw(torch.randn(1, 1, HIDDEN), torch.float16), opening)
        await admitted[-1].close()
        await asyncio.to_thread(wait_until_freed, port, full)
        y = await refused.batch(to_raw(torch.randn(1, 1, HIDDEN), torch.float16), OPS)
        opened = await admitted[0].batch(to_raw(torch.randn(1, 1, HIDDEN), torch.float16), opening)  # room now
        for client in clients[:-2] + [refused]:
            await client.close()
        return full, y, opened

    full, y, opened = run(main())
    assert kv_bytes(full, "cpu:0") == SESSIONS_IN_BUDGET * SESSION_BYTES == BUDGET_MIB * 2**20
    assert y.shape == opened.shape == (1, 1, HIDDEN)


def wait_until_freed(port: int, full) -> None:
    """Wait until the device has reported one session's bytes fewer than `full`."""
    wait_until(lambda: kv_bytes(scrape(port), "cpu:0") == kv_bytes(full, "cpu:0") - SESSION_BYTES,
               what="the closed session's cache being freed")


def test_a_drain_that_times_out_fails_the_stalled_request_and_exits_0(checkpoint, topology, tmp_path):
    """SIGTERM with a request stuck on a stalled device: after --drain-timeout the front logs the
    timeout, the request gets WorkerError saying the device is stopping, and the node exits 0 with
    its device processes gone."""
    node = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--drain-timeout", "0.5",
                       "--metrics-address", "127.0.0.1:0", env={"RUNTIME_DIRECTORY": str(tmp_path)})
    devices = {node.device_pid(0), node.device_pid(1)}
    port = node.metrics_port()

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        os.kill(node.device_pid(1), signal.SIGSTOP)
        in_flight = asyncio.create_task(master.forward(torch.randn(1, 2, HIDDEN), 0))
        await asyncio.to_thread(wait_waiting, port, "cpu:1")  # sent down the route to the stalled cpu:1
        node.process.send_signal(signal.SIGTERM)
        with pytest.raises(RemoteWorkerError, match="devices cpu:0, cpu:1 are stopping"):
            await in_flight
        await master.close()

    try:
        run(main())
        assert node.process.wait(timeout=30) == 0
    finally:
        node.kill()
    timed_out = node.wait_for(lambda e: e.get("event", "").startswith("drain timeout"))
    assert timed_out["in_flight"] == 1
    assert wait_gone(devices) == set()
    assert list(tmp_path.iterdir()) == []
