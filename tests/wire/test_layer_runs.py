"""A Batch's layer ops read at once by a layout learnt from an earlier Batch of as many ops (the
codec's `_Seen`): whatever was learnt before, every Batch decodes to the ops its master sent, and
a broken one is refused as the item-by-item read refuses it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cakemp.errors import ProtocolError
from cakemp.wire import Batch, DType, LayerOp, RawTensor, Revision, decode_payload, encode_payload

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
