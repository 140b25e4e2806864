"""The service manager's notification socket (systemd's sd_notify protocol, written here).

The protocol is one AF_UNIX datagram per notification to the socket named by
$NOTIFY_SOCKET, holding newline-separated `KEY=VALUE` assignments. A name starting with '@'
is in Linux's abstract namespace (the '@' stands for a leading NUL byte). With no
$NOTIFY_SOCKET (supervisord, a terminal) every call is a no-op, so the front calls these
unconditionally.

Only the front talks to the manager: the unit says NotifyAccess=main, and a device process
that inherited $NOTIFY_SOCKET could otherwise send READY=1 on the front's behalf.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping, MutableMapping

from cakemp import log
from cakemp.errors import ConfigError

# The variables systemd sets for the main process only; children must not see them.
MANAGER_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def watchdog_interval(environ: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when no watchdog is asked of this process.

    $WATCHDOG_USEC is the manager's timeout; pinging at half of it leaves room for one late
    ping. $WATCHDOG_PID, when set, names the one process the watchdog is meant for, so a
    child that inherited the variables does not take the front's duty (sd_watchdog_enabled).
    """
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    owner = environ.get("WATCHDOG_PID")
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    try:
        period = int(usec)
    except ValueError:
        raise ConfigError(f"WATCHDOG_USEC={usec!r} is not a whole number of microseconds") from None
    if period <= 0:
        raise ConfigError(f"WATCHDOG_USEC={usec!r} must be positive")
    return period / 2 / 1_000_000


class Notifier:
    """Sends state changes to the service manager; does nothing when there is none."""

    def __init__(self, address: str | None, watchdog_interval: float | None = None) -> None:
        if address is not None and not address.startswith(("/", "@")):
            raise ConfigError(f"NOTIFY_SOCKET={address!r} is neither an absolute path nor @abstract")
        self.address = address
        self.watchdog_interval = watchdog_interval
        self._socket: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] = os.environ) -> Notifier:
        """Reads $NOTIFY_SOCKET and the watchdog variables, then removes them.

        Removing them from the front's own environment is what keeps device processes from
        inheriting them: multiprocessing's spawn start method copies os.environ at start and
        takes no env= argument. This is sd_notify's `unset_environment`.
        """
        notifier = cls(environ.get("NOTIFY_SOCKET") or None, watchdog_interval(environ))
        for key in MANAGER_VARIABLES:
            environ.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Sends `KEY=VALUE` assignments in one datagram; True if the manager got it.

        A send failure is logged, not raised: the node can serve without its manager, and a
        manager that misses READY=1 or WATCHDOG=1 acts on its own timeout.
        """
        if self.address is None:
            return False
        # Abstract-namespace names begin with NUL in the sockaddr; '@' is only how it is written.
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._socket is None:
                # Non-blocking: a manager that does not read its socket must not stall the
                # front's event loop once the socket's queue is full; the datagram is dropped.
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            self._socket.sendto("\n".join(assignments).encode(), target)
        except OSError as error:
            log.get_logger().warning("notify failed", socket=self.address, error=str(error))
            return False
        return True

    def status(self, text: str) -> bool:
        """A one-line description shown by `systemctl status` (e.g. which device is loading)."""
        return self.notify(f"STATUS={_one_line(text)}")

    def extend_timeout(self, seconds: float) -> bool:
        """Asks for `seconds` more before the current start/stop timeout fires (slow loads)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def ready(self, status: str | None = None) -> bool:
        """Every device process is ready: the unit becomes active."""
        return self.notify("READY=1", *_status(status))

    def watchdog(self) -> bool:
        """Proves the front's event loop still turns."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """The drain has begun; the manager shows the unit as deactivating."""
        return self.notify("STOPPING=1", *_status(status))

    async def keep_alive(self) -> None:
        """Pings the watchdog forever from the running event loop (cancel it to stop).

        It runs as a task on the front's loop on purpose: if that loop blocks, the pings
        stop and the manager restarts the node. Returns at once when no watchdog is set.
        """
        if not self.enabled or self.watchdog_interval is None:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(self.watchdog_interval)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _one_line(text: str) -> str:
    # A newline would start a new assignment in the datagram.
    return " ".join(text.splitlines())


def _status(text: str | None) -> tuple[str, ...]:
    return () if text is None else (f"STATUS={_one_line(text)}",)
