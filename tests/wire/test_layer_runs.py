"""A Batch's layer ops read at once by a layout learnt from an earlier Batch of as many ops (the
codec's `_Seen`): whatever was learnt before, every Batch decodes to the ops its master sent, and
a broken one is refused as the item-by-item read refuses it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cakemp.errors import ProtocolError
from cakemp.wire import Batch, DType, LayerOp, LayerOps, RawTensor, Revision, decode_payload, encode_payload

X = RawTensor(bytes(8), DType.F32, (1, 1, 2))
BOTH = pytest.mark.parametrize("revision", [Revision.V1, Revision.V2])


def run(names: list[str], index_pos: int = 7) -> tuple[LayerOp, ...]:
    return tuple(LayerOp(name, index_pos, block_idx) for block_idx, name in enumerate(names))


def read(ops: tuple[LayerOp, ...], revision: Revision = Revision.V2) -> tuple[LayerOp, ...]:
    return decode_payload(encode_payload(Batch(X, ops), revision), revision).batch


def layers(first: int, count: int) -> list[str]:
    return [f"model.layers.{i}" for i in range(first, first + count)]


@BOTH
def test_a_run_read_again_is_the_run_sent_each_step(revision):
    """The first read learns the layout; the next steps, at other positions, read through it."""
    for index_pos in range(5, 9):
        ops = run(layers(0, 16), index_pos)
        assert read(ops, revision) == ops


def test_a_batch_holds_its_ops_as_columns_equal_to_the_ops_and_to_nothing_else():
    """A Batch's ops, made of LayerOps or read back, are LayerOps: their columns are the ops' fields, each
    op and slice is the one sent, and they equal those ops and no others (layers, positions or slots)."""
    ops = run(layers(3, 5), 11)
    for held in (Batch(X, ops).batch, read(ops), read(ops)):  # made; read op by op; read through the layout
        assert type(held) is LayerOps
        assert (held.layers, held.positions, held.blocks) == (tuple(layers(3, 5)), (11,) * 5, tuple(range(5)))
        assert list(held) == list(ops) and held[2] == ops[2] and held[-1] == ops[-1] and held[1:3] == ops[1:3]
        assert len(held) == 5 and hash(held) == hash(ops)
        for other in (run(layers(4, 5), 11), run(layers(3, 5), 12), ops[:4], tuple(op._replace(block_idx=9) for op in ops)):
            assert held != other and held != LayerOps.of(other)


def test_a_learnt_run_is_read_with_the_names_tuple_it_was_learnt_with():
    """Every Batch of a run read through its learnt layout names its layers with one tuple: what the
    front keeps by a run's names (admission, routes) is then found without comparing them."""
    first, second = read(run(layers(0, 8), 3)), read(run(layers(0, 8), 4))
    assert second.layers is read(run(layers(0, 8), 5)).layers and second.layers == first.layers


def test_names_of_the_same_lengths_are_read_as_sent():
    """Layers 1-8 learnt, then 2-9 (the same lengths, other names): the names are the second run's."""
    assert read(run(layers(1, 8))) == run(layers(1, 8))
    assert read(run(layers(2, 8))) == run(layers(2, 8))
    assert read(run(layers(1, 8))) == run(layers(1, 8))


def test_names_of_other_lengths_are_read_as_sent():
    """Layers 0-7 learnt, then 6-13 (lengths change at layer 10)."""
    assert read(run(layers(0, 8))) == run(layers(0, 8))
    assert read(run(layers(6, 8))) == run(layers(6, 8))


@given(st.lists(st.lists(st.text(max_size=6), min_size=4, max_size=6), min_size=2, max_size=6),
       st.integers(0, 2**64 - 1))
def test_any_runs_in_any_order_are_each_read_as_sent(runs, index_pos):
    for names in runs:
        ops = run(names, index_pos)
        assert read(ops) == ops


def test_a_run_cut_short_after_a_learnt_one_is_refused_as_truncated():
    ops = run(layers(0, 6))
    read(ops)
    payload = encode_payload(Batch(X, ops), Revision.V2)
    with pytest.raises(ProtocolError, match="truncated payload: Batch.batch"):
        decode_payload(payload[:-3], Revision.V2)


def test_a_name_that_is_not_utf8_after_a_learnt_run_is_refused_as_such():
    ops = run(["layer.a", "layer.b", "layer.c", "layer.d"])
    read(ops)
    payload = bytearray(encode_payload(Batch(X, ops), Revision.V2))
    at = payload.index(b"layer.c")
    payload[at + 6] = 0xFF  # the same length, a byte no UTF-8 text holds
    with pytest.raises(ProtocolError, match="invalid UTF-8 in Batch.batch"):
        decode_payload(bytes(payload), Revision.V2)


def test_a_length_that_differs_from_the_learnt_one_is_read_as_it_says():
    """The learnt run's bytes with its first name's length one short: read as the master wrote it (its
    name one byte short, every field after it shifted), which runs past the payload's end; never as
    the learnt run, whose name bytes still sit where the learnt layout looks for them."""
    ops = run(layers(0, 4))
    read(ops)
    payload = bytearray(encode_payload(Batch(X, ops), Revision.V2))
    at = payload.index(b"model.layers.0") - 4
    payload[at:at + 4] = (len("model.layers.0") - 1).to_bytes(4, "big")
    with pytest.raises(ProtocolError, match="truncated payload"):
        decode_payload(bytes(payload), Revision.V2)
