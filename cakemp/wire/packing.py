"""Cake's `pack_tensors`: several tensors in one 1-D F32 vector, read back with every count checked.

Cake's image master sends a component several tensors (a UNet step: latents, text embeddings,
timestep) as one wire tensor of dtype F32 and shape [total]:

    [n, ndim_0, dim_0_0 … dim_0_{ndim_0-1}, data_0 …, ndim_1, dim_1_0 …, data_1 …, …]

where every element, the counts and dims included, is an f32 (so a dim is exact only below 2^24).
`unpack_layout` reads the header values one at a time and checks each before it is used: a
count is a whole number in its range, a tensor's data fits in what is left, and the tensors use
the vector exactly. It returns where each tensor lies, allocating nothing; torch-free, so the
front judges a master's packing before it reaches a device, and the device reads the same layout.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from cakemp.errors import BadTensor

# Bounds of what a Cake master packs: at most 7 tensors (FLUX.1's transformer call), each of at
# most 4 dimensions; the bounds leave room without letting a header name thousands of tensors.
MAX_TENSORS = 16
MAX_NDIM = 8
# f32 holds every integer exactly below this; Cake's dims are f32, so no real dim is larger.
MAX_DIM = 1 << 24
_F32 = struct.Struct("<f")


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a pack: its shape, and where its data starts (in f32 elements into the vector)."""

    shape: tuple[int, ...]
    start: int

    @property
    def count(self) -> int:
        return math.prod(self.shape)


def unpack_layout(data: bytes | bytearray | memoryview, what: str = "packed tensor") -> tuple[PackedTensor, ...]:
    """Where each tensor of the pack in `data` (little-endian f32 elements) lies. Raises BadTensor
    naming `what` (the component) and the first value that is wrong."""
    view = memoryview(data).cast("B")
    if view.nbytes % 4:
        raise BadTensor(f"{what}: {view.nbytes} bytes are not a whole number of f32 elements")
    total = view.nbytes // 4
    reader = _Reader(view, total, what)
    n = reader.whole("the tensor count", 1, MAX_TENSORS)
    layout = []
    for i in range(n):
        ndim = reader.whole(f"tensor {i}'s ndim", 0, MAX_NDIM)
        shape = tuple(reader.whole(f"tensor {i}'s dim {d}", 0, MAX_DIM - 1) for d in range(ndim))
        count = math.prod(shape)
        if count > total - reader.position:
            raise BadTensor(f"{what}: tensor {i} of shape {list(shape)} needs {count} elements, "
                            f"{total - reader.position} are left")
        layout.append(PackedTensor(shape, reader.position))
        reader.position += count
    if reader.position != total:
        raise BadTensor(f"{what}: {total - reader.position} elements follow the {n} tensors the header names")
    return tuple(layout)


class _Reader:
    """Header values read one f32 at a time from the front of the vector."""

    def __init__(self, view: memoryview, total: int, what: str):
        self.view, self.total, self.what = view, total, what
        self.position = 0

    def whole(self, name: str, low: int, high: int) -> int:
        """The next element as a whole number in [low, high]."""
        if self.position >= self.total:
            raise BadTensor(f"{self.what}: the vector ends before {name} ({self.total} elements)")
        (value,) = _F32.unpack_from(self.view, 4 * self.position)
        self.position += 1
        if not math.isfinite(value) or value != int(value) or not low <= value <= high:
            raise BadTensor(f"{self.what}: {name} is {value!r}, expected a whole number in {low}..{high}")
        return int(value)
