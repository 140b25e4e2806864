"""The front's metrics: a registry in Prometheus' text format and the HTTP endpoint serving it.

Written here rather than taken from prometheus_client so the front keeps no extra runtime
dependency; the format (text exposition 0.0.4) is small. Every metric is updated on the
front's event loop (device processes report their KV bytes over the IPC, and the front
records them), so nothing here takes a lock.

Recording is always on and costs a dict update; only the HTTP endpoint is off unless
`--metrics-address` is given.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import structlog

log = structlog.get_logger(__name__)

# Request latencies run from well under a millisecond (one decode step on a small layer run)
# to seconds (a long prefill, a device restart), so the buckets span 0.5 ms .. 10 s.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

LabelValues = tuple[str, ...]


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labels)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def _header(self) -> list[str]:
        text = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {text}", f"# TYPE {self.name} {self.kind}"]

    def _line(self, name: str, key: LabelValues, value: float, extra: tuple[str, str] | None = None) -> str:
        pairs = list(zip(self.labelnames, key)) + ([extra] if extra else [])
        if not pairs:
            return f"{name} {_number(value)}"
        labels = ",".join(f'{label}="{_escape(text)}"' for label, text in pairs)
        return f"{name}{{{labels}}} {_number(value)}"


class _Valued(_Metric):
    """A metric holding one number per label set: counters and gauges."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labels)
        # An unlabelled metric shows 0 from the start; labelled ones appear when first used.
        self._values: dict[LabelValues, float] = {} if self.labelnames else {(): 0.0}

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        return self._header() + [self._line(self.name, key, value) for key, value in self._values.items()]


class Counter(_Valued):
    """A total that only goes up (its name ends in _total)."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name} is a counter; it cannot go down by {amount}")
        super().inc(amount, **labels)


class Gauge(_Valued):
    """A value that is set, and may go up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)


class Histogram(_Metric):
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
        key = self._key(labels)
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        counts[index] += 1
        self._sums[key] = self._sums.get(key, 0.0) + value

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


class Metrics:
    """The front's registry: what it serves, how fast, and whether it is ready."""

    def __init__(self) -> None:
        self.requests = Counter("cakemp_requests_total", "Forward requests (Batch, SingleOp) answered.")
        self.errors = Counter(
            "cakemp_request_errors_total", "Requests answered with WorkerError, by error class.", ["error"]
        )
        self.bytes_received = Counter("cakemp_received_bytes_total", "Bytes read from master connections.")
        self.bytes_sent = Counter("cakemp_sent_bytes_total", "Bytes written to master connections.")
        self.device_restarts = Counter(
            "cakemp_device_restarts_total", "Device processes restarted after dying or hanging.", ["device"]
        )
        self.active_sessions = Gauge("cakemp_active_sessions", "Master connections open now.")
        self.refused_connections = Counter(
            "cakemp_refused_connections_total", "Master connections closed on accept: --max-connections were open."
        )
        self.buffered_bytes = Gauge(
            "cakemp_buffered_bytes", "Frame bytes master connections hold now, against --max-buffered-mib."
        )
        self.kv_bytes = Gauge("cakemp_kv_cache_bytes", "KV cache bytes held, as last reported by each device.", ["device"])
        self.readiness = Gauge("cakemp_ready", "1 when every device process is ready and connections are accepted.")
        self.request_seconds = Histogram(
            "cakemp_device_request_duration_seconds", "Time from handing a request to a device to its reply.", ["device"]
        )
        self._all: tuple[Counter | Gauge | Histogram, ...] = (
            self.requests,
            self.errors,
            self.bytes_received,
            self.bytes_sent,
            self.device_restarts,
            self.active_sessions,
            self.refused_connections,
            self.buffered_bytes,
            self.kv_bytes,
            self.readiness,
            self.request_seconds,
        )

    @property
    def is_ready(self) -> bool:
        return self.readiness.value() == 1

    def set_ready(self, ready: bool) -> None:
        self.readiness.set(1 if ready else 0)

    def render(self) -> str:
        """The whole registry in the Prometheus text exposition format."""
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT = 5.0  # seconds a client gets to send its request head
MAX_REQUEST_HEAD = 8192  # bytes; the paths served here need a few dozen


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> asyncio.Server:
    """Serves /metrics, /healthz and /readyz on (host, port) from the running loop.

    /healthz answers 200 whenever the loop answers at all: a blocked front answers nothing,
    which is what a liveness probe should see. /readyz is 200 only while `metrics.is_ready`.
    Each response closes its connection; a scraper reconnects every interval anyway.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            status, body, content_type = _respond(metrics, head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            status, body, content_type = "400 Bad Request", "bad request\n", "text/plain; charset=utf-8"
        try:
            writer.write(
                (
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body.encode())}\r\nConnection: close\r\n\r\n{body}"
                ).encode()
            )
            await writer.drain()
        except ConnectionError:
            pass  # the client left; nothing to tell it
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD)
    bound_host, bound_port = server.sockets[0].getsockname()[:2]  # the real port when asked for 0
    log.info(f"metrics on http://{bound_host}:{bound_port}/metrics", port=bound_port)
    return server


def _respond(metrics: Metrics, head: bytes) -> tuple[str, str, str]:
    """(status line, body, content type) for one request head."""
    text_plain = "text/plain; charset=utf-8"
    try:
        method, target, version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return "400 Bad Request", "bad request\n", text_plain
    if not version.startswith("HTTP/1."):
        return "400 Bad Request", "bad request\n", text_plain
    if method != "GET":
        return "405 Method Not Allowed", "only GET\n", text_plain
    path = target.split("?", 1)[0]
    if path == "/metrics":
        return "200 OK", metrics.render(), CONTENT_TYPE
    if path == "/healthz":
        return "200 OK", "ok\n", text_plain
    if path == "/readyz":
        if metrics.is_ready:
            return "200 OK", "ready\n", text_plain
        return "503 Service Unavailable", "not ready\n", text_plain
    return "404 Not Found", "not found\n", text_plain


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
