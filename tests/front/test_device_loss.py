"""A device process killed under a running node: the master hears of it, the node goes away cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from cakemp.errors import RemoteWorkerError
from tests.checkpoints import make_checkpoint
from tests.front.master import CakeMaster
from tests.front.node import RunningNode, write_topology


def children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def gone(pid: int) -> bool:
    """True once `pid` no longer runs (a zombie nobody reaps counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """The pids still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := {p for p in pids if not gone(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.fixture
def node(tmp_path):
    checkpoint = make_checkpoint(tmp_path, "llama")
    topology = write_topology(tmp_path / "topology.yml", ["model.layers.0-3"])
    runtime = tmp_path / "run"
    runtime.mkdir()
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32",
                          env={"RUNTIME_DIRECTORY": str(runtime)})
    yield running, runtime
    if running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def device_pid(node: RunningNode, index: int) -> int:
    return node.wait_for(lambda e: e.get("event") == "device ready" and e.get("device") == index)["pid"]


def test_a_killed_device_fails_in_flight_requests_and_the_node_exits(node):
    """SIGKILL of device 1 answers the request stuck on it with WorkerError naming cpu:1; the front
    exits 1, leaving no process and no ipc directory behind."""
    node, runtime = node
    assert any(runtime.iterdir())  # the ipc directory lives here while serving
    victim = device_pid(node, 1)
    spawned = children(node.process.pid)

    async def main():
        master = await CakeMaster.connect(node.port, [0, 1, 2, 3])
        await master.forward(torch.randn(1, 4, 64), 0)
        os.kill(victim, signal.SIGSTOP)  # hold the next request on device 1
        in_flight = asyncio.create_task(master.forward(torch.randn(1, 1, 64), 4))
        await asyncio.sleep(0.5)
        assert not in_flight.done()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RemoteWorkerError, match="device cpu:1 died"):
            await in_flight
        await master.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert node.process.wait(timeout=30) == 1
    assert wait_gone(spawned) == set()
    assert list(runtime.iterdir()) == []


def test_devices_exit_when_the_front_is_killed(node):
    """SIGKILL of the front takes every device process with it."""
    node, _ = node
    devices = {device_pid(node, 0), device_pid(node, 1)}
    node.process.kill()
    node.process.wait()
    assert wait_gone(devices) == set()
