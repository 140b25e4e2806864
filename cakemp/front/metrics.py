"""The front's metrics: a registry in Prometheus' text format and the HTTP endpoint serving it.

Written here rather than taken from prometheus_client: importing that costs the front ~20-45 ms
(about a tenth of its import time) and 2.6 MB of RSS (bench/front_footprint.py, docs/benchmarks.md)
for a format (text exposition 0.0.4) this module writes in a page; its process_* metrics are
reproduced under the same names. Every metric is updated on the
front's event loop (device processes report their KV bytes over the IPC, and the front
records them), so nothing here takes a lock.

Recording is always on and costs a dict update; only the HTTP endpoint is off unless
`--metrics-address` is given.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import resource
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import cakemp
from cakemp import log
from cakemp.rss import resident_bytes

# Request latencies run from well under a millisecond (one decode step on a small layer run)
# to seconds (a long prefill, a device restart), so the buckets span 0.5 ms .. 10 s.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

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


_M = TypeVar("_M", bound=_Metric)


class _Valued(_Metric):
    """A metric holding one number per label set: counters and gauges."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labels)
        # An unlabelled metric shows 0 from the start; labelled ones appear when first used.
        self._values: dict[LabelValues, float] = {} if self.labelnames else {(): 0.0}

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def total(self) -> float:
        """The sum over every label set."""
        return sum(self._values.values())

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


class Sampled(_Metric):
    """A value read when scraped (the process's own figures); absent where it cannot be read."""

    def __init__(self, name: str, documentation: str, kind: str, read: Callable[[], float | None]) -> None:
        super().__init__(name, documentation)
        self.kind = kind
        self._read = read

    def render(self) -> list[str]:
        value = self._read()
        return self._header() + ([] if value is None else [self._line(self.name, (), value)])


