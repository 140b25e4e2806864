"""Cake's worker's throughput line, by time: what the whole node served since the previous line.

Cake's worker logs ops/s and read/write bytes/s every five requests of each connection
(`cake/worker.rs@fa7d08a`), which at decode rates floods the journal. Here one line comes every `interval` seconds, and only when
something was served in it; its figures are differences of the metrics' own counters, so the
line and /metrics never disagree.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cakemp import log
from cakemp.front.metrics import Metrics


@dataclass(frozen=True)
class _Totals:
    at: float  # loop time of the reading
    requests: float
    layer_ops: float
    tokens: float
    received: float
    sent: float


class StatsLine:
    """Turns two readings of the metrics into the fields of one line."""

    def __init__(self, metrics: Metrics, now: float) -> None:
        self._metrics = metrics
        self._last = self._read(now)

    def take(self, now: float) -> dict[str, float] | None:
        """The rates since the previous `take` (or since construction); None when no request was answered."""
        last, current = self._last, self._read(now)
        self._last = current
        requests = current.requests - last.requests
        seconds = current.at - last.at
        if requests == 0 or seconds <= 0:
            return None

        def rate(field: str) -> float:
            return round((getattr(current, field) - getattr(last, field)) / seconds, 3)

        return {
            "seconds": round(seconds, 3),
            "requests": int(requests),
            "requests_per_s": rate("requests"),
            "ops_per_s": rate("layer_ops"),
            "tokens_per_s": rate("tokens"),
            "read_bytes_per_s": rate("received"),
            "write_bytes_per_s": rate("sent"),
        }

    def _read(self, now: float) -> _Totals:
        m = self._metrics
        return _Totals(now, m.requests.total(), m.layer_ops.total(), m.tokens.total(), m.bytes_received.total(),
                       m.bytes_sent.total())


async def log_stats(metrics: Metrics, interval: float) -> None:
    """Log a `stats` line every `interval` seconds in which a request was answered; runs until cancelled."""
    logger = log.get_logger()
    loop = asyncio.get_running_loop()
    line = StatsLine(metrics, loop.time())
    while True:
        await asyncio.sleep(interval)
        fields = line.take(loop.time())
        if fields is not None:
            logger.info("stats", **fields)
