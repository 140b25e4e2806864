"""The identity of a run's input rows from position 0: digests of their bytes, block by block, chained.

Prefix reuse (prefix_cache.py) keys what it keeps on the exact bytes of the activation rows
that entered a run, as vLLM keys its cache on token blocks: rows are taken BLOCK_ROWS at a
time and each block's digest covers the previous block's digest and its own bytes, so two
chains agree at a block only where every earlier row agreed. A position inside a block is
named by the digest of the last full block before it and the rows since (`digest_at`), so a
prefix may also end, or keep a recurrent state, between block boundaries.

A RowChain is what a session's run has taken so far; an Extension is what a request would
add to it, computed once per request (each row is hashed once) and applied up to where the
rows were taken (`RowChain.advance`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

BLOCK_ROWS = 16
_EMPTY = b""  # the digest "before" the first block


def _digest(previous: bytes, *rows: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(previous, digest_size=32)
    for part in rows:
        h.update(part)
    return h.digest()


@dataclass
class RowChain:
    """Rows [0, length) of a run: the digest of each full block, and the bytes of the rows past the last one."""

    row_bytes: int  # bytes of one row (hidden size x the compute dtype's size)
    blocks: list[bytes] = field(default_factory=list)  # blocks[k]: rows [0, BLOCK_ROWS * (k + 1))
    tail: bytes = b""  # rows [BLOCK_ROWS * len(blocks), length), fewer than BLOCK_ROWS

    @property
    def length(self) -> int:
        return BLOCK_ROWS * len(self.blocks) + len(self.tail) // self.row_bytes

    def digest_at(self, position: int) -> bytes | None:
        """The digest naming rows [0, position): known at a block boundary and at the chain's end (None elsewhere)."""
        if position % BLOCK_ROWS == 0 and position <= BLOCK_ROWS * len(self.blocks):
            return self.blocks[position // BLOCK_ROWS - 1] if position else _EMPTY
        if position == self.length:
            return _digest(self.blocks[-1] if self.blocks else _EMPTY, self.tail)
        return None

    def extension(self, rows: memoryview) -> Extension:
        """What `rows` (whole rows, following this chain's end) would add to it."""
        start = self.length
        base = self.blocks[-1] if self.blocks else _EMPTY
        blocks, previous = [], base
        first = BLOCK_ROWS - len(self.tail) // self.row_bytes  # rows that complete the current block
        ends = range(first, len(rows) // self.row_bytes + 1, BLOCK_ROWS)
        for i, end in enumerate(ends):
            if i == 0:  # the block the chain's tail began
                previous = _digest(previous, self.tail, rows[: end * self.row_bytes])
            else:
                previous = _digest(previous, rows[(end - BLOCK_ROWS) * self.row_bytes : end * self.row_bytes])
            blocks.append(previous)
        return Extension(start, self.row_bytes, rows, base, self.tail, blocks)

    def advance(self, extension: Extension, end: int) -> None:
        """Take the extension's rows up to position `end` (this chain may hold some of them already)."""
        if not extension.start <= self.length <= end <= extension.end:
            raise ValueError(f"rows [{extension.start}, {end}) do not continue a chain of {self.length} rows")
        first = extension.start // BLOCK_ROWS  # the block the extension's rows begin in
        self.blocks.extend(extension.blocks[len(self.blocks) - first : end // BLOCK_ROWS - first])
        self.tail = extension.rows_from(BLOCK_ROWS * (end // BLOCK_ROWS), end)


@dataclass(frozen=True)
class Extension:
    """Rows [start, end) following a chain: the digests of the blocks they complete."""

    start: int
    row_bytes: int
    rows: memoryview  # the rows' bytes, row after row
    base: bytes  # the digest of the chain's last full block (before `start`)
    base_tail: bytes  # the chain's rows past that block
    blocks: list[bytes]  # each block the rows complete, in order

    @property
    def end(self) -> int:
        return self.start + len(self.rows) // self.row_bytes

    def digest_at(self, position: int) -> bytes:
        """The digest naming rows [0, position) of the chain with these rows, for start < position <= end."""
        first_block = self.start // BLOCK_ROWS  # the block the rows begin in
        block = position // BLOCK_ROWS  # full blocks before `position`
        done = block - first_block  # of them, those these rows complete
        if position % BLOCK_ROWS == 0:
            return self.blocks[done - 1] if done else self.base
        previous = self.blocks[done - 1] if done else self.base
        return _digest(previous, self.rows_from(BLOCK_ROWS * block, position))

    def rows_from(self, first: int, end: int) -> bytes:
        """The bytes of rows [first, end), which may begin inside the chain's tail (first >= its last full block)."""
        tail_start = self.start - len(self.base_tail) // self.row_bytes
        if first < tail_start:
            raise ValueError(f"row {first} is before the rows this extension holds")
        before = self.base_tail[(first - tail_start) * self.row_bytes :] if first < self.start else b""
        return bytes(before) + bytes(self.rows[max(first - self.start, 0) * self.row_bytes : (end - self.start) * self.row_bytes])
