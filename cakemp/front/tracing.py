"""The file where the front writes each traced request's stamps (cakemp/ipc/trace.py), one line each.

Only with CAKEMP_TRACE=<file> in the front's environment (bench/route.py --breakdown sets it).
A request's line is written once its reply has been (after its last stamp), so the write is
in none of its stages; line-buffered, so that the file can be read while the node runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from cakemp.ipc import trace


class TraceFile:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the front's life; closed by close())

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> TraceFile | None:
        """The file CAKEMP_TRACE names, opened for appending; None when it is not set."""
        path = environ.get(trace.ENV)
        return cls(path) if path else None

    def write(self, stamps: Sequence[int]) -> None:
        self._file.write(" ".join(map(str, stamps)) + "\n")

    def close(self) -> None:
        self._file.close()
