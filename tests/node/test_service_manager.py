"""`cakemp run` as a service manager sees it: sd_notify datagrams on a real socket, the metrics
endpoint, and the stop on SIGTERM (drain) or on a second signal (at once).

One node serves the module's tests; the two that stop a node start their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from pathlib import Path

import pytest
import torch

from cakemp.errors import ProtocolError, RemoteWorkerError
from cakemp.master.client import WorkerClient
from tests.support.checkpoints import HFLayers
from tests.support.master import CakeMaster, to_raw
from tests.support.node import (
    RunningNode,
    children,
    http_status,
    kv_bytes,
    quiescent,
    scrape,
    wait_gone,
    wait_waiting,
    write_topology,
)
from tests.support.tolerance import assert_close

HIDDEN = 64
LAYERS = [0, 1, 2, 3]  # layers 0-1 on cpu:0, 2-3 on cpu:1
WATCHDOG_USEC = 400_000
MANAGER_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class NotifySocket:
    """A bound AF_UNIX datagram socket standing in for systemd's, keeping every datagram it receives.

    A thread reads it as systemd does, promptly: a socket left unread fills up and the node's
    notifications would be dropped.
    """

    def __init__(self, path: Path):
        self.path = str(path)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self.path)
        self.received: list[list[str]] = []  # each datagram's KEY=VALUE assignments
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                datagram = self._socket.recv(4096)
            except OSError:  # closed
                return
            with self._changed:
                self.received.append(datagram.decode().split("\n"))
                self._changed.notify_all()

    def wait_until(self, condition, timeout: float = 30.0) -> None:
        """Wait until condition(every datagram so far) holds."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self.received), timeout):
                raise AssertionError(f"the awaited notifications never came; got {self.received}")

    def close(self) -> None:
        self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def keys(datagrams: list[list[str]]) -> list[str]:
    """The datagrams as their first assignment's key: READY, STATUS, WATCHDOG, ..."""
    return [assignments[0].split("=", 1)[0] for assignments in datagrams]


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    return write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    sock = NotifySocket(tmp_path_factory.mktemp("manager") / "notify")
    yield sock
    sock.close()


def managed_node(checkpoint, topology, runtime: Path, manager: NotifySocket) -> RunningNode:
    """Two CPU devices, a watchdog, and metrics on a kernel-chosen port, under `manager`."""
    return RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--metrics-address", "127.0.0.1:0",
                       env={"NOTIFY_SOCKET": manager.path, "WATCHDOG_USEC": str(WATCHDOG_USEC),
                            "RUNTIME_DIRECTORY": str(runtime)})


@pytest.fixture(scope="module")
def node(checkpoint, topology, runtime, manager):
    running = managed_node(checkpoint, topology, runtime, manager)
    yield running
    running.kill()


def test_status_while_loading_then_ready_then_watchdog_pings(node, manager):
    """The manager hears loading STATUS lines and EXTEND_TIMEOUT_USEC, then one READY=1 with the
    serving status, then WATCHDOG=1 pings; nothing says STOPPING."""

    def pinged_after_ready(received):
        return "READY" in keys(received) and "WATCHDOG" in keys(received)[keys(received).index("READY"):]

    manager.wait_until(pinged_after_ready)
    ready = keys(manager.received).index("READY")
    assert manager.received[ready] == ["READY=1", f"STATUS=serving 4 layers on 2 devices at 127.0.0.1:{node.port}"]
    before, after = manager.received[:ready], manager.received[ready + 1:]
    statuses = [a[0] for a in before if a[0].startswith("STATUS=")]
    assert statuses[0] == "STATUS=loading layers: cpu:0 0/2, cpu:1 0/2"
    assert all(s.startswith("STATUS=loading layers: ") for s in statuses)
    assert "STATUS=loading layers: cpu:0 2/2, cpu:1 2/2" in statuses
    assert "EXTEND_TIMEOUT_USEC" in keys(before)
    assert set(keys(after)) == {"WATCHDOG"}
    assert "STOPPING" not in keys(manager.received)


def test_device_processes_do_not_see_the_manager_variables(node, runtime):
    """/proc/<pid>/environ of both device processes (and multiprocessing's resource tracker) holds
    RUNTIME_DIRECTORY but no NOTIFY_SOCKET or WATCHDOG_*."""
    spawned = children(node.process.pid)
    assert {node.device_pid(0), node.device_pid(1)} <= spawned
    for pid in spawned:
        environ = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if entry)
        assert environ["RUNTIME_DIRECTORY"] == str(runtime)
        assert not set(MANAGER_VARIABLES) & set(environ)


