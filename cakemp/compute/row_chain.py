"""The identity of a run's input rows from position 0: a chain of digests of their bytes.

Prefix reuse (prefix_cache.py) keys what it keeps on the exact bytes of the activation rows
that entered a run. As vLLM chains its token blocks' hashes, each row's digest covers the
digest before it and the row's own bytes, so two chains agree at a position only where every
earlier row agreed, and how far two runs' rows agree is found by bisection.

The rows are chained one by one, not by blocks of 16 as vLLM's pages are: the front cuts a
prompt into chunks whose ends fall anywhere, so a match may end at any row. 32 bytes per row is
what that costs, next to kilobytes of KV rows.

The digest is SHA-256: every row of every request is hashed on the device's main thread, and
OpenSSL's SHA-256 runs on the SHA instructions of current x86 and Arm server CPUs, ~1.8x
BLAKE2b's speed on a row of kilobytes (docs/benchmarks.md).

A RowChain is what a session's run has taken so far; an Extension is what a request would add
to it, computed once per request (each row hashed once) and taken up to where the request's
rows were taken (`RowChain.advance`).

Rows of the same bytes are other rows where the request computing them rotated them otherwise: a
longrope model's request reaching past its original context rotates every row of it with the long
factors, so its KV rows differ from those of the same bytes in a shorter request. Such a request's
rows are hashed with a `salt` (the runner's `regime`), so that neither is answered the other's rows.
"""

from __future__ import annotations

import hashlib

DIGEST = 32  # bytes of one row's digest (SHA-256's)


def _chained(previous: bytes, rows: memoryview, row_bytes: int, salt: bytes) -> bytearray:
    """The digests of `rows`, one after another, the first chained on `previous`, each row's with `salt`."""
    digests = bytearray()
    for start in range(0, len(rows), row_bytes):
        h = hashlib.sha256(previous)
        h.update(salt)  # (b"": no change)
        h.update(rows[start : start + row_bytes])
        previous = h.digest()
        digests += previous
    return digests


class RowChain:
    """Rows [0, length) of a run, each named by a digest of its bytes and of every row before it."""

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes  # bytes of one row (hidden size x the compute dtype's size)
        self._digests = bytearray()  # row i's at [DIGEST * i, DIGEST * (i + 1))
        self.length = 0  # rows taken (a count kept, not worked out: asked several times a request)

    def digest_at(self, position: int) -> bytes:
        """The digest naming rows [0, position), 0 <= position <= length (b"" for none)."""
        return bytes(self._digests[DIGEST * (position - 1) : DIGEST * position]) if position else b""

    def extension(self, rows: memoryview, salt: bytes = b"") -> Extension:
        """What `rows` (the bytes of whole rows following this chain's end, hashed with `salt`) would add to it."""
        return Extension(self.length, rows, self.row_bytes, self.digest_at(self.length), salt)

    def advance(self, extension: Extension, end: int) -> None:
        """Take the extension's rows up to position `end` (this chain may hold some of them already)."""
        length = self.length
        if not extension.start <= length <= end <= extension.end:
            raise ValueError(f"rows [{extension.start}, {end}) do not continue a chain of {length} rows")
        if length == extension.start and end == extension.end:  # all of them (a decode's one row)
            self._digests += extension.digests
        else:
            self._digests += extension.digests[DIGEST * (length - extension.start) : DIGEST * (end - extension.start)]
        self.length = end


class Extension:
    """Rows [start, end) following a chain: their digests, hashed the first time they are asked for.

    A request that only continues its session's chain needs them once it has run (to advance the
    chain), so they are hashed then: on a GPU, while the GPU computes the step's kernels. A request
    matched against kept rows needs them before it runs, and hashes them then."""

    __slots__ = ("start", "end", "_rows", "_row_bytes", "_previous", "_salt", "_digests")

    def __init__(self, start: int, rows: memoryview, row_bytes: int, previous: bytes, salt: bytes = b""):
        """`rows`: the bytes of whole rows of `row_bytes`, from `start` on; `previous`: the digest before them;
        `salt`: hashed into each row's digest (the module docstring says why)."""
        self.start, self.end = start, start + len(rows) // row_bytes
        self._rows, self._row_bytes, self._previous, self._salt = rows, row_bytes, previous, salt
        self._digests: bytearray | None = None

    @property
    def digests(self) -> bytearray:
        if self._digests is None:
            self._digests = _chained(self._previous, self._rows, self._row_bytes, self._salt)
            self._rows = None  # the request's rows are not held past their hashing
        return self._digests

    def digest_at(self, position: int) -> bytes:
        """The digest naming rows [0, position) of the chain with these rows, start < position <= end."""
        i = position - self.start
        return bytes(self.digests[DIGEST * (i - 1) : DIGEST * i])

    def agreed(self, theirs: RowChain) -> int:
        """How far, from `start`, these rows agree with those of `theirs`, which agrees with the
        chain they extend up to `start`: the last position where the two chains' digests are equal."""
        low, high = self.start, min(self.end, theirs.length)
        while low < high:  # agreeing at p means agreeing before p: bisect
            middle = (low + high + 1) // 2
            if self.digest_at(middle) == theirs.digest_at(middle):
                low = middle
            else:
                high = middle - 1
        return low
