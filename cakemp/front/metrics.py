"""The front's metrics: every one it records, declared once (`Metrics`), and what moves them.

The metric types and their text format are prometheus.py's, the process_* family
front/process_metrics.py's, the HTTP endpoint front/metrics_server.py's. Every metric is updated
on the front's event loop (device processes report their KV bytes over the IPC, and the front
records them), so nothing here takes a lock.

Recording is always on and costs a dict update; only the HTTP endpoint is off unless
`--metrics-address` is given.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import cakemp
from cakemp.front.process_metrics import process_metrics
from cakemp.prometheus import LATENCY_BUCKETS, Counter, Gauge, Histogram, Metric, Sampled, Series

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

_M = TypeVar("_M", bound=Metric)


class DeviceSeries(NamedTuple):
    """One device's series of the metrics each request or step through it moves (`Metrics.device`)."""

    requests_waiting: Series
    request_seconds: Series
    kv_bytes: Series
    batch_requests: Series
    batch_size: Series
    step_tokens: Series


class Metrics:
    """The front's registry: what it serves, how fast, and whether it is ready. Each metric is
    declared once, as an attribute; creating it registers it, and /metrics lists them in that order."""

    def __init__(self, buffered_bytes: Callable[[], int] = lambda: 0) -> None:
        """`buffered_bytes`: the frame bytes master connections hold now (the buffer budget's), read when scraped."""
        self._all: list[Metric] = []
        self._declare_requests()
        self._declare_connections(buffered_bytes)
        self._declare_devices()
        self._declare_prefixes()
        self._declare_experts()
        self._declare_node()
        self._all.extend(process_metrics())
        # What `served` moves, per kind of request: its duration and its tokens.
        self._served = {kind: (self.request_seconds.labels(kind=kind), self.tokens.labels(kind=kind))
                        for kind in ("decode", "prefill")}

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

    def _declare_connections(self, buffered_bytes: Callable[[], int]) -> None:
        # Who is connected. A session is one master connection; it belongs to a device once it sends it a request.
        self.connections = self._gauge("cakemp_connections", "Master connections open now.")
        self.sessions = self._gauge("cakemp_sessions", "Open master connections that have sent requests to each device.",
                                    "device")
        self.refused_connections = self._counter(
            "cakemp_refused_connections_total",
            "Connections closed on accept, by reason: max-connections (that many were open), allow-from (a peer "
            "outside --allow-from), handshake-places (no handshake place free for its address).", "reason")
        self.buffered_bytes = self._registered(Sampled(
            "cakemp_buffered_bytes", "Frame bytes master connections hold now, against --max-buffered-mib.", "gauge",
            buffered_bytes))
        self.handshakes = self._gauge(
            "cakemp_handshakes", "Connections in the cluster-key handshake now, or without a key before their Hello "
            "(not master connections yet; at most 64, 8 per address).")
        self.handshakes_displaced = self._counter(
            "cakemp_handshakes_displaced_total",
            "Connections closed in the handshake, having sent nothing, to make room for a newer one: every place, or "
            "its address's 8, was taken.")
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

    def _declare_experts(self) -> None:
        # Offloaded MoE experts (--expert-offload: model/weights/experts.py), as each device reports them.
        self.expert_hits = self._counter(
            "cakemp_expert_cache_hits_total", "Routed experts a token needed that the device's expert cache held.",
            "device")
        self.expert_misses = self._counter(
            "cakemp_expert_cache_misses_total", "Routed experts a token needed that were read from the checkpoint.",
            "device")
        self.expert_read_bytes = self._counter(
            "cakemp_expert_read_bytes_total", "Bytes of the checkpoint read for experts (as stored: 4-bit codes as such).",
            "device")
        self.expert_resident_bytes = self._gauge(
            "cakemp_expert_cache_bytes", "Bytes of experts each device's expert cache holds (at most --expert-cache-mib).",
            "device")

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
        duration, counted = self._served["decode" if tokens == 1 and first_position > 0 else "prefill"]
        duration.observe(seconds)
        counted.inc(tokens)
        self.layer_ops.inc(layer_ops)

    def device(self, label: str) -> DeviceSeries:
        """Device `label`'s series of the metrics its requests and steps move."""
        return DeviceSeries(self.requests_waiting.labels(device=label), self.device_request_seconds.labels(device=label),
                            self.kv_bytes.labels(device=label), self.batch_requests.labels(device=label),
                            self.batch_size.labels(device=label), self.step_tokens.labels(device=label))

    def prefixes(self, device: str, hits: int, tokens: int, evictions: int, retired_bytes: int,
                 kept_bytes: int) -> None:
        """`device` reported what prefix reuse did since its last report, and holds now."""
        self.prefix_hits.inc(hits, device=device)
        self.prefix_tokens.inc(tokens, device=device)
        self.prefix_evictions.inc(evictions, device=device)
        self.prefix_retired_bytes.set(retired_bytes, device=device)
        self.prefix_kept_bytes.set(kept_bytes, device=device)

    def experts(self, device: str, hits: int, misses: int, read_bytes: int, resident_bytes: int) -> None:
        """`device` reported what its expert cache did since its last report, and holds now."""
        self.expert_hits.inc(hits, device=device)
        self.expert_misses.inc(misses, device=device)
        self.expert_read_bytes.inc(read_bytes, device=device)
        self.expert_resident_bytes.set(resident_bytes, device=device)

    def device_loaded(self, device: str, memory_bytes: int, kv_budget_bytes: int | None) -> None:
        """`device` reported Ready holding `memory_bytes`; its KV budget, if it has one."""
        self.device_memory.set(memory_bytes, device=device)
        if kv_budget_bytes is not None:
            self.kv_budget_bytes.set(kv_budget_bytes, device=device)

    def render(self) -> str:
        """The whole registry in the Prometheus text exposition format."""
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"