def test_metrics_parse_and_move_as_requests_are_served(node):
    """/metrics parses with prometheus_client; three Batches and one bad request move the request,
    error, byte, latency, session and KV series; /healthz and /readyz answer 200."""
    port = node.metrics_port()
    assert http_status(port, "/healthz") == 200 and http_status(port, "/readyz") == 200
    before = quiescent(port)
    assert before["cakemp_ready", ()] == 1

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        for pos, length in ((0, 4), (4, 1), (5, 1)):
            await master.forward(torch.randn(1, length, HIDDEN), pos)
        with pytest.raises(RemoteWorkerError, match="could not find layer"):
            await master.clients[0].batch(to_raw(torch.randn(1, 1, HIDDEN)), [("model.layers.9", 0, 9)])
        during = await asyncio.to_thread(scrape, port)
        await master.close()
        return during

    during = run(main())
    after = scrape(port)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("cakemp_requests_total") == 4
    assert moved("cakemp_request_errors_total", (("error", "UnknownLayer"),)) == 1
    assert moved("cakemp_received_bytes_total") > 6 * HIDDEN * 4
    assert moved("cakemp_sent_bytes_total") > 6 * HIDDEN * 4
    for device in ("cpu:0", "cpu:1"):
        assert moved("cakemp_device_request_duration_seconds_count", (("device", device),)) == 3
        assert during["cakemp_kv_cache_bytes", (("device", device),)] > 0
    assert during["cakemp_connections", ()] == len(LAYERS)
    assert all(kv_bytes(quiescent(port), device) == kv_bytes(before, device) for device in ("cpu:0", "cpu:1"))


def test_a_second_signal_exits_at_once(checkpoint, topology, tmp_path):
    """SIGTERM starts a drain that waits on a stalled device; a second SIGTERM ends the node at once
    with exit 1, its device processes and runtime directory gone."""
    node = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--metrics-address", "127.0.0.1:0",
                       env={"RUNTIME_DIRECTORY": str(tmp_path)})
    devices = {node.device_pid(0), node.device_pid(1)}
    port = node.metrics_port()

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            os.kill(node.device_pid(1), signal.SIGSTOP)
            in_flight = asyncio.create_task(
                client.batch(to_raw(torch.randn(1, 2, HIDDEN)), [(f"model.layers.{i}", 0, i) for i in LAYERS]))
            await asyncio.to_thread(wait_waiting, port, "cpu:1")  # sent down the route to the stalled cpu:1
            node.process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "draining")
            node.process.send_signal(signal.SIGTERM)
            with pytest.raises(ProtocolError, match="closed"):
                await in_flight

    try:
        run(main())
        assert node.process.wait(timeout=10) == 1
    finally:
        node.kill()
    assert wait_gone(devices) == set()
    assert list(tmp_path.iterdir()) == []


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(checkpoint, topology, tmp_path):
    """After SIGTERM the manager hears STOPPING=1, /readyz turns 503 and new connections are refused,
    while the request held on a stalled device completes correctly; then the node exits 0 with no
    process and no ipc file left."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    manager = NotifySocket(tmp_path / "notify")
    node = managed_node(checkpoint, topology, runtime, manager)
    spawned = children(node.process.pid)
    device = node.device_pid(1)
    port = node.metrics_port()
    x = torch.randn(1, 3, HIDDEN)

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        os.kill(device, signal.SIGSTOP)
        try:
            in_flight = asyncio.create_task(master.forward(x, 0))
            await asyncio.to_thread(wait_waiting, port, "cpu:1")  # sent down the route to the stalled cpu:1
            node.process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(manager.wait_until, lambda received: "STOPPING" in keys(received))
            assert await asyncio.to_thread(http_status, node.metrics_port(), "/readyz") == 503
            with pytest.raises(ConnectionRefusedError):
                await WorkerClient.connect("127.0.0.1", node.port)
            assert not in_flight.done()
        finally:
            os.kill(device, signal.SIGCONT)
        y = await in_flight
        await master.close()
        return y

    try:
        y = run(main())
        assert node.process.wait(timeout=30) == 0
        received = list(manager.received)  # everything the node sent, now that it has exited
    finally:
        manager.close()
        node.kill()
    assert_close(y, HFLayers(checkpoint, LAYERS, torch.float32)(x, 0))
    assert wait_gone(spawned) == set()
    assert list(runtime.iterdir()) == []
    stopping = keys(received).index("STOPPING")
    assert received[stopping] == ["STOPPING=1", "STATUS=draining 1 requests in flight"]
    assert set(keys(received[stopping + 1:])) <= {"WATCHDOG"}  # the loop still turns while it drains
