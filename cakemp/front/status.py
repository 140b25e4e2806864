"""What the node tells its operator about itself while it loads, serves, heals and stops.

One place turns the pool's progress into the service manager's notifications (STATUS=,
EXTEND_TIMEOUT_USEC=, READY=1, STOPPING=1), the readiness behind /readyz, and the load display:
a bar on stderr when that is a terminal, one log line per loaded layer otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from cakemp import log
from cakemp.front.metrics import Metrics
from cakemp.front.notify import Notifier

_BAR_WIDTH = 20


class NodeStatus:
    def __init__(self, notifier: Notifier, metrics: Metrics, labels: Sequence[str], totals: Sequence[int], *,
                 progress_window: float, stream: TextIO = sys.stderr):
        """`labels[d]` names device d, which loads `totals[d]` layers. `progress_window` is how long
        the manager is asked to wait for the next sign of progress while the node starts."""
        self._notifier = notifier
        self._metrics = metrics
        self._labels = tuple(labels)
        self._totals = tuple(totals)
        self._loaded = [0] * len(self._labels)
        self._restarting: dict[int, str] = {}  # device -> why it is being restarted
        self._serving: str | None = None  # the status line once READY=1 has been sent
        self._stopping = False
        self._progress_window = progress_window
        self._bar = stream if stream.isatty() else None
        self._log = log.get_logger()

    def starting(self) -> None:
        """The device processes are being spawned: say what will load, and ask the manager to wait."""
        self._notifier.extend_timeout(self._progress_window)
        self._notifier.status(self._text())

    def loaded(self, device: int, layers: int) -> None:
        """`device` now holds `layers` of its layers (at its first start or a restart)."""
        self._loaded[device] = layers
        if self._serving is None:
            # The manager is still waiting for READY=1: every layer buys the start more time.
            self._notifier.extend_timeout(self._progress_window)
        self._notifier.status(self._text())
        if self._bar is not None and self._serving is None:
            self._draw()
        else:
            self._log.info("layers loaded", device=device, device_label=self._labels[device], layers=layers,
                           total=self._totals[device])

    def serving(self, address: str) -> None:
        """Every device is ready and connections are accepted on `address`."""
        if self._bar is not None:
            self._bar.write("\n")
            self._bar.flush()
        self._serving = f"serving {sum(self._totals)} layers on {len(self._labels)} devices at {address}"
        self._notifier.ready(self._text())
        self._update_readiness()

    def restarting(self, device: int, reason: str) -> None:
        """`device` is being restarted because it `reason` ("died (exit code -9)", say)."""
        self._restarting[device] = reason
        self._loaded[device] = 0
        self._notifier.status(self._text())
        self._update_readiness()

    def restarted(self, device: int) -> None:
        """`device` is serving again."""
        self._restarting.pop(device, None)
        self._notifier.status(self._text())
        self._update_readiness()

    def stopping(self, in_flight: int) -> None:
        """The drain has begun, with `in_flight` requests still being served."""
        self._stopping = True
        self._update_readiness()
        self._notifier.stopping(f"draining {in_flight} requests in flight")

    def _update_readiness(self) -> None:
        self._metrics.set_ready(self._serving is not None and not self._restarting and not self._stopping)

    def _text(self) -> str:
        if self._serving is None:
            return "loading layers: " + ", ".join(
                f"{label} {loaded}/{total}" for label, loaded, total in zip(self._labels, self._loaded, self._totals))
        restarting = "".join(
            f"; {self._labels[d]} restarting after it {reason} ({self._loaded[d]}/{self._totals[d]} layers loaded)"
            for d, reason in sorted(self._restarting.items()))
        return self._serving + restarting

    def _draw(self) -> None:
        bars = []
        for label, loaded, total in zip(self._labels, self._loaded, self._totals):
            filled = _BAR_WIDTH * loaded // total
            bars.append(f"{label} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {loaded}/{total}")
        # \r and an erase-to-end-of-line redraw the same terminal line in place.
        self._bar.write("\rloading " + "  ".join(bars) + "\x1b[K")
        self._bar.flush()
