"""Byte counts as people read them, for logs and for the errors a master is sent."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
