"""The output rows prefix reuse keeps: each run's in blocks of one pool per device."""

from __future__ import annotations

import torch

from cakemp.compute.kv_cache import BLOCK
from cakemp.compute.output_rows import MIN_POOL_BLOCKS, OutputRows, RowPool

HIDDEN = 8


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_runs_keep_their_rows_apart_through_the_pools_growth():
    """Two runs written in turn, row by row and in pieces, past the pool's first size: each reads back
    exactly its own rows, holds whole blocks of its own, and counts their bytes."""
    pool = RowPool(HIDDEN, torch.float32, torch.device("cpu"))
    a, b = OutputRows(pool), OutputRows(pool)
    x, y = rows(MIN_POOL_BLOCKS * BLOCK, 0), rows(40, 1)
    for p in range(0, x.shape[1], 7):
        a.write(p, x[:, p:p + 7])
        if p < 40:
            b.write(p, y[:, p:p + 7])
    assert torch.equal(a.rows(0, x.shape[1]), x) and torch.equal(b.rows(3, 40), y[:, 3:40])
    assert not set(a.table) & set(b.table) and pool.used == len(a.table) + len(b.table)
    assert (b.capacity, b.nbytes) == (48, 3 * BLOCK * HIDDEN * 4) and b.growth(48) == 0 and b.growth(49) == pool.block_bytes
    assert pool.rows.shape[0] > MIN_POOL_BLOCKS * BLOCK  # grew, the rows kept


def test_a_freed_run_s_blocks_are_taken_again_and_a_write_rewrites_only_its_rows():
    pool = RowPool(HIDDEN, torch.float32, torch.device("cpu"))
    a, b = OutputRows(pool), OutputRows(pool)
    a.write(0, rows(20, 0))
    b.write(0, rows(5, 1))
    held = pool.rows.shape[0]
    a.free()
    assert (a.table, a.capacity, a.nbytes, pool.used) == ([], 0, 0, 1)
    c = OutputRows(pool)
    c.write(0, rows(32, 2))
    c.write(3, rows(1, 3))
    expected = rows(32, 2)
    expected[:, 3] = rows(1, 3)[:, 0]
    assert torch.equal(c.rows(0, 32), expected) and torch.equal(b.rows(0, 5), rows(5, 1))
    assert pool.rows.shape[0] == held  # a's blocks served c


def test_the_pool_doubles_no_further_than_the_budget_s_rows():
    """With a budget of 20 blocks' bytes, a pool of 16 blocks asked for one more grows to 20, not 32;
    asked past the budget (a caller that checked no room), by what it needs."""
    pool = RowPool(HIDDEN, torch.float32, torch.device("cpu"), max_bytes=20 * BLOCK * HIDDEN * 4)
    run = OutputRows(pool)
    run.hold(MIN_POOL_BLOCKS * BLOCK)
    assert pool.rows.shape[0] == MIN_POOL_BLOCKS * BLOCK
    run.hold(MIN_POOL_BLOCKS * BLOCK + 1)
    assert pool.rows.shape[0] == 20 * BLOCK
    run.hold(22 * BLOCK)
    assert pool.rows.shape[0] == 22 * BLOCK
