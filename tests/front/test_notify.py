import asyncio
import multiprocessing
import os
import socket
import uuid

import pytest

from cakemp.errors import ConfigError
from cakemp.front.notify import Notifier, watchdog_interval


@pytest.fixture
def manager(tmp_path):
    """A bound AF_UNIX datagram socket standing in for systemd's notification socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    yield sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_each_notification_arrives_as_one_datagram_in_order(manager):
    """STATUS, EXTEND_TIMEOUT_USEC, READY, WATCHDOG and STOPPING reach the socket in the order sent."""
    notifier = Notifier(manager.getsockname())
    notifier.status("loading device 0: 16 layers")
    notifier.extend_timeout(90)
    notifier.ready("serving 32 layers on 2 devices")
    notifier.watchdog()
    notifier.stopping()
    notifier.close()
    assert received(manager) == ["STATUS=loading device 0: 16 layers"]
    assert received(manager) == ["EXTEND_TIMEOUT_USEC=90000000"]
    assert received(manager) == ["READY=1", "STATUS=serving 32 layers on 2 devices"]
    assert received(manager) == ["WATCHDOG=1"]
    assert received(manager) == ["STOPPING=1"]


def test_abstract_namespace_address():
    """An '@' address is sent to the abstract socket of that name."""
    name = f"cakemp-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert Notifier("@" + name).ready()
        assert received(sock) == ["READY=1"]


def test_status_with_newlines_stays_one_assignment(manager):
    """A newline in a status text cannot inject another assignment."""
    Notifier(manager.getsockname()).status("first\nREADY=1")
    assert received(manager) == ["STATUS=first READY=1"]


def test_without_notify_socket_everything_is_a_no_op():
    """With no $NOTIFY_SOCKET the notifier is disabled and sends nothing."""
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog_interval is None


def test_missing_socket_is_reported_not_raised(tmp_path):
    """A manager socket that has gone away makes notify return False instead of raising."""
    assert Notifier(str(tmp_path / "gone")).ready() is False


def test_a_manager_that_does_not_read_never_blocks_the_sender(manager):
    """Once the manager's socket queue is full, notify returns False at once instead of blocking."""
    notifier = Notifier(manager.getsockname())
    results = [notifier.watchdog() for _ in range(10_000)]
    assert results[0] is True and results[-1] is False


def test_relative_address_is_a_config_error():
    """NOTIFY_SOCKET must be an absolute path or an abstract name."""
    with pytest.raises(ConfigError, match="NOTIFY_SOCKET"):
        Notifier("relative/notify")


def test_from_env_removes_the_manager_variables(manager):
    """from_env reads the socket and watchdog, then takes them out of the environment it was given."""
    environ = {
        "NOTIFY_SOCKET": manager.getsockname(),
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": str(os.getpid()),
        "PATH": "/usr/bin",
    }
    notifier = Notifier.from_env(environ)
    assert notifier.address == manager.getsockname()
    assert notifier.watchdog_interval == 15.0
    assert environ == {"PATH": "/usr/bin"}


def test_watchdog_interval_is_half_the_period():
    """The ping interval is half of $WATCHDOG_USEC, in seconds."""
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_interval({}) is None


def test_watchdog_meant_for_another_process_is_ignored():
    """A $WATCHDOG_PID naming another process means this one has no watchdog duty."""
    environ = {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}
    assert watchdog_interval(environ, pid=4242) is None
    assert watchdog_interval(environ, pid=1) == 5.0


def test_bad_watchdog_usec_is_a_config_error():
    """A $WATCHDOG_USEC that is not a positive integer is rejected with its value named."""
    with pytest.raises(ConfigError, match="abc"):
        watchdog_interval({"WATCHDOG_USEC": "abc"})
    with pytest.raises(ConfigError, match="positive"):
        watchdog_interval({"WATCHDOG_USEC": "0"})


def test_keep_alive_pings_from_the_event_loop(manager):
    """keep_alive sends WATCHDOG=1 repeatedly at the interval, from the running loop, until cancelled."""
    notifier = Notifier(manager.getsockname(), watchdog_interval=0.01)

    async def first_pings():
        task = asyncio.create_task(notifier.keep_alive())
        try:  # read in a thread while the loop keeps turning
            return [await asyncio.to_thread(received, manager) for _ in range(3)]
        finally:
            task.cancel()

    assert asyncio.run(first_pings()) == [["WATCHDOG=1"]] * 3


def manager_variables_seen(conn) -> None:
    conn.send(sorted(key for key in os.environ if key.startswith(("NOTIFY", "WATCHDOG"))))


def test_spawned_process_does_not_inherit_the_socket(manager, monkeypatch):
    """After from_env, a process started with spawn (as device processes are) sees no manager variable."""
    monkeypatch.setenv("NOTIFY_SOCKET", manager.getsockname())
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    Notifier.from_env()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=manager_variables_seen, args=(child,))
    process.start()
    assert parent.poll(30)
    assert parent.recv() == []
    process.join(10)
