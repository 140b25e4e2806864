"""Admission: the front refuses, by name and figure, every request a device cannot serve cleanly."""

from __future__ import annotations

import pytest

from cakemp.errors import BadOps, BadTensor, ContextLimitExceeded, PeerFault, UnknownLayer
from cakemp.front.admission import LayerAdmission, shown
from cakemp.wire import MAX_PAYLOAD, DType, LayerOp, LayerOps, RawTensor

HIDDEN = 8
ADMISSION = LayerAdmission(frozenset(f"model.layers.{i}" for i in range(4)), HIDDEN, max_context=32,
                      blocks=frozenset(range(4)))


def activation(tokens: int = 2, dtype: DType = DType.F32, shape=None) -> RawTensor:
    shape = (1, tokens, HIDDEN) if shape is None else shape
    return RawTensor(bytes(tokens * HIDDEN * dtype.itemsize), dtype, shape)


def ops(*layers: int, index_pos: int = 0) -> LayerOps:
    return LayerOps.of(LayerOp(f"model.layers.{i}", index_pos, i) for i in layers)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16, DType.F32])
def test_a_cake_masters_request_is_admitted(dtype):
    """[1, T, hidden] of any float wire dtype over served layers, each once, is admitted."""
    ADMISSION.check(activation(3, dtype), ops(0, 1, 2, 3, index_pos=29))


@pytest.mark.parametrize("x, words", [
    (activation(dtype=DType.F64), "unsupported dtype F64"),
    (RawTensor(b"", 42, (1, 1, HIDDEN)), "unsupported dtype tag 42"),
    (RawTensor(bytes(HIDDEN * 4), DType.F32, (1,) * 255 + (HIDDEN,)), "of 256 dimensions"),
    (RawTensor(b"", DType.F32, (2**64 - 1, 0)), r"\[18446744073709551615, 0\], expected \[1, T, 8\]"),
    (RawTensor(b"", DType.F32, (1, 0, HIDDEN)), "T >= 1"),
    (RawTensor(bytes(2 * HIDDEN * 4), DType.F32, (2, 1, HIDDEN)), r"\[2, 1, 8\]"),
    (RawTensor(bytes(16 * 4), DType.F32, (1, 1, 16)), r"\[1, 1, 16\], expected \[1, T, 8\]"),
    (RawTensor(bytes(7), DType.F32, (1, 2, HIDDEN)), "data is 7 bytes, shape \\[1, 2, 8\\] of F32 needs 64"),
])
def test_a_tensor_that_is_not_one_hidden_state_is_refused(x, words):
    """A dtype no hidden state has, any shape but [1, T, hidden] (without multiplying dims that could
    wrap), or a byte count that does not match is BadTensor, naming what is wrong."""
    with pytest.raises(BadTensor, match=words):
        ADMISSION.check(x, ops(0))


@pytest.mark.parametrize("x, request_ops, error, words", [
    (activation(33), ops(0), ContextLimitExceeded, "33 positions in one request pass the context limit of 32"),
    (activation(2), ops(0, index_pos=31), ContextLimitExceeded, "positions 31..32 of layer model.layers.0"),
    (activation(), (LayerOp("model.layers.0", 0, 0),) * 500_000, BadOps, "has 500000 ops; this worker serves 4 layers"),
    (activation(), ops(0, 1, 0), BadOps, "layer model.layers.0 appears twice"),
    (activation(), (LayerOp("model.layers.0", 0, 1), LayerOp("model.layers.1", 0, 1)), BadOps, "block_idx 1 .* twice"),
    # A slot past the served layers' numbers: one session could otherwise hold KV for every layer of the model.
    (activation(), (LayerOp("model.layers.0", 0, 6),), BadOps, r"block_idx 6 of layer model.layers.0 .* \(0-3\)"),
    (activation(), (LayerOp("model.layers.9", 0, 0),), UnknownLayer, "^could not find layer model.layers.9$"),
    (activation(), (LayerOp("x" * 10_000, 0, 0),), UnknownLayer, r"^could not find layer x{64}… \(10000 chars\)$"),
])
def test_a_layer_run_the_worker_cannot_serve_is_refused(x, request_ops, error, words):
    """Too many positions, more ops than served layers, a layer or KV slot twice, a slot out of
    range or an unknown layer are refused before any device sees them; a peer's long name is clipped."""
    with pytest.raises(error, match=words) as refused:
        ADMISSION.check(x, LayerOps.of(request_ops))
    assert isinstance(refused.value, PeerFault)


def test_a_layer_run_admitted_before_is_checked_again_at_its_new_positions():
    """A run that passed passes again without its ops checked one by one, but never past the context
    limit: the refusal names the layer, as the first time would have."""
    admission = LayerAdmission(frozenset(f"model.layers.{i}" for i in range(4)), HIDDEN, 32, frozenset(range(4)))
    admission.check(activation(2), ops(1, 2, index_pos=0))
    admission.check(activation(2), ops(1, 2, index_pos=30))
    with pytest.raises(ContextLimitExceeded, match="positions 31..32 of layer model.layers.1"):
        admission.check(activation(2), ops(1, 2, index_pos=31))
    with pytest.raises(BadOps, match="layer model.layers.1 appears twice"):  # another run: checked in full
        admission.check(activation(2), ops(1, 2, 1))


def test_the_layer_runs_kept_are_bounded_and_the_rest_still_checked():
    """A peer sending ever new valid runs grows no memory past the runs kept; a bad run after them is refused."""
    admission = LayerAdmission(frozenset(f"model.layers.{i}" for i in range(4)), HIDDEN, 32, frozenset(range(4)))
    runs = [(LayerOp(f"model.layers.{a}", 0, slot_a), LayerOp(f"model.layers.{b}", 0, slot_b))
            for a in range(4) for b in range(4) if a != b for slot_a in range(4) for slot_b in range(4) if slot_a != slot_b]
    for run in runs:  # 144 distinct runs
        admission.check(activation(), LayerOps.of(run))
    assert len(admission._runs) == 64
    with pytest.raises(BadOps, match="appears twice"):
        admission.check(activation(), ops(3, 3))


def test_an_empty_layer_run_is_admitted():
    """A Batch with no op is admitted, as Cake's worker takes it (the front answers it without a device)."""
    ADMISSION.check(activation(), LayerOps.of(()))


def test_shown_escapes_what_is_not_printable():
    """Control characters in a peer's string come back escaped, not raw."""
    assert shown("a\x1b[2Jb") == repr("a\x1b[2Jb")


def test_the_largest_frame_fits_the_longest_activation_and_no_more_than_cakes_cap():
    """max_payload holds a context-long f32 activation and a run over every layer, and never passes Cake's 512 MiB."""
    assert ADMISSION.max_payload() >= 32 * HIDDEN * 4 + 4 * (4 + len("model.layers.0") + 16)
    assert ADMISSION.max_payload() < 1 << 20
    huge = LayerAdmission(ADMISSION.layers, 8192, max_context=131072, blocks=ADMISSION.blocks)
    assert huge.max_payload() == MAX_PAYLOAD
