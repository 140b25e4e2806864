"""A stand-in for the driver's `nvidia-smi`: a real executable on PATH printing canned listings,
so that cakemp's GPU inventory runs its real subprocess code on a machine without a GPU."""

from __future__ import annotations

from pathlib import Path


def fake_nvidia_smi(bin_dir: Path, listing: str, query: str = "", *, listing_status: int = 0,
                    query_status: int = 0) -> Path:
    """An `nvidia-smi` in `bin_dir` (created) that prints `listing` for `-L` and exits `listing_status`,
    prints `query` for `--query-gpu=...` and exits `query_status`; other arguments exit 2.
    Returns `bin_dir`, to put first on PATH."""
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in\n"
                   f"-L) cat <<'EOF'\n{listing}EOF\nexit {listing_status};;\n"
                   f"--query-gpu=*) cat <<'EOF'\n{query}EOF\nexit {query_status};;\n"
                   f"*) exit 2;;\nesac\n")
    smi.chmod(0o755)
    return bin_dir
