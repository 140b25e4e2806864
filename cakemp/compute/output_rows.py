"""The output rows prefix reuse keeps (prefix_cache.py): every kept run's in blocks of one pool.

A run answered from kept rows is answered the output rows it computed, so each followed run keeps
them by position. They live as KV rows do (kv_cache.py): in blocks of BLOCK rows of one tensor per
device, `RowPool.rows: [blocks * BLOCK, H]` in the compute dtype, each run's `OutputRows` a table of
its blocks. So a step writes the output row of every decode it ran with one indexed copy, where a
buffer per run took a copy per request: a torch call each, and on a GPU a kernel launch each
(docs/performance.md has what it cost).

The pool grows by doubling, to no more than the budget's worth of rows beside the rows it must
hold (by what it needs, where a GPU has no room for the doubling), and never shrinks: the blocks a
run gives back are taken again by the next. What a run holds
is its blocks, counted in the KV budget by prefix_cache.py; the pool's free blocks are outside it,
as a KV pool's are.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from cakemp.compute.kv_cache import BLOCK, int64_tensor

MIN_POOL_BLOCKS = 16  # the pool's first size, in blocks


class RowPool:
    """One device's kept output rows, [blocks * BLOCK, H]: row `block * BLOCK + offset` of `rows`."""

    @torch.inference_mode(False)  # a plain tensor, whoever makes it: a step writes it, in inference mode or not
    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, max_bytes: int | None = None):
        """`max_bytes`: the budget the rows are kept within (None: none), which bounds the pool's doubling."""
        self.rows = torch.empty(0, hidden, dtype=dtype, device=device)
        self.block_bytes = BLOCK * hidden * dtype.itemsize
        self._max_blocks = None if max_bytes is None else max_bytes // self.block_bytes
        self._free: list[int] = []  # a heap: runs take the lowest blocks
        self.used = 0  # blocks some run holds

    def take(self, n: int) -> list[int]:
        """n free blocks (the pool grows when it has too few)."""
        if n > len(self._free):
            self._grow(n - len(self._free))
        self.used += n
        return [heapq.heappop(self._free) for _ in range(n)]

    def give(self, blocks: Sequence[int]) -> None:
        """Blocks a run no longer holds."""
        for block in blocks:
            heapq.heappush(self._free, block)
        self.used -= len(blocks)

    def write(self, slots: list[int], rows: torch.Tensor) -> None:
        """rows: [n, H] into rows `slots` (block * BLOCK + offset each) of the pool, in one copy."""
        self.rows.index_copy_(0, int64_tensor(slots, self.rows.device), rows)

    def read(self, slots: list[int]) -> torch.Tensor:
        """Rows `slots` of the pool, [n, H] (a copy)."""
        return self.rows.index_select(0, int64_tensor(slots, self.rows.device))

    @torch.inference_mode(False)
    def _grow(self, at_least: int) -> None:
        old = self.rows.shape[0] // BLOCK
        size = max(old + at_least, 2 * old, MIN_POOL_BLOCKS)
        if self._max_blocks is not None:
            size = max(old + at_least, min(size, self._max_blocks))
        try:
            grown = self.rows.new_empty(size * BLOCK, self.rows.shape[1])
        except torch.OutOfMemoryError:  # a GPU short of the doubled pool: what is needed
            size = old + at_least
            grown = self.rows.new_empty(size * BLOCK, self.rows.shape[1])
        grown[: old * BLOCK] = self.rows
        self.rows = grown
        self._free.extend(range(old, size))  # above every block free before: still a heap


class OutputRows:
    """A run's output rows by position, [0, capacity) held in blocks of `pool`."""

    def __init__(self, pool: RowPool):
        self.pool = pool
        self.table: list[int] = []  # its blocks, in position order
        # Rows and bytes held, as numbers: asked at every request (and every prefix's bytes whenever the budget is).
        self.capacity = self.nbytes = 0

    def growth(self, end: int) -> int:
        """Bytes more that holding rows [0, end) takes."""
        return 0 if end <= self.capacity else (-(-end // BLOCK) - len(self.table)) * self.pool.block_bytes

    def hold(self, end: int) -> None:
        """Hold rows [0, end) (`growth(end)` more bytes)."""
        if end > self.capacity:
            self.table += self.pool.take(-(-end // BLOCK) - len(self.table))
            self.capacity, self.nbytes = len(self.table) * BLOCK, len(self.table) * self.pool.block_bytes

    def slot(self, position: int) -> int:
        """The pool's row of `position` (held)."""
        return self.table[position // BLOCK] * BLOCK + position % BLOCK

    def slots(self, start: int, end: int) -> list[int]:
        """The pool's rows of positions [start, end) (held)."""
        table = self.table
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]

    def write(self, position: int, rows: torch.Tensor) -> None:
        """rows: [1, n, H] at positions [position, position + n); the rows before stay."""
        end = position + rows.shape[1]
        self.hold(end)
        self.pool.write(self.slots(position, end), rows[0])

    def rows(self, start: int, end: int) -> torch.Tensor:
        """[1, end - start, H] (a copy), end <= capacity."""
        return self.pool.read(self.slots(start, end))[None]

    def free(self) -> None:
        """Give every block back (the run is no longer kept)."""
        self.pool.give(self.table)
        self.table, self.capacity, self.nbytes = [], 0, 0
