"""Device processes that die or hang under a running node are restarted in place while it keeps serving.

One node serves the module's tests; the one that ends a node starts its own, on its own checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from cakemp.errors import RemoteWorkerError
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, children, gone, scrape, wait_gone, wait_waiting, write_topology
from tests.support.tolerance import assert_close

HIDDEN = 64
LAYERS = [0, 1, 2, 3]  # layers 0-1 on device 0 (cpu:0), 2-3 on device 1 (cpu:1)
REQUEST_TIMEOUT_S = 3
RESTART_ATTEMPTS = 2


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """The node's $RUNTIME_DIRECTORY, where its ipc sockets live."""
    return tmp_path_factory.mktemp("run")


def start_node(checkpoint, runtime, work) -> RunningNode:
    topology = write_topology(work / "topology.yml", ["model.layers.0-3"])
    return RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32",
                       "--request-timeout", str(REQUEST_TIMEOUT_S), "--restart-attempts", str(RESTART_ATTEMPTS),
                       "--metrics-address", "127.0.0.1:0", env={"RUNTIME_DIRECTORY": str(runtime)})


@pytest.fixture(scope="module")
def node(checkpoint, runtime, tmp_path_factory):
    running = start_node(checkpoint, runtime, tmp_path_factory.mktemp("topo"))
    yield running
    running.kill()


def hf(checkpoint, layers=LAYERS) -> HFLayers:
    return HFLayers(checkpoint, layers, torch.float32)


def restarted(node: RunningNode, device: int, after: int) -> dict:
    """The front's "device restarted" event for `device`, once it comes (after output line `after`)."""
    return node.wait_for(lambda e: e.get("event") == "device restarted" and e.get("device") == device, 60, after)


def test_a_killed_device_is_restarted_while_the_other_serves(node, checkpoint):
    """SIGKILL of cpu:1 fails the request stuck on it, cpu:0 serves meanwhile, cpu:1 comes back in the
    same front (counted in the restart metric), and the session that had state there is told once to
    start again from position 0."""
    victim = node.device_pid(1)
    mark = node.mark()
    port = node.metrics_port()
    restarts = scrape(port).get(("cakemp_device_restarts_total", (("device", "cpu:1"),)), 0)

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        await master.forward(torch.randn(1, 4, HIDDEN), 0)
        os.kill(victim, signal.SIGSTOP)  # hold the next request on device 1
        in_flight = asyncio.create_task(master.forward(torch.randn(1, 1, HIDDEN), 4))
        # Owed by cpu:1 means sent down the route (cpu:0 hands it on; cpu:1 is stopped).
        await asyncio.to_thread(wait_waiting, port, "cpu:1")
        assert not in_flight.done()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RemoteWorkerError, match=r"device cpu:1 died \(exit code -9\)"):
            await in_flight
        # cpu:1 waits out its first backoff before it even starts loading again.
        with pytest.raises(RemoteWorkerError, match=r"device cpu:1 is restarting after it died"):
            await master.forward(torch.randn(1, 1, HIDDEN), 4)
        other = await CakeMaster.connect(node.port, [0, 1])
        x = torch.randn(1, 3, HIDDEN)
        assert_close(await other.forward(x, 0), hf(checkpoint, [0, 1])(x, 0))
        await other.close()
        await asyncio.to_thread(restarted, node, 1, mark)
        with pytest.raises(RemoteWorkerError, match=r"device cpu:1 restarted; this session's KV state was lost"):
            await master.forward(torch.randn(1, 1, HIDDEN), 4)
        x = torch.randn(1, 5, HIDDEN)
        assert_close(await master.forward(x, 0), hf(checkpoint)(x, 0))
        await master.close()

    run(main())
    assert node.process.poll() is None
    assert node.device_pid(1) != victim and gone(victim)
    assert scrape(port)["cakemp_device_restarts_total", (("device", "cpu:1"),)] == restarts + 1


def test_a_hung_device_is_restarted_after_the_request_timeout(node, checkpoint):
    """A device that stops answering (SIGSTOP) is killed after --request-timeout, its request gets
    WorkerError saying so, and once restarted it serves the same session's fresh prefill."""
    victim = node.device_pid(0)
    mark = node.mark()

    async def main():
        master = await CakeMaster.connect(node.port, [0, 1])
        await master.forward(torch.randn(1, 2, HIDDEN), 0)
        os.kill(victim, signal.SIGSTOP)
        with pytest.raises(RemoteWorkerError, match=f"device cpu:0 did not answer within {REQUEST_TIMEOUT_S} s"):
            await master.forward(torch.randn(1, 1, HIDDEN), 2)
        await asyncio.to_thread(restarted, node, 0, mark)
        x = torch.randn(1, 3, HIDDEN)
        assert_close(await master.forward(x, 0), hf(checkpoint, [0, 1])(x, 0))
        await master.close()

    run(main())
    assert node.process.poll() is None
    assert gone(victim)


def test_a_device_that_keeps_failing_to_start_ends_the_node_with_exit_1(tmp_path):
    """With the checkpoint gone, a killed device fails --restart-attempts starts in a row; the front
    then exits 1, leaving no process and no ipc file behind."""
    checkpoint = make_checkpoint(tmp_path, "llama")
    runtime = tmp_path / "run"
    runtime.mkdir()
    node = start_node(checkpoint, runtime, tmp_path)
    spawned = children(node.process.pid)
    (checkpoint / "model.safetensors").unlink()
    try:
        os.kill(node.device_pid(1), signal.SIGKILL)
        assert node.process.wait(timeout=60) == 1
    finally:
        node.kill()
    failures = [e for e in node.events() if e.get("event") == "device restart failed"]
    assert [e["attempt"] for e in failures] == list(range(1, RESTART_ATTEMPTS + 1))
    assert all("model.safetensors" in e["error"] for e in failures)
    assert f"failed to start {RESTART_ATTEMPTS} times in a row" in node.wait_for(
        lambda e: e.get("event", "").startswith("giving up"))["error"]
    assert wait_gone(spawned) == set()
    assert list(runtime.iterdir()) == []
