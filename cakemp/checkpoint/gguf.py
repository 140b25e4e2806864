"""A GGUF file (llama.cpp's container), parsed without torch: its metadata and where each
tensor's bytes lie. The bytes themselves are read later, through a memory map, one tensor at a
time (model/weights/gguf.py), so a node reads only the tensors of the layers it serves.

The layout (GGUF versions 2 and 3, little-endian; version 1's 32-bit counts are refused):

    magic "GGUF" | u32 version | u64 tensor count | u64 metadata count
    metadata: count x (string key, u32 value type, value)
    tensor infos: count x (string name, u32 dims, u64 ne[dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then the data: each tensor at its offset

A string is a u64 length and that many UTF-8 bytes; an array a u32 element type, a u64
count and the elements. ne[0] is the fastest-varying dimension, so a tensor is the row-major
array of shape reversed(ne), and its quantization blocks run along ne[0] (within a row).

The file may come from anywhere: every count, length and offset is checked against the bytes
that remain before anything is allocated from it (and the counts that become Python objects
against fixed caps), and whatever is wrong is a CheckpointError naming the file (exit 78),
never a crash or a huge allocation. Arrays stay as compact as on disk (numbers an
`array.array`, strings one `StringArray` buffer, so a vocabulary of 262k tokens is a few MiB, not
tens), and the parsed metadata in all may take no more memory than the file has bytes
(plus METADATA_SLACK): a header of many small arrays is refused by the key that passes it.
"""

from __future__ import annotations

import math
import mmap
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cakemp.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ALIGNMENT = 1 << 16
_MAX_NESTING = 2  # an array of arrays at most (nothing llama.cpp writes nests deeper)
_MAX_ELEMENTS = 1 << 42  # of one tensor: past any model's, and its byte count stays exact in a float
# Counts that become Python objects, beyond what fits in the file: each costs tens of bytes in
# memory where it took a few on disk. Far past what llama.cpp writes (a few thousand tensors, a
# few dozen keys, vocabularies of 262k tokens at most).
_MAX_TENSORS = 1 << 18
_MAX_KEYS = 1 << 16
_MAX_ARRAY = 1 << 22
_MAX_STRING = 1 << 24  # bytes (chat templates, the longest strings written, are tens of KiB)
# What the parsed metadata may take in memory beyond the file's size: the keys and scalars' objects.
METADATA_SLACK = 16 << 20


@dataclass(frozen=True)
class GgmlType:
    """A ggml tensor type: `block` values stored in `block_bytes` bytes."""

    name: str
    block: int
    block_bytes: int


# The ggml types by their number in a tensor info (ggml.h's enum ggml_type), with their block
# sizes; which of them are dequantized is model/weights/ggml.py's to say.
GGML_TYPES = {
    0: GgmlType("F32", 1, 4), 1: GgmlType("F16", 1, 2),
    2: GgmlType("Q4_0", 32, 18), 3: GgmlType("Q4_1", 32, 20),
    6: GgmlType("Q5_0", 32, 22), 7: GgmlType("Q5_1", 32, 24),
    8: GgmlType("Q8_0", 32, 34), 9: GgmlType("Q8_1", 32, 40),
    10: GgmlType("Q2_K", 256, 84), 11: GgmlType("Q3_K", 256, 110), 12: GgmlType("Q4_K", 256, 144),
    13: GgmlType("Q5_K", 256, 176), 14: GgmlType("Q6_K", 256, 210), 15: GgmlType("Q8_K", 256, 292),
    16: GgmlType("IQ2_XXS", 256, 66), 17: GgmlType("IQ2_XS", 256, 74), 18: GgmlType("IQ3_XXS", 256, 98),
    19: GgmlType("IQ1_S", 256, 50), 20: GgmlType("IQ4_NL", 32, 18), 21: GgmlType("IQ3_S", 256, 110),
    22: GgmlType("IQ2_S", 256, 82), 23: GgmlType("IQ4_XS", 256, 136),
    24: GgmlType("I8", 1, 1), 25: GgmlType("I16", 1, 2), 26: GgmlType("I32", 1, 4), 27: GgmlType("I64", 1, 8),
    28: GgmlType("F64", 1, 8), 29: GgmlType("IQ1_M", 256, 56), 30: GgmlType("BF16", 1, 2),
    34: GgmlType("TQ1_0", 256, 54), 35: GgmlType("TQ2_0", 256, 66), 39: GgmlType("MXFP4", 32, 17),
}

