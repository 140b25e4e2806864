"""NodeStatus: what the service manager, /readyz and a terminal are told as the node loads, serves, heals and stops."""

from __future__ import annotations

import io
import os
import socket

import pytest
from structlog.testing import capture_logs

from cakemp.front.metrics import Metrics
from cakemp.front.notify import Notifier
from cakemp.front.status import NodeStatus

LABELS, TOTALS = ("cpu:0", "cpu:1"), (2, 4)


@pytest.fixture
def manager(tmp_path):
    """A bound AF_UNIX datagram socket standing in for systemd's notification socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    yield sock
    sock.close()


def drained(sock: socket.socket) -> list[list[str]]:
    """Every datagram waiting on `sock`, as its assignments."""
    datagrams = []
    while True:
        try:
            datagrams.append(sock.recv(4096).decode().split("\n"))
        except BlockingIOError:
            return datagrams


def status(manager, stream=None) -> tuple[NodeStatus, Metrics]:
    metrics = Metrics()
    node = NodeStatus(Notifier(manager.getsockname()), metrics, LABELS, TOTALS, progress_window=90,
                      stream=stream or io.StringIO())
    return node, metrics


def test_loading_extends_the_start_and_names_each_devices_progress(manager):
    """Each loaded layer asks for 90 s more and updates STATUS with every device's count; READY=1 carries the serving line."""
    node, metrics = status(manager)
    node.starting()
    node.loaded(1, 3)
    node.serving("127.0.0.1:10128")
    assert drained(manager) == [
        ["EXTEND_TIMEOUT_USEC=90000000"],
        ["STATUS=loading layers: cpu:0 0/2, cpu:1 0/4"],
        ["EXTEND_TIMEOUT_USEC=90000000"],
        ["STATUS=loading layers: cpu:0 0/2, cpu:1 3/4"],
        ["READY=1", "STATUS=serving 6 layers on 2 devices at 127.0.0.1:10128"],
    ]
    assert metrics.is_ready


def test_a_restart_shows_in_status_and_readiness_until_the_device_is_back(manager):
    """While a device restarts the node is not ready and STATUS says which and why; back, it is ready again."""
    node, metrics = status(manager)
    node.serving("host:1")
    node.restarting(1, "died (exit code -9)")
    assert not metrics.is_ready
    node.loaded(1, 2)
    node.restarted(1)
    assert metrics.is_ready
    assert drained(manager)[1:] == [
        ["STATUS=serving 6 layers on 2 devices at host:1; cpu:1 restarting after it died (exit code -9) (0/4 layers loaded)"],
        ["STATUS=serving 6 layers on 2 devices at host:1; cpu:1 restarting after it died (exit code -9) (2/4 layers loaded)"],
        ["STATUS=serving 6 layers on 2 devices at host:1"],
    ]


def test_stopping_says_so_and_stays_unready(manager):
    """The drain sends STOPPING=1 with the requests in flight, and a device coming back later does not make the node ready."""
    node, metrics = status(manager)
    node.serving("host:1")
    node.restarting(0, "did not answer within 60 s")
    node.stopping(3)
    node.restarted(0)
    assert ["STOPPING=1", "STATUS=draining 3 requests in flight"] in drained(manager)
    assert not metrics.is_ready


def test_a_terminal_gets_a_progress_bar_in_place_of_log_lines(manager):
    """On a terminal, progress redraws one bar line per update (no log line), and serving ends that line."""
    controller, terminal = os.openpty()
    with open(terminal, "w") as stream, capture_logs() as logs:
        node, _ = status(manager, stream)
        node.loaded(0, 1)
        node.loaded(1, 4)
        node.serving("host:1")
    shown = b""
    while True:
        try:
            shown += os.read(controller, 4096)
        except OSError:  # EIO: everything written has been read and the terminal side is closed
            break
    os.close(controller)
    assert shown.count(b"\rloading ") == 2
    assert b"cpu:0 [##########..........] 1/2  cpu:1 [####################] 4/4" in shown
    assert shown.endswith(b"\r\n")  # the terminal turns the final newline into CR LF
    assert logs == []


def test_elsewhere_each_loaded_layer_is_a_log_line(manager):
    """Without a terminal, progress is one structured log line per update, naming the device and its counts."""
    with capture_logs() as logs:
        node, _ = status(manager)
        node.loaded(1, 3)
    assert logs == [{"event": "layers loaded", "device": 1, "device_label": "cpu:1", "layers": 3, "total": 4,
                     "log_level": "info"}]
