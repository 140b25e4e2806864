"""Cake's `Message` enum as frozen dataclasses, and its speedy BigEndian payload codec.

The encoding is speedy 0.8.7's default for Cake's `#[derive(Readable, Writable)]` types
(spec §1, §3): enum tag u32, String = u32 length + UTF-8, Vec<T> = u32 count + elements,
usize = u64, u128 = 16 bytes, bool = 1 byte, every integer big-endian. Tensor element bytes
are the exception: they are the tensor's raw little-endian memory, passed through untouched.

Decoding never copies tensor or model data: `RawTensor.data` and `ModelDataChunk.data` are
memoryviews into the payload given to `decode_payload`, so a prefill-size message costs the
same to decode as a decode-size one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from cakemp.errors import MalformedTensor, ProtocolError

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_U64_MAX = 2**64 - 1


class Revision(IntEnum):
    """Which Cake `Message` enum is on the wire; they differ from tag 8 on (spec §3.1)."""

    V1 = 1  # Cake fa7d08a: WorkerReady 10, WorkerError 11, ModelDataChunk without compression
    V2 = 2  # Cake HEAD (after 6ec79c2): ModelDataResume 10, WorkerReady 11, WorkerError 12


class DType(IntEnum):
    """Cake's u8 dtype tags for `RawTensor.dtype` (spec §3.2)."""

    U8 = 0
    U32 = 1
    I64 = 2
    BF16 = 3
    F16 = 4
    F32 = 5
    F64 = 6
    F8E4M3 = 7

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.U8: 1,
    DType.U32: 4,
    DType.I64: 8,
    DType.BF16: 2,
    DType.F16: 2,
    DType.F32: 4,
    DType.F64: 8,
    DType.F8E4M3: 1,
}


@dataclass(frozen=True)
class RawTensor:
    """A tensor as Cake sends it: row-major little-endian element bytes, a dtype tag, a shape.

    `dtype` is the raw tag (an int, a `DType` when known) so that a tensor can be built with
    any tag; `decode_payload` only hands out tensors whose tag is known and whose byte count
    matches the shape.
    """

    data: bytes | memoryview
    dtype: int
    shape: tuple[int, ...]


class LayerOp(NamedTuple):
    """One entry of `Batch.batch`: run `layer` with RoPE offset `index_pos`, KV slot `block_idx`."""

    layer: str
    index_pos: int
    block_idx: int


@dataclass(frozen=True)
class Hello:
    """Master → worker, first frame of an inference connection; answered with WorkerInfo."""


@dataclass(frozen=True)
class WorkerInfo:
    """Worker → master, answer to Hello and Goodbye; the master only logs it (spec §3.3)."""

    version: str
    dtype: str
    os: str
    arch: str
    device: str
    device_idx: int
    latency: int  # milliseconds spent reading the request (u128 on the wire)


@dataclass(frozen=True)
class SingleOp:
    """Master → worker: run one layer (Cake sends it only for image models)."""

    layer_name: str
    x: RawTensor
    index_pos: int
    block_idx: int


@dataclass(frozen=True)
class Batch:
    """Master → worker: run the layers of `batch` in order on `x`; answered with Tensor."""

    x: RawTensor
    batch: tuple[LayerOp, ...]


@dataclass(frozen=True)
class TensorMessage:
    """Worker → master: the hidden state after a Batch or SingleOp (`Message::Tensor`)."""

    tensor: RawTensor


@dataclass(frozen=True)
class Goodbye:
    """Master → worker: the chat request ended; clear the KV cache and answer WorkerInfo."""


@dataclass(frozen=True)
class LayerAssignment:
    """Master → worker, first frame of a setup connection: the layers to serve."""

    layers: tuple[str, ...]
    model_hash: str


@dataclass(frozen=True)
class LayerAssignmentAck:
    """Worker → master: whether the worker needs the model files pushed to it."""

    needs_data: bool


@dataclass(frozen=True)
class ModelDataChunk:
    """Master → worker: one piece of a model file; `compressed`/`checksum` exist at V2 only."""

    filename: str
    offset: int
    total_size: int
    data: bytes | memoryview
    compressed: bool = False
    checksum: int = 0  # CRC-32 of `data` as sent (after zstd when compressed)


@dataclass(frozen=True)
class ModelDataDone:
    """Master → worker: every model file has been pushed."""


