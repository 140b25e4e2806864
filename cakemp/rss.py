"""The resident memory of this process, as the node's logs and metrics report it."""

from __future__ import annotations

import os
import resource


def resident_bytes() -> int:
    """Current RSS from /proc; elsewhere the peak RSS (which on Linux would include the RSS of
    whatever ran before exec, hence /proc first)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
