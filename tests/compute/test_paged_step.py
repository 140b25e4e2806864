"""StepRows: a step of decodes read from the block tables as arrays gives the rows read slot by slot."""

import pytest
import torch

from cakemp.compute import paged_step
from cakemp.compute.kv_cache import BLOCK, KVCache, Tables
from cakemp.compute.paged_step import StepRows

LAYERS = (0, 1, 2)


def sessions_grown_together(mirrored: bool) -> tuple[KVCache, list[int], list[list]]:
    """Five sessions whose tables interleave in the pools (grown turn by turn), one sharing another's
    first blocks as prefix reuse does, each at its own position: their slots of every layer (the tables
    `mirrored` to a device copy, as a GPU's are, where asked)."""
    c = KVCache(kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"), max_context=4096)
    c._tables = Tables(torch.device("cpu"), mirrored=mirrored)
    ends = {1: 3 * BLOCK + 2, 2: BLOCK, 3: 2 * BLOCK + 9, 4: 5, 5: 4 * BLOCK - 1}
    for end in range(BLOCK, 5 * BLOCK, BLOCK):  # a block at a time, every session in turn
        for session, length in ends.items():
            if end - BLOCK < length:
                c.reserve(session, {layer: (end - BLOCK, min(end, length)) for layer in LAYERS})
    c.detach(4)
    c.attach(4, c.shared_from(c.slots(1), LAYERS, 2 * BLOCK))  # session 4 now continues session 1's rows
    ends[4] = 2 * BLOCK
    for session, end in ends.items():
        for slot in c.slots(session).values():
            slot.length = end
    positions = [ends[session] for session in ends]
    c.reserve(4, {layer: (2 * BLOCK, 2 * BLOCK + 1) for layer in LAYERS})  # its shared block copied, as a write does
    for session, position in zip(ends, positions, strict=True):
        assert c.continuing(session, LAYERS, position) is not None  # each decode's row in its own block
    return c, positions, [[c.slot(session, layer) for layer in LAYERS] for session in ends]


@pytest.mark.parametrize("mirrored", [False, True], ids=["one-tensor", "device-copy"])
@pytest.mark.parametrize("arrays", [False, True])
def test_a_step_of_decodes_reads_each_row_where_its_slot_puts_it(arrays, mirrored, monkeypatch):
    """Every decode row's position and slot id (`table[p // BLOCK] * BLOCK + p % BLOCK` of its own slot),
    and each request's table, whether read slot by slot or from the tables as arrays."""
    monkeypatch.setattr(paged_step, "_ARRAYS_FROM", 0 if arrays else 10**9)
    c, positions, slots = sessions_grown_together(mirrored)
    step = StepRows(c, list(range(1, 6)), [1] * 5, positions, slots, list(LAYERS))
    expected = [[slot[j].table[p // BLOCK] * BLOCK + p % BLOCK for p, slot in zip(positions, slots, strict=True)]
                for j in LAYERS]
    assert step.positions.tolist() == [positions] * len(LAYERS)
    assert step.slot_ids.tolist() == expected
    for index, j in enumerate(LAYERS):
        for i, slot in enumerate(slots):
            table = step.tables(index)[i].tolist()
            assert table[: len(slot[j].table)] == slot[j].table and set(table[len(slot[j].table):]) <= {0}


@pytest.mark.parametrize("widths, split, groups", [
    # Rows within twice each other's blocks: one group, as they come (the common step).
    ([3, 5, 4], 1, [[0, 1, 2]]),
    # One long context among short ones: it alone, the short ones together.
    ([2, 500, 3, 2], 1, [[1], [2, 0, 3]]),
    # ... unless the padding it would add is less than `split` blocks: one call then costs less than two.
    ([2, 500, 3, 2], 10**6, [[0, 1, 2, 3]]),
    # A halving chain: each row would be padded past twice its own, so each is alone...
    ([64, 31, 15, 7], 1, [[0], [1], [2], [3]]),
    # ... and with a split of 40 blocks, the padding each adds counted against it: 64 + 31 (33 padded),
    # then 15 (49 would pass 40) and 7 (8 padded) together.
    ([64, 31, 15, 7], 40, [[0, 1], [2, 3]]),
])
def test_decode_rows_are_grouped_by_the_blocks_they_read(widths, split, groups):
    assert paged_step._grouped(widths, split) == groups