@dataclass(frozen=True)
class ModelDataResume:
    """Declared by Cake at V2 only and never sent by it; here so that V2 decodes completely."""

    filename: str
    offset: int


@dataclass(frozen=True)
class WorkerReady:
    """Worker → master: the setup is done; the worker closes the setup connection."""


@dataclass(frozen=True)
class WorkerError:
    """Worker → master: the request could not be served; the connection stays usable."""

    message: str


Message = (
    Hello
    | WorkerInfo
    | SingleOp
    | Batch
    | TensorMessage
    | Goodbye
    | LayerAssignment
    | LayerAssignmentAck
    | ModelDataChunk
    | ModelDataDone
    | ModelDataResume
    | WorkerReady
    | WorkerError
)

# The Rust enum in declaration order: a variant's tag is its index (speedy's default tags).
_VARIANTS: dict[Revision, tuple[type, ...]] = {
    Revision.V1: (
        Hello, WorkerInfo, SingleOp, Batch, TensorMessage, Goodbye, LayerAssignment,
        LayerAssignmentAck, ModelDataChunk, ModelDataDone, WorkerReady, WorkerError,
    ),
    Revision.V2: (
        Hello, WorkerInfo, SingleOp, Batch, TensorMessage, Goodbye, LayerAssignment,
        LayerAssignmentAck, ModelDataChunk, ModelDataDone, ModelDataResume, WorkerReady,
        WorkerError,
    ),
}  # fmt: skip
_TAGS = {rev: {cls: tag for tag, cls in enumerate(variants)} for rev, variants in _VARIANTS.items()}


# --------------------------------------------------------------------------- encoding


class _Writer:
    """Collects a payload as buffers: small fields are packed together, bulk data is kept by
    reference so that a tensor's bytes are never copied on the way to the socket."""

    def __init__(self, reserve: int) -> None:
        self.pieces: list[bytes | bytearray | memoryview] = []
        self.head = bytearray(reserve)  # room for the frame header when encoding a frame

    def u8(self, value: int) -> None:
        self.head += _U8.pack(value)

    def u32(self, value: int) -> None:
        self.head += _U32.pack(value)

    def u64(self, value: int) -> None:
        self.head += _U64.pack(value)

    def u128(self, value: int) -> None:
        self.head += value.to_bytes(16, "big")

    def string(self, value: str) -> None:
        raw = value.encode("utf-8")
        self.u32(len(raw))
        self.head += raw

    def bulk(self, data: bytes | memoryview) -> None:
        """Vec<u8>: the length, then `data` as its own piece (not copied)."""
        view = memoryview(data)
        self.u32(view.nbytes)
        self.pieces.append(self.head)
        self.pieces.append(view)
        self.head = bytearray()

    def finish(self) -> list[bytes | bytearray | memoryview]:
        if self.head:
            self.pieces.append(self.head)
        return self.pieces


def _write_tensor(w: _Writer, t: RawTensor) -> None:
    w.bulk(t.data)
    w.u8(t.dtype)
    w.u32(len(t.shape))
    for dim in t.shape:
        w.u64(dim)


def _write(w: _Writer, msg: Message, revision: Revision) -> None:
    try:
        tag = _TAGS[revision][type(msg)]
    except KeyError:
        raise ProtocolError(f"{type(msg).__name__} does not exist at protocol revision {revision.value}") from None
    w.u32(tag)
    if isinstance(msg, Batch):
        _write_tensor(w, msg.x)
        w.u32(len(msg.batch))
        for layer, index_pos, block_idx in msg.batch:
            w.string(layer)
            w.u64(index_pos)
            w.u64(block_idx)
    elif isinstance(msg, TensorMessage):
        _write_tensor(w, msg.tensor)
    elif isinstance(msg, SingleOp):
        w.string(msg.layer_name)
        _write_tensor(w, msg.x)
        w.u64(msg.index_pos)
        w.u64(msg.block_idx)
    elif isinstance(msg, WorkerInfo):
        for text in (msg.version, msg.dtype, msg.os, msg.arch, msg.device):
            w.string(text)
        w.u64(msg.device_idx)
        w.u128(msg.latency)
    elif isinstance(msg, WorkerError):
        w.string(msg.message)
    elif isinstance(msg, LayerAssignment):
        w.u32(len(msg.layers))
        for layer in msg.layers:
            w.string(layer)
        w.string(msg.model_hash)
    elif isinstance(msg, LayerAssignmentAck):
        w.u8(1 if msg.needs_data else 0)
    elif isinstance(msg, ModelDataChunk):
        w.string(msg.filename)
        w.u64(msg.offset)
        w.u64(msg.total_size)
        if revision >= Revision.V2:
            w.u8(1 if msg.compressed else 0)
            w.u32(msg.checksum)
        elif msg.compressed or msg.checksum:
            raise ProtocolError("ModelDataChunk has no compressed/checksum fields at protocol revision 1")
        w.bulk(msg.data)
    elif isinstance(msg, ModelDataResume):
        w.string(msg.filename)
        w.u64(msg.offset)
    # Hello, Goodbye, ModelDataDone, WorkerReady: the tag is the whole message.


