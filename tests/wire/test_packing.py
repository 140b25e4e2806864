"""Cake's pack_tensors vector read back: any pack of tensors round-trips to its layout, and each
way a header can be wrong is refused by name before anything is allocated (no torch)."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cakemp.errors import BadTensor
from cakemp.wire.packing import MAX_DIM, MAX_TENSORS, PackedTensor, unpack_layout


def packed(*shapes: tuple[int, ...], extra: tuple[float, ...] = ()) -> bytes:
    """The vector Cake's pack_tensors makes of tensors of `shapes` (data: 0, 1, 2, ... per tensor)."""
    values: list[float] = [len(shapes)]
    for shape in shapes:
        values += [len(shape), *shape, *range(math.prod(shape))]
    return struct.pack(f"<{len(values) + len(extra)}f", *values, *extra)


@given(st.lists(st.lists(st.integers(0, 5), max_size=4).map(tuple), min_size=1, max_size=MAX_TENSORS))
def test_any_pack_reads_back_as_its_shapes_and_offsets(shapes):
    """Every tensor's shape and the element its data starts at, in order."""
    layout = unpack_layout(packed(*shapes))
    start = 1
    expected = []
    for shape in shapes:
        start += 1 + len(shape)
        expected.append(PackedTensor(shape, start))
        start += math.prod(shape)
    assert layout == tuple(expected)


def test_a_unet_call_as_cake_packs_it():
    """latents [2,4,8,8], text [2,77,32], timestep [1]: the spec's example layout."""
    layout = unpack_layout(packed((2, 4, 8, 8), (2, 77, 32), (1,)))
    assert [t.shape for t in layout] == [(2, 4, 8, 8), (2, 77, 32), (1,)]
    assert layout[0].start == 6 and layout[1].start == 6 + 512 + 4


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize(("data", "words"), [
    (b"", "the vector ends before the tensor count"),
    (b"\0\0\0", "3 bytes are not a whole number of f32 elements"),
    (f32(0), "the tensor count is 0.0"),
    (f32(MAX_TENSORS + 1), f"the tensor count is {MAX_TENSORS + 1.0}"),
    (f32(-1), "the tensor count is -1.0"),
    (f32(float("inf")), "the tensor count is inf"),
    (f32(1.5), "the tensor count is 1.5"),
    (f32(1, 9), "tensor 0's ndim is 9.0"),
    (f32(1, 2, 3), "the vector ends before tensor 0's dim 1"),
    (f32(1, 1, MAX_DIM), f"tensor 0's dim 0 is {float(MAX_DIM)}"),
    (f32(1, 2, 4096, 4096), "needs 16777216 elements, 0 are left"),
    (f32(2, 1, 1, 7.0), "the vector ends before tensor 1's ndim"),
    (packed((2,), extra=(9.0,)), "1 elements follow the 1 tensors"),
])
def test_a_malformed_header_is_refused_by_name(data, words):
    with pytest.raises(BadTensor) as error:
        unpack_layout(data, "unet")
    assert str(error.value).startswith("unet: ") and words in str(error.value)
