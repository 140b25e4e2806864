"""The process_* metrics every Prometheus client library exports, under the same names and
units, read from /proc when scraped (absent off Linux)."""

from __future__ import annotations

import os
import resource

from cakemp.prometheus import Sampled
from cakemp.rss import resident_bytes


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