def encode_buffers(msg: Message, revision: Revision, reserve: int) -> list[bytes | bytearray | memoryview]:
    """`msg` as buffers, the first a bytearray starting with `reserve` spare bytes (room for
    the frame header); used by `encode_payload` and `frames.encode_frame`."""
    w = _Writer(reserve)
    try:
        _write(w, msg, Revision(revision))
    except (struct.error, OverflowError, UnicodeEncodeError) as exc:
        # A negative or oversized integer, or a str with lone surrogates: not representable.
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None
    return w.finish()


def encode_payload(msg: Message, revision: Revision) -> bytes:
    """The speedy BigEndian payload of `msg` (no frame header)."""
    return b"".join(encode_buffers(msg, revision, 0))


# --------------------------------------------------------------------------- decoding


class _Reader:
    """Bounds-checked big-endian reads over a payload; every failure is a ProtocolError."""

    __slots__ = ("view", "pos", "end", "revision")

    def __init__(self, payload: bytes | bytearray | memoryview, revision: Revision) -> None:
        self.view = memoryview(payload).cast("B")
        self.pos = 0
        self.end = self.view.nbytes
        self.revision = revision

    def need(self, size: int, what: str) -> None:
        left = self.end - self.pos
        if size > left:
            raise ProtocolError(f"truncated payload: {what} needs {size} bytes at offset {self.pos}, only {left} left")

    def u8(self, what: str) -> int:
        self.need(1, what)
        value = self.view[self.pos]
        self.pos += 1
        return value

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.view, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.view, self.pos)
        self.pos += 8
        return value

    def u128(self, what: str) -> int:
        self.need(16, what)
        value = int.from_bytes(self.view[self.pos : self.pos + 16], "big")
        self.pos += 16
        return value

    def flag(self, what: str) -> bool:
        return self.u8(what) != 0  # speedy reads any non-zero byte as true

    def count(self, min_item_size: int, what: str) -> int:
        """A Vec's u32 count, rejected before anything is allocated for it when the rest of
        the payload cannot hold that many items of at least `min_item_size` bytes."""
        n = self.u32(f"{what} count")
        left = self.end - self.pos
        if n * min_item_size > left:
            raise ProtocolError(
                f"{what} count {n} claims at least {n * min_item_size} bytes, only {left} left in the payload"
            )
        return n

    def bulk(self, what: str) -> memoryview:
        """Vec<u8> as a view into the payload (no copy)."""
        size = self.u32(f"{what} length")
        self.need(size, what)
        start = self.pos
        self.pos += size
        return self.view[start : self.pos]

    def string(self, what: str) -> str:
        raw = self.bulk(what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"invalid UTF-8 in {what}: {exc.reason} at byte {exc.start}") from None


def _read_tensor(r: _Reader, what: str) -> RawTensor:
    data = r.bulk(f"{what} data")
    tag = r.u8(f"{what} dtype")
    ndim = r.count(8, f"{what} ndim")
    shape = struct.unpack_from(f">{ndim}Q", r.view, r.pos)
    r.pos += 8 * ndim
    return RawTensor(data, tag, shape)