# Metadata value types: struct format of the scalars; 7 is bool, 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Memory of one parsed scalar (a float's or a small int's object, and its slot) and an array's object.
_SCALAR_BYTES = 32
_ARRAY_BYTES = sys.getsizeof(array("B"))
# array.array's typecode of each scalar type's array (bools as bytes 0 and 1; 8-byte ints as q/Q).
_ARRAY_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}


class NumberArray(array):
    """A metadata array of numbers, as compact as in the file; equal to the list of its values."""

    def __eq__(self, other: object) -> bool:
        return list(self) == other if isinstance(other, list) else super().__eq__(other)

    __hash__ = None  # mutable, as list


class StringArray(Sequence[str]):
    """A metadata array of strings held as the file holds them: one UTF-8 buffer and each string's end
    (a str is decoded when asked for); equal to the list of its strings."""

    def __init__(self, blob: bytes, ends: array):
        self._blob, self._ends = blob, ends

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, and IndexError past the end
        return self._blob[self._ends[i - 1] if i else 0 : self._ends[i]].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        start = 0
        for end in self._ends:
            yield self._blob[start:end].decode("utf-8")
            start = end

    def __eq__(self, other: object) -> bool:
        return list(self) == other if isinstance(other, list) else NotImplemented

    __hash__ = None

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sys.getsizeof(self._blob) + sys.getsizeof(self._ends)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, as torch sees it: reversed(ne)
    type: GgmlType
    start: int  # absolute offset of its first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    """Reads the header's little-endian values in order, each checked to lie within the file."""

    def __init__(self, data: mmap.mmap | bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path
        self.left = len(data) + METADATA_SLACK  # bytes the parsed metadata may still take in memory

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a usable GGUF file: {what} (at byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        """Advance past `n` bytes; -> where they start."""
        if n > len(self.data) - self.pos:
            raise self.fail(f"{what} runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from("<" + fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, min_bytes_each: int, most: int | None = None) -> int:
        """A u64 count of items that take at least `min_bytes_each` bytes each: no more than fit in what
        is left, nor than `most`."""
        n = self.scalar("Q", what)
        if n * min_bytes_each > len(self.data) - self.pos:
            raise self.fail(f"{what} {n} cannot fit in the file")
        if most is not None and n > most:
            raise self.fail(f"{what} {n} is over {most}")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"{what}'s length", 1, _MAX_STRING)
        start = self.take(n, what)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """The value of type `kind` next in the file, its memory counted (`spend`) before it is built."""
        if kind in _SCALARS:
            self.spend(_SCALAR_BYTES, what)
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            value = self.string(what)
            self.spend(sys.getsizeof(value), what)
            return value
        if kind != _ARRAY or depth >= _MAX_NESTING:
            raise self.fail(f"{what} has value type {kind}, which GGUF does not define here")
        element = self.scalar("I", f"{what}'s element type")
        if element in _SCALARS:  # numbers: copied as they lie (little-endian, as every host cakemp runs on)
            size = struct.calcsize(_SCALARS[element])
            n = self.count(f"{what}'s length", size, _MAX_ARRAY)
            start = self.take(n * size, what)
            self.spend(_ARRAY_BYTES + n * size, what)
            values = NumberArray(_ARRAY_CODES[element])
            values.frombytes(self.data[start : start + n * size])
            if element == 7 and any(value > 1 for value in values):
                raise self.fail(f"{what} holds a bool that is neither 0 nor 1")
            return values
        n = self.count(f"{what}'s length", 8, _MAX_ARRAY)  # strings and arrays start with a u64
        if element == _STRING:
            return self.strings(n, what)
        self.spend(8 * n, what)  # the list's pointers; each item counts itself
        return [self.value(element, what, depth + 1) for _ in range(n)]

    def strings(self, n: int, what: str) -> StringArray:
        """`n` strings in a row, each checked as `string` checks one, kept in one buffer."""
        data, pos, end = self.data, self.pos, len(self.data)
        starts, ends, total = array("Q"), array("Q"), 0  # each string's first byte in the file, its end in the buffer
        for _ in range(n):
            if end - pos < 8:
                break
            (length,) = struct.unpack_from("<Q", data, pos)
            if length > min(end - pos - 8, _MAX_STRING):
                break
            starts.append(pos + 8)
            total += length
            ends.append(total)
            pos += 8 + length
        if len(ends) < n:
            self.pos = pos
            raise self.fail(f"string {len(ends)} of {what} runs past the end of the file or is over {_MAX_STRING} bytes")
        self.spend(sys.getsizeof(starts) + total, what)  # the buffer, and the ends as big as the starts
        blob, at = bytearray(total), 0
        for start, stop in zip(starts, ends):
            blob[at:stop] = piece = data[start : start + stop - at]
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                self.pos = start
                raise self.fail(f"a string of {what} is not UTF-8") from None
            at = stop
        self.pos = pos
        return StringArray(bytes(blob), ends)

    def spend(self, nbytes: int, what: str) -> None:
        """Count `nbytes` more of parsed metadata in memory; refused past what is `left`."""
        self.left -= nbytes
        if self.left < 0:
            raise self.fail(f"metadata {what} takes the parsed metadata past the file's {len(self.data)} bytes + "
                            f"{METADATA_SLACK} in memory")


class GgufFile:
    """A GGUF file's metadata (key -> value) and tensor infos (name -> TensorInfo), read once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc}") from None
        if isinstance(data, mmap.mmap):
            # The header only: no read-around of MiBs of tensor data past it (the kernel's readahead,
            # which would also run on into the first layers' bytes when the tensors are read later).
            data.madvise(mmap.MADV_RANDOM)
        try:
            self.size = len(data)
            cursor = _Cursor(data, self.path)
            self.version, tensors, keys = self._header(cursor)
            self.metadata = self._metadata(cursor, keys)
            self.alignment = self._alignment(cursor)
            infos = [self._tensor_info(cursor) for _ in range(tensors)]
            self.data_offset = -(-cursor.pos // self.alignment) * self.alignment
            self.tensors = self._placed(cursor, infos)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()

    @staticmethod
    def _header(cursor: _Cursor) -> tuple[int, int, int]:
        if bytes(cursor.data[cursor.take(4, "the magic") : 4]) != MAGIC:
            raise cursor.fail("it does not start with GGUF")
        version = cursor.scalar("I", "the version")
        if version not in VERSIONS:
            raise cursor.fail(f"GGUF version {version} is not supported (only {' and '.join(map(str, VERSIONS))})")
        # A tensor info takes at least 8 + 4 + 8 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
        return version, cursor.count("the tensor count", 32, _MAX_TENSORS), cursor.count("the metadata count", 13, _MAX_KEYS)

    @staticmethod
    def _metadata(cursor: _Cursor, keys: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for _ in range(keys):
            key = cursor.string("a metadata key")
            if key in metadata:
                raise cursor.fail(f"metadata key {key!r} appears twice")
            cursor.spend(sys.getsizeof(key), key)
            metadata[key] = cursor.value(cursor.scalar("I", f"{key}'s type"), key)
        return metadata

    def _alignment(self, cursor: _Cursor) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= _MAX_ALIGNMENT \
                or alignment & (alignment - 1):
            raise cursor.fail(f"general.alignment {alignment!r} is not a power of two up to {_MAX_ALIGNMENT}")
        return alignment

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GgmlType, int]:
        name = cursor.string("a tensor name")
        dims = cursor.scalar("I", f"{name}'s dimension count")
        if not 1 <= dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name} has {dims} dimensions (1..{MAX_DIMS})")
        ne = [cursor.scalar("Q", f"{name}'s shape") for _ in range(dims)]
        if not all(ne) or math.prod(ne) > _MAX_ELEMENTS:
            raise cursor.fail(f"tensor {name} has shape {ne}")
        number = cursor.scalar("I", f"{name}'s type")
        if number not in GGML_TYPES:
            raise cursor.fail(f"tensor {name} has ggml type {number}, which is unknown")
        kind = GGML_TYPES[number]
        if ne[0] % kind.block:
            raise cursor.fail(f"tensor {name}'s rows of {ne[0]} are not whole {kind.name} blocks of {kind.block}")
        return name, tuple(reversed(ne)), kind, cursor.scalar("Q", f"{name}'s offset")

    def _placed(self, cursor: _Cursor, infos: list) -> dict[str, TensorInfo]:
        """Each tensor with its absolute place, checked to lie within the file, aligned, named once."""
        tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in infos:
            nbytes = math.prod(shape) // kind.block * kind.block_bytes
            if offset % self.alignment or offset + nbytes > self.size - self.data_offset:
                raise cursor.fail(f"tensor {name}'s {nbytes} bytes at offset {offset} lie outside the data "
                                  f"({self.size - self.data_offset} bytes, aligned to {self.alignment})")
            if name in tensors:
                raise cursor.fail(f"tensor {name} appears twice")
            tensors[name] = TensorInfo(name, shape, kind, self.data_offset + offset, nbytes)
        return tensors