def process_metrics() -> tuple[Sampled, ...]:
    """The process_* family every Prometheus client library exports, under the same names and units."""
    return (
        Sampled("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", "counter",
                lambda: sum(os.times()[:2])),
        Sampled("process_resident_memory_bytes", "Resident memory size in bytes.", "gauge", resident_bytes),
        Sampled("process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge", _virtual_bytes),
        Sampled("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", "gauge",
                _start_time),
        Sampled("process_open_fds", "Number of open file descriptors.", "gauge", _open_fds),
        Sampled("process_max_fds", "Maximum number of open file descriptors.", "gauge",
                lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
    )


def _proc_stat() -> list[str] | None:
    """/proc/self/stat's fields after the command name (field 3, the state, first); None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _virtual_bytes() -> float | None:
    fields = _proc_stat()
    return None if fields is None else float(fields[20])  # field 23, vsize


def _start_time() -> float | None:
    fields = _proc_stat()
    if fields is None:
        return None
    try:
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    return boot + float(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot


def _open_fds() -> float | None:
    try:
        return float(len(os.listdir("/proc/self/fd")))
    except OSError:
        return None


class Metrics:
    """The front's registry: what it serves, how fast, and whether it is ready. Each metric is
    declared once, as an attribute; creating it registers it, and /metrics lists them in that order."""

    def __init__(self) -> None:
        self._all: list[_Metric] = []
        self._declare_requests()
        self._declare_connections()
        self._declare_devices()
        self._declare_prefixes()
        self._declare_node()
        self._all.extend(process_metrics())

    def _declare_requests(self) -> None:
        # What masters ask, and how long they wait for it.
        self.requests = self._counter("cakemp_requests_total", "Forward requests (Batch, SingleOp) answered.")
        self.errors = self._counter("cakemp_request_errors_total", "Requests answered with WorkerError, by error class.",
                                    "error")
        self.request_seconds = self._histogram(
            "cakemp_request_duration_seconds",
            "Forward requests answered with a tensor, from the request read in full to the reply written, by kind "
            "(decode: one token past position 0; prefill: the rest).", "kind")
        self.tokens = self._counter("cakemp_tokens_total", "Token positions of the requests answered with a tensor, by kind.",
                                    "kind")
        self.layer_ops = self._counter("cakemp_layer_ops_total",
                                       "Layer forward passes of the requests answered with a tensor.")
        self.bytes_received = self._counter("cakemp_received_bytes_total", "Bytes read from master connections.")
        self.bytes_sent = self._counter("cakemp_sent_bytes_total", "Bytes written to master connections.")

    def _declare_connections(self) -> None:
        # Who is connected. A session is one master connection; it belongs to a device once it sends it a request.
        self.connections = self._gauge("cakemp_connections", "Master connections open now.")
        self.sessions = self._gauge("cakemp_sessions", "Open master connections that have sent requests to each device.",
                                    "device")
        self.refused_connections = self._counter(
            "cakemp_refused_connections_total",
            "Connections closed on accept, by reason: max-connections (that many were open), allow-from (a peer "
            "outside --allow-from).", "reason")
        self.buffered_bytes = self._gauge("cakemp_buffered_bytes",
                                          "Frame bytes master connections hold now, against --max-buffered-mib.")
        self.handshakes = self._gauge(
            "cakemp_handshakes", "Connections in the cluster-key handshake now (not master connections yet; at most 64).")
        self.handshakes_displaced = self._counter(
            "cakemp_handshakes_displaced_total",
            "Connections closed in the handshake to make room for a newer one: every place for handshakes was taken.")
        self.unread_replies = self._counter(
            "cakemp_unread_replies_total", "Master connections closed because a reply was not read within --frame-timeout.")
        self.accept_failures = self._counter(
            "cakemp_accept_failures_total",
            "Accepts that failed, each followed by a pause in accepting (mostly: no file descriptor was left).")

    def _declare_devices(self) -> None:
        # The devices.
        self.device_request_seconds = self._histogram(
            "cakemp_device_request_duration_seconds", "Time from handing a request to a device to its reply.", "device")
        self.requests_waiting = self._gauge(
            "cakemp_device_requests_waiting",
            "Forward requests handed to each device and not answered yet (queued there or running).", "device")
        self.batch_requests = self._gauge("cakemp_device_batch_requests",
                                          "Requests in the step each device is running now (0: idle).", "device")
        self.batch_size = self._histogram(
            "cakemp_device_batch_size", "Requests each device ran together per step (--max-batch at most).", "device",
            buckets=BATCH_BUCKETS)
        self.step_tokens = self._histogram(
            "cakemp_device_step_tokens", "Tokens each device ran per step (decodes one each, prompt chunks theirs).",
            "device", buckets=TOKEN_BUCKETS)
        self.kv_bytes = self._gauge("cakemp_kv_cache_bytes", "KV cache bytes held, as last reported by each device.",
                                    "device")
        self.kv_budget_bytes = self._gauge(
            "cakemp_kv_cache_budget_bytes", "KV cache byte budget of each device as the front set it (--kv-budget-mib, "
            "or a CPU device's default; absent for a GPU left to its own).", "device")
        self.device_memory = self._gauge(
            "cakemp_device_memory_bytes",
            "Memory each device process held once its layers were loaded: GPU memory allocated, or its RSS on a CPU.",
            "device")
        self.device_restarts = self._counter("cakemp_device_restarts_total",
                                             "Device processes restarted after dying or hanging.", "device")

    def _declare_prefixes(self) -> None:
        # Prefix reuse (compute/prefix_cache.py), as each device reports it.
        self.prefix_hits = self._counter(
            "cakemp_prefix_hits_total", "Requests at position 0 that took up a session's kept rows (a retired prefix).",
            "device")
        self.prefix_tokens = self._counter(
            "cakemp_prefix_reused_tokens_total", "Positions answered from kept rows instead of computed.", "device")
        self.prefix_evictions = self._counter(
            "cakemp_prefix_evictions_total",
            "Kept prefixes given up for room (a live session needed it, or too many were retired).", "device")
        self.prefix_retired_bytes = self._gauge(
            "cakemp_prefix_retired_bytes",
            "Bytes of retired prefixes (KV rows, output rows, recurrent states) each device keeps inside its KV budget.",
            "device")
        self.prefix_kept_bytes = self._gauge(
            "cakemp_prefix_kept_bytes",
            "Bytes each device keeps for reuse beside its live sessions' KV state (their output rows and recurrent "
            "states), inside its KV budget.", "device")

    def _declare_node(self) -> None:
        # The node.
        self.readiness = self._gauge("cakemp_ready", "1 when every device process is ready and connections are accepted.")
        self.build_info = self._gauge("cakemp_build_info", "Always 1: the labels say what is running.", "version", "python")
        self.build_info.set(1, version=cakemp.__version__, python=platform.python_version())

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        return self._registered(Counter(name, documentation, labels))

    def _gauge(self, name: str, documentation: str, *labels: str) -> Gauge:
        return self._registered(Gauge(name, documentation, labels))

    def _histogram(self, name: str, documentation: str, *labels: str,
                   buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self._registered(Histogram(name, documentation, labels, buckets))

    def _registered(self, metric: _M) -> _M:
        self._all.append(metric)
        return metric

    @property
    def is_ready(self) -> bool:
        return self.readiness.value() == 1

    def set_ready(self, ready: bool) -> None:
        self.readiness.set(1 if ready else 0)

    def served(self, tokens: int, first_position: int, layer_ops: int, seconds: float) -> None:
        """A forward request of `tokens` positions from `first_position` on was answered with a tensor."""
        kind = "decode" if tokens == 1 and first_position > 0 else "prefill"
        self.request_seconds.observe(seconds, kind=kind)
        self.tokens.inc(tokens, kind=kind)
        self.layer_ops.inc(layer_ops)

    def prefixes(self, device: str, hits: int, tokens: int, evictions: int, retired_bytes: int,
                 kept_bytes: int) -> None:
        """`device` reported what prefix reuse did since its last report, and holds now."""
        self.prefix_hits.inc(hits, device=device)
        self.prefix_tokens.inc(tokens, device=device)
        self.prefix_evictions.inc(evictions, device=device)
        self.prefix_retired_bytes.set(retired_bytes, device=device)
        self.prefix_kept_bytes.set(kept_bytes, device=device)

    def device_loaded(self, device: str, memory_bytes: int, kv_budget_bytes: int | None) -> None:
        """`device` reported Ready holding `memory_bytes`; its KV budget, if it has one."""
        self.device_memory.set(memory_bytes, device=device)
        if kv_budget_bytes is not None:
            self.kv_budget_bytes.set(kv_budget_bytes, device=device)

    def render(self) -> str:
        """The whole registry in the Prometheus text exposition format."""
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT = 5.0  # seconds a client gets to send its request head
MAX_REQUEST_HEAD = 8192  # bytes; the paths served here need a few dozen


async def start_metrics_server(
    metrics: Metrics, host: str, port: int, placement: Callable[[], Mapping[str, object]] | None = None
) -> asyncio.Server:
    """Serves /metrics, /healthz, /readyz and /layers on (host, port) from the running loop.

    /healthz answers 200 whenever the loop answers at all: a blocked front answers nothing,
    which is what a liveness probe should see. /readyz is 200 only while `metrics.is_ready`.
    /layers is what `placement()` returns now, as JSON: which layers each device serves (404
    without `placement`).
    Each response closes its connection; a scraper reconnects every interval anyway.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            status, body, content_type = _respond(metrics, placement, head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
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
    log.get_logger().info("metrics endpoint", url=f"http://{bound_host}:{bound_port}/metrics", port=bound_port)
    return server


def _respond(
    metrics: Metrics, placement: Callable[[], Mapping[str, object]] | None, head: bytes
) -> tuple[str, str, str]:
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
    if path == "/layers" and placement is not None:
        return "200 OK", json.dumps(placement()) + "\n", "application/json"
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