def _check_tensor(t: RawTensor, what: str) -> RawTensor:
    """The tensor with its tag as a DType, or MalformedTensor when its tag is unknown or its
    byte count does not match its shape."""
    try:
        dtype = DType(t.dtype)
    except ValueError:
        raise MalformedTensor(f"{what} has unknown dtype tag {t.dtype}") from None
    elements = 1
    for dim in t.shape:
        elements *= dim
        if elements > _U64_MAX:  # a usize product in Cake: checked multiplication fails here
            raise MalformedTensor(f"{what} shape {list(t.shape)} overflows the element count")
    expected = elements * dtype.itemsize
    if t.data.nbytes != expected:
        raise MalformedTensor(
            f"{what} data is {t.data.nbytes} bytes, shape {list(t.shape)} of {dtype.name} needs {expected}"
        )
    return RawTensor(t.data, dtype, t.shape)


def _read(r: _Reader, cls: type) -> Message:
    if cls is Batch:
        x = _read_tensor(r, "Batch.x")
        # Each entry is at least a String length and two u64s.
        ops = tuple(
            LayerOp(r.string("Batch layer name"), r.u64("Batch index_pos"), r.u64("Batch block_idx"))
            for _ in range(r.count(20, "Batch.batch"))
        )
        return Batch(x, ops)
    if cls is TensorMessage:
        return TensorMessage(_read_tensor(r, "Tensor"))
    if cls is SingleOp:
        name = r.string("SingleOp.layer_name")
        x = _read_tensor(r, "SingleOp.x")
        return SingleOp(name, x, r.u64("SingleOp.index_pos"), r.u64("SingleOp.block_idx"))
    if cls is WorkerInfo:
        texts = [r.string(f"WorkerInfo.{field}") for field in ("version", "dtype", "os", "arch", "device")]
        return WorkerInfo(*texts, r.u64("WorkerInfo.device_idx"), r.u128("WorkerInfo.latency"))
    if cls is WorkerError:
        return WorkerError(r.string("WorkerError.message"))
    if cls is LayerAssignment:
        layers = tuple(r.string("LayerAssignment layer") for _ in range(r.count(4, "LayerAssignment.layers")))
        return LayerAssignment(layers, r.string("LayerAssignment.model_hash"))
    if cls is LayerAssignmentAck:
        return LayerAssignmentAck(r.flag("LayerAssignmentAck.needs_data"))
    if cls is ModelDataChunk:
        filename = r.string("ModelDataChunk.filename")
        offset = r.u64("ModelDataChunk.offset")
        total_size = r.u64("ModelDataChunk.total_size")
        if r.revision >= Revision.V2:
            compressed = r.flag("ModelDataChunk.compressed")
            checksum = r.u32("ModelDataChunk.checksum")
            return ModelDataChunk(filename, offset, total_size, r.bulk("ModelDataChunk.data"), compressed, checksum)
        return ModelDataChunk(filename, offset, total_size, r.bulk("ModelDataChunk.data"))
    if cls is ModelDataResume:
        return ModelDataResume(r.string("ModelDataResume.filename"), r.u64("ModelDataResume.offset"))
    return cls()  # a unit variant: the tag is the whole message


def decode_payload(payload: bytes | bytearray | memoryview, revision: Revision) -> Message:
    """Decode one speedy BigEndian payload; raises ProtocolError and nothing else.

    Like speedy's `read_from_buffer` (spec §1), bytes after the message are ignored: Cake
    accepts them, and being as liberal as Cake keeps cakemp a drop-in for any master that
    Cake itself accepts.

    A tensor with an unknown dtype tag or a byte count that does not match its shape raises
    MalformedTensor (a ProtocolError): the frame itself was sound, and Cake's worker answers
    such a request with WorkerError and keeps the connection, so callers may do the same.
    """
    r = _Reader(payload, Revision(revision))
    tag = r.u32("message tag")
    variants = _VARIANTS[r.revision]
    if tag >= len(variants):
        raise ProtocolError(f"unknown message tag {tag} at protocol revision {r.revision.value}")
    msg = _read(r, variants[tag])
    # Tensor contents are checked only once the whole message has decoded, so that a
    # structurally broken frame is always a plain ProtocolError (close the connection) and
    # MalformedTensor always means "well-formed frame, unusable tensor" (answer WorkerError).
    if isinstance(msg, Batch):
        return Batch(_check_tensor(msg.x, "Batch.x"), msg.batch)
    if isinstance(msg, SingleOp):
        return SingleOp(msg.layer_name, _check_tensor(msg.x, "SingleOp.x"), msg.index_pos, msg.block_idx)
    if isinstance(msg, TensorMessage):
        return TensorMessage(_check_tensor(msg.tensor, "Tensor"))
    return msg
