"""A request's ops as columns (cakemp/op.py): the ops they were made of, read back as they are."""

from __future__ import annotations

from cakemp.op import Op, Ops


def test_ops_as_columns_are_the_ops_they_were_made_of_and_no_others():
    ops = (Op(0, 7, 3), Op(1, 7, 4), Op(2, 7, 5))
    held = Ops.of(ops)
    assert held.columns == ((0, 1, 2), (7, 7, 7), (3, 4, 5))
    assert list(held) == list(ops) and held[1] == ops[1] and held[1:] == ops[1:] and len(held) == 3
    assert held == ops and hash(held) == hash(ops)
    for other in (ops[:2], (Op(0, 7, 3), Op(1, 7, 4), Op(2, 8, 5)), (Op(0, 7, 3), Op(1, 7, 4), Op(3, 7, 5))):
        assert held != other and held != Ops.of(other)


def test_one_position_is_read_where_every_op_shares_it():
    """A decode's ops share one position (its rows then take one mask and rotation for every layer)."""
    assert Ops.of((Op(0, 7, 3), Op(1, 7, 4))).position == 7
    assert Ops.of((Op(0, 7, 3), Op(1, 8, 4))).position is None
    assert Ops.of(()).position is None


def test_a_piece_of_a_request_is_at_its_positions_past_the_first():
    """A prompt cut where it is computed: a piece `start` tokens in runs each op `start` positions further."""
    assert Ops.of((Op(0, 5, 3), Op(1, 9, 4))).shifted(128) == (Op(0, 133, 3), Op(1, 137, 4))
