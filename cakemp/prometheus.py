"""A small Prometheus client: counters, gauges, histograms and values read when scraped, each
rendering itself in the text exposition format (0.0.4).

The node's front and `cakemp serve` both render their /metrics with it. Written here rather than
taken from prometheus_client: importing that costs the front ~20-45 ms (about a tenth of its import
time) and 2.6 MB of RSS (bench/front_footprint.py, docs/benchmarks.md) for a format this module
writes in a page. Every metric is updated on its process's event loop, so nothing here takes a lock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Request latencies run from well under a millisecond (one decode step on a small layer run)
# to seconds (a long prefill, a device restart), so the buckets span 0.5 ms .. 10 s.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

LabelValues = tuple[str, ...]


class Metric:
    """One metric: its name, help text and label names; each kind renders its own lines."""

    kind = ""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labels)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        names = self.labelnames
        if not labels and not names:
            return ()
        if len(labels) == len(names):  # then every name given means exactly these labels
            try:
                return tuple([str(labels[name]) for name in names])
            except KeyError:
                pass
        raise ValueError(f"{self.name} takes labels {names}, got {tuple(labels)}")

    def labels(self, **labels: str) -> Series:
        """This metric's one label set, its key worked out once: what a path run per request updates."""
        return Series(self, self._key(labels))

    def _header(self) -> list[str]:
        text = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {text}", f"# TYPE {self.name} {self.kind}"]

    def _line(self, name: str, key: LabelValues, value: float, extra: tuple[str, str] | None = None) -> str:
        pairs = list(zip(self.labelnames, key)) + ([extra] if extra else [])
        if not pairs:
            return f"{name} {_number(value)}"
        labels = ",".join(f'{label}="{_escape(text)}"' for label, text in pairs)
        return f"{name}{{{labels}}} {_number(value)}"


class _Valued(Metric):
    """A metric holding one number per label set: counters and gauges."""

    only_up = False  # a counter's: it refuses to go down

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labels)
        # An unlabelled metric shows 0 from the start; labelled ones appear when first used.
        self._values: dict[LabelValues, float] = {} if self.labelnames else {(): 0.0}
        self._unlabelled = None if self.labelnames else Series(self, ())

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def total(self) -> float:
        """The sum over every label set."""
        return sum(self._values.values())

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        (self._unlabelled if not labels and self._unlabelled else self.labels(**labels)).inc(amount)

    def render(self) -> list[str]:
        return self._header() + [self._line(self.name, key, value) for key, value in self._values.items()]


class Counter(_Valued):
    """A total that only goes up (its name ends in _total)."""

    kind = "counter"

    only_up = True


class Gauge(_Valued):
    """A value that is set, and may go up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        (self._unlabelled if not labels and self._unlabelled else self.labels(**labels)).set(value)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)


class Histogram(Metric):
    """Counts observations into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> None:
        super().__init__(name, documentation, labels)
        self.buckets = tuple(sorted(buckets))
        # Per label set: per-bucket (non-cumulative) counts, the +Inf overflow last; and the sum.
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        self.labels(**labels).observe(value)

    def render(self) -> list[str]:
        lines = self._header()
        for key, counts in self._counts.items():
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts):
                cumulative += count
                lines.append(self._line(f"{self.name}_bucket", key, cumulative, ("le", _number(bound))))
            lines.append(self._line(f"{self.name}_sum", key, self._sums[key]))
            lines.append(self._line(f"{self.name}_count", key, cumulative))
        return lines


class Series:
    """One label set of a counter, gauge or histogram, a time series in Prometheus's words
    (`metric.labels(...)`): every update is made here, in one call, on the metric's own dicts
    (a path run per request holds its series, its key worked out once)."""

    __slots__ = ("_metric", "_key", "_values", "_only_up")

    def __init__(self, metric: _Valued | Histogram, key: LabelValues) -> None:
        self._metric, self._key = metric, key
        self._values = getattr(metric, "_values", None)  # a counter's or a gauge's
        self._only_up = getattr(metric, "only_up", False)

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0 and self._only_up:
            raise ValueError(f"{self._metric.name} is a counter; it cannot go down by {amount}")
        values = self._values
        values[self._key] = values.get(self._key, 0.0) + amount

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        self._values[self._key] = float(value)

    def observe(self, value: float) -> None:
        metric, key = self._metric, self._key
        counts = metric._counts.get(key)
        if counts is None:
            counts = metric._counts[key] = [0] * (len(metric.buckets) + 1)
        # The first bucket whose bound is >= value; NaN is below no bound: +Inf's.
        counts[bisect.bisect_left(metric.buckets, value) if value == value else len(metric.buckets)] += 1
        metric._sums[key] = metric._sums.get(key, 0.0) + value


class Sampled(Metric):
    """A value read when scraped (the process's own figures); absent where it cannot be read."""

    def __init__(self, name: str, documentation: str, kind: str, read: Callable[[], float | None]) -> None:
        super().__init__(name, documentation)
        self.kind = kind
        self._read = read

    def render(self) -> list[str]:
        value = self._read()
        return self._header() + ([] if value is None else [self._line(self.name, (), value)])


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
