"""The seed's per-connection throughput line: ops/s and read/write bytes/s, every few requests."""

from __future__ import annotations

from dataclasses import dataclass

from cakemp.units import human_bytes

# As the seed: average over, and print once every, this many requests.
REQUESTS_PER_LINE = 5


@dataclass
class Stats:
    """Sums of per-request rates since the last line (one per connection)."""

    requests: int = 0
    ops_per_s: float = 0.0
    read_per_s: float = 0.0
    write_per_s: float = 0.0

    def add(self, ops: int, compute_s: float, read_bytes: int, read_s: float, write_bytes: int, write_s: float) -> str | None:
        """Account one served request; every REQUESTS_PER_LINE requests return the line to log."""
        tiny = 1e-9  # a zero duration (coarse clock) must not divide by zero
        self.ops_per_s += ops / max(compute_s, tiny)
        self.read_per_s += read_bytes / max(read_s, tiny)
        self.write_per_s += write_bytes / max(write_s, tiny)
        self.requests += 1
        if self.requests < REQUESTS_PER_LINE:
            return None
        n = self.requests
        line = (f"ops={self.ops_per_s / n:.0f}/s read={human_bytes(self.read_per_s / n)}/s "
                f"write={human_bytes(self.write_per_s / n)}/s")
        self.requests, self.ops_per_s, self.read_per_s, self.write_per_s = 0, 0.0, 0.0, 0.0
        return line
