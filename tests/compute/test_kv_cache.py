"""KVCache: blocks taken as positions need them, shared blocks copied on write, limits, the budget, freeing."""

import pytest
import torch

from cakemp.compute.kv_cache import BLOCK, NULL_BLOCK, KVCache, Tables
from cakemp.errors import CacheBudgetExceeded, ContextLimitExceeded

PER_POSITION = 2 * 2 * 8 * 4  # K+V x 2 kv heads x 8 dims x f32
PER_BLOCK = BLOCK * PER_POSITION


def cache(**kwargs):
    return KVCache(kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"), **kwargs)


def write(c: KVCache, session: int, block_idx: int, start: int, values: torch.Tensor) -> None:
    """Rows [start, start + n) of a slot set to `values` ([n]: each row's K all that value, V its negation)."""
    slot = c.slot(session, block_idx)
    with torch.inference_mode():  # as a step writes the pool
        for i, value in enumerate(values.tolist()):
            p = start + i
            c.pools[slot.pool].k[slot.table[p // BLOCK], p % BLOCK] = value
            c.pools[slot.pool].v[slot.table[p // BLOCK], p % BLOCK] = -value
    slot.length = max(slot.length, start + len(values))


def values(c: KVCache, session: int, block_idx: int, end: int) -> torch.Tensor:
    k, v = c.rows(c.slot(session, block_idx), 0, end)
    assert torch.equal(v, -k)
    return k[0, :, 0]


def test_blocks_are_taken_as_positions_need_them_and_never_move():
    """A slot holds ceil(end / BLOCK) blocks; growing takes new ones, the old ones and their rows stay."""
    c = cache(max_context=4096)
    slot = c.reserve(1, {0: (0, 10)})[0]
    assert slot.capacity == BLOCK and c.nbytes() == PER_BLOCK
    write(c, 1, 0, 0, torch.arange(10.0))
    first = list(slot.table)
    grown = c.reserve(1, {0: (10, BLOCK + 1)})[0]
    assert grown.table[:1] == first and len(grown.table) == 2 and grown.length == 10
    assert torch.equal(values(c, 1, 0, 10), torch.arange(10.0))
    assert c.nbytes() == 2 * PER_BLOCK


def test_a_session_growing_alone_holds_one_run_of_the_pool_whatever_was_freed_before():
    """Blocks are taken lowest first, so a session that grows while no other takes blocks holds
    consecutive ascending ids (a step reads its keys as a view of the pool, not gathered): its
    first prompt, its next after a Goodbye freed them, and one after other sessions' frees."""
    c = cache(max_context=4096)

    def run(session: int) -> bool:
        table = c.slot(session, 0).table
        return table == list(range(table[0], table[0] + len(table)))

    c.reserve(1, {0: (0, 3 * BLOCK)})
    c.clear(1)  # Goodbye: its three blocks go back
    c.reserve(1, {0: (0, 2 * BLOCK)})
    c.reserve(1, {0: (2 * BLOCK, 4 * BLOCK)})  # decoding on, past the blocks it had
    assert run(1) and c.slot(1, 0).table[0] == 2  # the pool's first block (0 and 1 are its own)
    for session in (2, 3, 4):
        c.reserve(session, {0: (0, 2 * BLOCK)})
    for session in (3, 2, 4):  # freed in another order than taken
        c.clear(session)
    c.reserve(5, {0: (0, 6 * BLOCK)})
    assert run(5) and c.slot(5, 0).table[0] == c.slot(1, 0).table[-1] + 1


def test_the_device_tables_mirror_each_live_slot():
    """`tables[row, block_idx]` holds a live slot's block ids, what a step gathers its keys by."""
    c = cache(max_context=4096)
    c.reserve(1, {0: (0, 40), 3: (0, 5)})
    c.reserve(2, {3: (0, 20)})
    for session, block_idx in [(1, 0), (1, 3), (2, 3)]:
        table = c.slot(session, block_idx).table
        assert c.tables[c.rows_of([session])[0], block_idx, : len(table)].tolist() == table


@pytest.mark.parametrize("mirrored", [False, True], ids=["one-tensor", "device-copy"])
def test_the_tables_a_step_reads_hold_every_row_written_before_it(mirrored):
    """Rows written on the host, grown, cleared and rewritten, whole or from an entry on (those before it
    unchanged), read back whole when a step asks; with a device copy apart (a GPU's, here on the CPU), only
    then, after any number of writes between steps."""
    tables = Tables(torch.device("cpu"), mirrored=mirrored)
    expected: dict[tuple[int, int], list[int]] = {}

    def check() -> None:
        read = tables.on_device()
        for row in range(read.shape[0]):
            for slot in range(read.shape[1]):
                table = expected.get((row, slot), [])
                assert read[row, slot].tolist() == table + [NULL_BLOCK] * (read.shape[2] - len(table)), (row, slot)

    steps = [  # (row, slot, its table, the first entry that changed), or (row, None): the row's session left it
        [(0, 0, [5, 6], 0)],
        [(0, 0, [5, 6, 9], 2), (2, 1, [3], 0)],  # a new block; a row and a slot past the tables' size: they grow
        [(1, 0, list(range(2, 2 + 3 * BLOCK)), 0)],  # wider than they were
        [(2, 1, [4], 0), (0, None), (0, 0, [7], 0), (1, 0, [2, 3], 2)],  # several writes of a row; one shorter
        [(1, 0, [2, 8, 10], 1), (0, 0, [7, 11], 1)],  # an entry replaced (a copy on write) and one added
        [(1, 0, [2, 8, 10], 3), (1, 0, [2], 1), (2, None)],  # nothing new; then shorter again
    ]
    for writes in steps:
        for row, slot, *written in writes:
            if slot is None:
                tables.clear(row)
                expected = {key: value for key, value in expected.items() if key[0] != row}
            else:
                tables.write(row, slot, *written)
                expected[row, slot] = written[0]
        check()


def test_a_rewind_frees_the_blocks_past_what_it_writes():
    """A request at p < length replaces the rest: blocks past its end go back to the pool."""
    c = cache(max_context=4096)
    c.reserve(1, {0: (0, 5 * BLOCK)})
    c.reserve(1, {0: (3, 4)})
    assert len(c.slot(1, 0).table) == 1 and c.nbytes() == PER_BLOCK


def test_context_limit_is_named():
    """An end past max_context is ContextLimitExceeded, and nothing is allocated."""
    c = cache(max_context=100)
    with pytest.raises(ContextLimitExceeded, match="position 100 .* limit of 100"):
        c.reserve(1, {0: (0, 50), 1: (0, 101)})
    assert c.nbytes() == 0 and len(c.sessions()) == 0


def test_budget_refusal_is_all_or_nothing():
    """A reservation that cannot fit takes none of its blocks and leaves other sessions alone; the
    refusal gives its figures in units a person reads."""
    c = cache(max_context=4096, budget_bytes=4 * PER_BLOCK)
    c.reserve(1, {0: (0, 5)})
    with pytest.raises(CacheBudgetExceeded, match=r"^the KV cache would need 8\.0 KiB more but only 6\.0 KiB "
                                                  r"of this device's 8\.0 KiB budget is left$"):
        c.reserve(2, {0: (0, 5), 1: (0, 3 * BLOCK)})
    assert c.nbytes() == PER_BLOCK and len(c.sessions()) == 1 and c.room() == 3 * PER_BLOCK


@pytest.mark.parametrize("mirrored", [False, True], ids=["one-tensor", "device-copy"])
def test_a_decode_row_opening_a_block_takes_one_in_every_layer_at_once(mirrored):
    """`continuing` for a row at a block's start gives each of the session's slots its next block, as
    `reserve` would, in the tables a step reads (and their device copy) and in the budget's count; where
    the budget cannot hold them all it takes none, and the session goes on once there is room."""
    c = cache(max_context=4096, budget_bytes=12 * PER_BLOCK)
    c._tables = Tables(torch.device("cpu"), mirrored=mirrored)
    c.reserve(1, {block_idx: (0, BLOCK) for block_idx in range(3)})
    c.reserve(2, {0: (0, 3 * BLOCK)})
    row = c.rows_of([1])[0]

    def opened(position: int, blocks=(0, 1, 2)) -> None:
        for slot in c.slots(1).values():
            slot.length = position  # its rows so far written
        used = c.nbytes()
        slots = c.continuing(1, blocks, position)
        assert [slot.pool for slot in slots] == list(blocks) and c.nbytes() == used + 3 * PER_BLOCK
        for slot in slots:
            assert len(slot.table) == position // BLOCK + 1
            assert c.tables[row, slot.pool, : len(slot.table) + 1].tolist() == slot.table + [NULL_BLOCK]

    opened(BLOCK)
    opened(2 * BLOCK, blocks=(0, 1, 2, 0))  # a run naming a slot twice: one block for it all the same
    used = c.nbytes()
    assert c.continuing(1, (0, 1, 2), 2 * BLOCK) is not None and c.nbytes() == used  # its row again: in its block
    for slot in c.slots(1).values():
        slot.length = 3 * BLOCK
    tables = {block_idx: list(slot.table) for block_idx, slot in c.slots(1).items()}
    with pytest.raises(CacheBudgetExceeded):  # the 12 blocks in use, 3 more wanted
        c.continuing(1, (0, 1, 2), 3 * BLOCK)
    assert {block_idx: slot.table for block_idx, slot in c.slots(1).items()} == tables and c.nbytes() == used
    assert c.tables[row, :3, 3].tolist() == [NULL_BLOCK] * 3
    c.clear(2)  # its 3 blocks free
    opened(3 * BLOCK)
    used = c.nbytes()
    assert c.continuing(1, (0, 1, 2), BLOCK) is None  # a row before its last block: the plan decides
    shares = c.shared_from(c.slots(1), [0, 1, 2], 3 * BLOCK + 1)  # its 4 blocks shared, as prefix reuse does
    assert c.continuing(1, (0, 1, 2), 3 * BLOCK) is None and c.nbytes() == used  # its last block copied first
    c.drop(shares.values())
    slots = c.reserve(1, {block_idx: (0, 5) for block_idx in range(3)})  # a new prompt: blocks past its first freed
    for block_idx, slot in slots.items():
        assert c.tables[row, block_idx, :5].tolist() == slot.table + [NULL_BLOCK] * 4


@pytest.mark.parametrize("layers", [1, 4, 7])
@pytest.mark.parametrize("budget_blocks", [1000, 1100, 1500, 2100])
def test_the_pools_grown_to_the_budget_hold_no_more_blocks_than_it(layers, budget_blocks):
    """Sessions of 8 blocks a layer until the budget refuses one: the budget is used (no pool refuses
    early), and every layer's pool together allocate no more blocks than the budget's, but for each
    pool's two reserved ones (each doubling up to the whole budget on its own allocated up to ~2x it
    once every layer's pool had just doubled)."""
    c = cache(max_context=1 << 20, budget_bytes=budget_blocks * PER_BLOCK)
    session = 0
    with pytest.raises(CacheBudgetExceeded):
        while True:
            c.reserve(session, {block_idx: (0, 8 * BLOCK) for block_idx in range(layers)})
            session += 1
    assert c.nbytes() > budget_blocks * PER_BLOCK - 8 * layers * PER_BLOCK  # one more session did not fit
    assert sum(len(pool.owners) for pool in c.pools.values()) <= budget_blocks + 2 * layers


def test_a_pool_used_past_its_share_of_the_budget_grows_by_what_it_needs():
    """Sessions using one layer of four (whose pools hold a share of the budget each once made): that
    layer's pool takes blocks past its share, one session at a time, until the budget refuses."""
    c = cache(max_context=1 << 20, budget_bytes=1000 * PER_BLOCK)
    c.reserve(0, {block_idx: (0, BLOCK) for block_idx in range(4)})  # the four pools made
    session = 1
    with pytest.raises(CacheBudgetExceeded):
        while True:
            c.reserve(session, {0: (0, 8 * BLOCK)})
            session += 1
    assert c.nbytes() > 1000 * PER_BLOCK - 8 * PER_BLOCK and len(c.pools[0].owners) > 1000 // 4


@pytest.mark.parametrize("layers", [1, 4, 7])
def test_presized_pools_hold_their_shares_and_never_grow_to_the_budget(layers):
    """Pools made at the start at their shares (a GPU's, under its graphs) hold no more blocks than the
    budget's and their reserved ones, count nothing as used, and take sessions up to the budget without
    growing: each keeps the tensors it was made with. Without a budget there is nothing to size."""
    c = cache(max_context=1 << 20, budget_bytes=1000 * PER_BLOCK)
    c.presize(range(layers))
    sizes = {block_idx: len(pool.owners) for block_idx, pool in c.pools.items()}
    assert sizes == {block_idx: 1000 // layers + 2 for block_idx in range(layers)}
    assert c.nbytes() == 0 and c.room() == 1000 * PER_BLOCK
    assert c.pool_bytes() == sum(sizes.values()) * PER_BLOCK
    tensors = {block_idx: (pool.k, pool.v) for block_idx, pool in c.pools.items()}
    session = 0
    with pytest.raises(CacheBudgetExceeded):
        while True:
            c.reserve(session, {block_idx: (0, 8 * BLOCK) for block_idx in range(layers)})
            session += 1
    assert c.nbytes() > 1000 * PER_BLOCK - 8 * layers * PER_BLOCK
    assert all(pool.k is tensors[i][0] and pool.v is tensors[i][1] for i, pool in c.pools.items())
    unbounded = cache(max_context=1 << 20)
    unbounded.presize(range(layers))
    assert not unbounded.pools


def test_clear_frees_only_that_session():
    """clear() returns a session's blocks to the budget and forgets its lengths."""
    c = cache(max_context=4096, budget_bytes=8 * PER_BLOCK)
    c.reserve(1, {0: (0, 5), 3: (0, 5)})[3].length = 5
    c.reserve(2, {0: (0, 5)})
    c.clear(1)
    assert c.nbytes() == PER_BLOCK and c.length(1, 3) == 0 and len(c.sessions()) == 1
    assert c.room() == 7 * PER_BLOCK


class Spare:
    """What prefix reuse holds inside the budget besides blocks, as the cache sees it."""

    def __init__(self, held: int):
        self.held, self.asked = held, []

    def nbytes(self) -> int:
        return self.held

    def release(self, nbytes: int) -> None:
        self.asked.append(nbytes)
        self.held = max(0, self.held - nbytes)


def test_the_spare_gives_back_room_before_a_session_is_refused():
    """With the budget held by the spare, a reservation asks it for the room it needs; once neither
    the budget nor the spare has room left, a session is refused."""
    c = cache(max_context=4096, budget_bytes=2 * PER_BLOCK)
    c.spare = Spare(2 * PER_BLOCK)
    assert c.room() == 0
    assert c.reserve(1, {0: (0, 10)})[0].capacity == BLOCK
    assert c.spare.asked == [PER_BLOCK] and c.room() == 0
    c.spare = Spare(PER_BLOCK)
    assert c.reserve(2, {0: (0, 5)})[0].capacity == BLOCK and c.spare.held == 0 and c.room() == 0
    with pytest.raises(CacheBudgetExceeded):
        c.reserve(3, {0: (0, 1)})


def test_shared_blocks_are_counted_once_and_copied_before_a_write():
    """A slot shared from another holds the same blocks (no bytes more); writing into a shared block
    copies it first, so the first owner's rows are untouched; the rows before stay shared."""
    c = cache(max_context=4096, budget_bytes=16 * PER_BLOCK)
    c.reserve(1, {0: (0, 2 * BLOCK + 4)})
    write(c, 1, 0, 0, torch.arange(2.0 * BLOCK + 4))
    kv, _ = c.detach(1)  # kept, as a retired prefix holds them
    shares = c.shared_from(kv, [0], BLOCK + 3)
    c.attach(2, shares)
    assert shares[0].table == kv[0].table[:2] and c.room() == 13 * PER_BLOCK  # 3 blocks in use, once
    c.reserve(2, {0: (BLOCK + 3, BLOCK + 5)})  # into the second block: it is copied
    write(c, 2, 0, BLOCK + 3, torch.tensor([-1.0, -2.0]))
    assert c.slot(2, 0).table[0] == kv[0].table[0] and c.slot(2, 0).table[1] != kv[0].table[1]
    assert c.room() == 12 * PER_BLOCK
    k, _ = c.rows(kv[0], 0, 2 * BLOCK + 4)
    assert torch.equal(k[0, :, 0], torch.arange(2.0 * BLOCK + 4))  # the first owner's rows, as written
    assert torch.equal(values(c, 2, 0, BLOCK + 5),
                       torch.cat([torch.arange(BLOCK + 3.0), torch.tensor([-1.0, -2.0])]))
    c.drop(kv.values())  # the first owner gives up: only the block the second still shares stays
    assert c.room() == 14 * PER_BLOCK and c.nbytes() == 2 * PER_BLOCK
    c.clear(2)
    assert c.room() == 16 * PER_BLOCK


def test_slots_detached_and_attached_leave_and_rejoin_the_count():
    """detach takes a session's slots out of the live count (their blocks stay in use), attach puts
    them back under another session; resume sets lengths; a session cannot take a slot twice."""
    c = cache(max_context=4096, budget_bytes=8 * PER_BLOCK)
    c.reserve(1, {0: (0, 10), 1: (0, 10)})
    write(c, 1, 0, 0, torch.ones(10))
    kv, linear = c.detach(1)
    assert c.nbytes() == 0 and len(c.sessions()) == 0 and set(kv) == {0, 1} and linear == {}
    assert c.room() == 6 * PER_BLOCK
    c.attach(2, kv)
    assert c.nbytes() == 2 * PER_BLOCK and c.length(2, 0) == 10
    assert torch.equal(values(c, 2, 0, 10), torch.ones(10))
    c.resume(2, [0, 1], 4, {})
    assert c.length(2, 0) == c.length(2, 1) == 4
    with pytest.raises(ValueError):
        c.attach(2, {0: kv[0]})


def test_the_gather_space_grows_by_doubling_and_by_what_is_needed_where_the_doubling_does_not_fit(monkeypatch):
    """Kept between steps; a request past it doubles it, unless that runs out of memory (a GPU near its
    end): then it takes just what the gather needs."""
    cache = KVCache(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), max_context=1024)
    k, _ = cache.gather_space(4)
    assert k.shape == (4, BLOCK, 2, 4)
    assert cache.gather_space(3)[0].data_ptr() == k.data_ptr()  # less than held: the same room
    assert cache.gather_space(5)[0].untyped_storage().nbytes() == 8 * k[0].nbytes  # doubled
    empty = torch.empty

    def short_of_memory(shape, **kwargs):
        if shape[0] > 12:
            raise torch.OutOfMemoryError("CUDA out of memory (as a GPU near its end says)")
        return empty(shape, **kwargs)

    monkeypatch.setattr(torch, "empty", short_of_memory)
    k, v = cache.gather_space(12)  # doubling to 16 does not fit; 12 does
    assert k.shape[0] == v.shape[0] == 12 and k.untyped_storage().nbytes() == 12 * k[0].nbytes
    with pytest.raises(torch.OutOfMemoryError):
        cache.gather_space(13)  # nor doubled nor as needed: the step's error, as any other allocation's


def test_a_decode_checked_once_is_checked_afresh_once_its_blocks_are_shared_or_its_slots_replaced():
    """`continuing` remembers what it found of a session's tables for its next rows in the same block; a
    share of its blocks (its last no longer its own), a rewind freeing blocks, or other slots in place of
    its own (prefix reuse adopting kept rows) is seen at the next row, and so is a length fallen back."""
    c = cache(max_context=4096, budget_bytes=64 * PER_BLOCK)
    blocks = (0, 1)  # one run's blocks, the same tuple step after step, as the runner passes them
    c.reserve(1, {block_idx: (0, BLOCK + 4) for block_idx in blocks})

    def step(position: int) -> list | None:
        """A decode's check, then its row written as a step writes it."""
        slots = c.continuing(1, blocks, position)
        for slot in slots or ():
            slot.length = position + 1
        return slots

    for slot in c.slots(1).values():
        slot.length = BLOCK + 4
    assert step(BLOCK + 4) is not None and step(BLOCK + 5) is not None
    last = [c.slot(1, block_idx).table[-1] for block_idx in blocks]
    shares = c.shared_from(c.slots(1), blocks, BLOCK + 6)  # its last blocks now held twice
    assert step(BLOCK + 6) is None  # `reserve` then copies them before the row is written
    c.reserve(1, {block_idx: (BLOCK + 6, BLOCK + 7) for block_idx in blocks})
    assert [c.slot(1, block_idx).table[-1] for block_idx in blocks] != last
    c.drop(shares.values())
    assert step(BLOCK + 6) is not None
    c.reserve(1, {block_idx: (BLOCK - 3, BLOCK) for block_idx in blocks})  # rewritten to its first block's end
    for slot in c.slots(1).values():
        slot.length = BLOCK
    assert [len(slot.table) for slot in step(BLOCK)] == [2, 2]  # its second block, freed, taken afresh
    for slot in c.slots(1).values():
        slot.length = BLOCK  # a failed step's rollback
    assert c.continuing(1, blocks, BLOCK + 7) is None
    c.reserve(2, {block_idx: (0, BLOCK + 2) for block_idx in blocks})
    kept, _ = c.detach(2)  # retired, as prefix reuse keeps a session's rows
    for slot in kept.values():
        slot.length = BLOCK + 2
    mine, _ = c.detach(1)  # session 1 adopts them in place of its own
    c.attach(1, kept)
    c.drop(mine.values())
    assert all(slot is kept[block_idx] for slot, block_idx in zip(step(BLOCK + 2), blocks, strict=True))
