"""Cake's `Message` enum as frozen dataclasses, each message declared once, here.

A message's fields are its Rust fields in Cake's order, each annotated with its Rust type
(`Usize`, `String`, ...); a `tuple[T, ...]` field is a `Vec<T>`, and a field of a declared
struct (RawTensor, LayerOp) is that struct. `cakemp.wire.codec` makes its writer and reader of
the speedy encoding from these declarations, so adding a field here is the whole protocol change.

The classes are declared in the Rust enum's order: at a protocol revision, a variant's tag is
its index among the variants that exist at that revision (speedy's default tags). Cake's two
revisions differ only in what exists where: `@message(since=...)` for a variant, a `Since`
mark for a field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Annotated, NamedTuple, Union, dataclass_transform

from cakemp.errors import BadOps, BadTensor, ProtocolError
from cakemp.op import OpColumns


class Revision(IntEnum):
    """Which Cake `Message` enum is on the wire; they differ from tag 8 on (docs/protocol.md, Messages)."""

    V1 = 1  # Cake fa7d08a: WorkerReady 10, WorkerError 11, ModelDataChunk without compression
    V2 = 2  # Cake HEAD (after 6ec79c2): ModelDataResume 10, WorkerReady 11, WorkerError 12


class DType(IntEnum):
    """Cake's u8 dtype tags for `RawTensor.dtype` (docs/protocol.md, Tensors and dtypes)."""

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

    @classmethod
    def describe(cls, tag: int) -> str:
        """A tag as an error message names it: its dtype's name, or "tag N" for a tag Cake has not."""
        return cls(tag).name if tag in cls._value2member_map_ else f"tag {tag}"


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

# The Rust types of Cake's fields, as the codec knows them by name.
U8 = Annotated[int, "u8"]
U32 = Annotated[int, "u32"]
Usize = Annotated[int, "usize"]
U128 = Annotated[int, "u128"]
Bool = Annotated[bool, "bool"]
String = Annotated[str, "String"]
Bytes = Annotated[bytes | memoryview, "Vec<u8>"]  # bulk data: kept by reference both ways, never copied


@dataclass(frozen=True)
class Since:
    """Marks a field that exists from `revision` on; below it the field is not on the wire and
    keeps its default."""

    revision: Revision


@dataclass(frozen=True)
class Bound:
    """Marks a Vec that holds at most `limit` items (a number, or the name of a limit the decoder
    is given, with MAX_ITEMS when it is not): the decoder checks the count before it builds a
    single item, so no frame makes the node build (or log) more than the protocol can mean.

    More is `error`, worded by `text` (with the Vec's `path`, its `owner` — the path without its
    last part — the count `n` and the `limit`): where the frame was whole and only the request is
    wrong (a tensor's shape, a Batch's layer run) a BadRequest, answered as Cake's worker answers
    such a request; else not Cake protocol.
    """

    limit: int | str
    error: type[Exception] = ProtocolError
    text: str = "{path} has {n} items, at most {limit}"

    def refusal(self, path: str, n: int, limit: int) -> Exception:
        return self.error(self.text.format(path=path, owner=path.rpartition(".")[0], n=n, limit=limit))


@dataclass(frozen=True)
class Columns:
    """Marks a Vec whose items are a name and integers (a Batch's layer ops, one a layer) as read into
    `cls(names, *integers)`, a tuple a field (cakemp/op.py's OpColumns: the names as its `layers`, all
    of them as its `columns`), rather than into an object an item, and written from them: a run of 80
    layers then costs the codec, and whoever reads its columns, no object a layer."""

    cls: type


# What any Vec a master may send holds at most (no model has more layers; Cake's
# LayerAssignment names at most that many), and a tensor's dimensions (Cake sends 3).
MAX_ITEMS = 4096
MAX_DIMS = 8


@dataclass(frozen=True)
class Variant:
    """One variant of the enum: its class, the first revision that has it, its fields in wire order."""

    cls: type
    since: Revision
    order: tuple[str, ...]


VARIANTS: list[Variant] = []  # in the Rust enum's order


@dataclass_transform(frozen_default=True)
def message(cls: type | None = None, /, *, since: Revision = Revision.V1,
            order: tuple[str, ...] | None = None) -> type | Callable[[type], type]:
    """Declare a frozen dataclass as the next variant of Cake's enum, from revision `since` on.
    `order` gives the wire order of its fields where Python's differs (defaults must come last)."""

    def declare(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        VARIANTS.append(Variant(cls, since, order or tuple(f.name for f in fields(cls))))
        return cls

    return declare if cls is None else declare(cls)


@dataclass(frozen=True)
class RawTensor:
    """A tensor as Cake sends it: row-major little-endian element bytes, a dtype tag, a shape.

    `dtype` is the raw tag (an int, a `DType` when known) so that a tensor can be built with
    any tag; `decode_payload` only hands out tensors whose tag is known and whose byte count
    matches the shape.
    """

    data: Bytes
    dtype: Annotated[U8, DType]  # decoded as a DType where the tag is known
    shape: Annotated[tuple[Usize, ...], Bound(MAX_DIMS, BadTensor, "{owner} has a shape of {n} dimensions, at most {limit}")]


class LayerOp(NamedTuple):
    """One entry of `Batch.batch`: run `layer` with RoPE offset `index_pos`, KV slot `block_idx`."""

    layer: String
    index_pos: Usize
    block_idx: Usize


class LayerOps(OpColumns[LayerOp]):
    """A Batch's layer ops as columns (cakemp/op.py): the layers' names, positions and KV slots. The
    front routes and admits a request by them as they are, and the decoder gives every Batch of a run
    it has learnt the same `layers` tuple (wire/codec.py, `_Seen`), so what is kept by a run's names is
    found at once."""

    __slots__ = ()
    item = LayerOp


@message
class Hello:
    """Master → worker, first frame of an inference connection; answered with WorkerInfo."""


@message
class WorkerInfo:
    """Worker → master, answer to Hello and Goodbye; the master only logs it (docs/protocol.md, WorkerInfo)."""

    version: String
    dtype: String
    os: String
    arch: String
    device: String
    device_idx: Usize
    latency: U128  # milliseconds spent reading the request


@message
class SingleOp:
    """Master → worker: run one layer (Cake sends it only for image models)."""

    layer_name: String
    x: RawTensor
    index_pos: Usize
    block_idx: Usize


@message
class Batch:
    """Master → worker: run the layers of `batch` in order on `x`; answered with Tensor."""

    x: RawTensor
    # A node passes the number of layers it serves as "ops". Held as LayerOps, whatever sequence of
    # LayerOp it is made with.
    batch: Annotated[tuple[LayerOp, ...], Columns(LayerOps),
                     Bound("ops", BadOps, "the request has {n} ops; this worker serves {limit} layers, each runs at "
                                          "most once per request")]

    def __post_init__(self) -> None:
        if type(self.batch) is not LayerOps:
            object.__setattr__(self, "batch", LayerOps.of(self.batch))


@message
class TensorMessage:
    """Worker → master: the hidden state after a Batch or SingleOp (`Message::Tensor`)."""

    tensor: RawTensor


@message
class Goodbye:
    """Master → worker: the chat request ended; clear the KV cache and answer WorkerInfo."""


@message
class LayerAssignment:
    """Master → worker, first frame of a setup connection: the layers to serve."""

    layers: Annotated[tuple[String, ...], Bound(MAX_ITEMS)]
    model_hash: String


@message
class LayerAssignmentAck:
    """Worker → master: whether the worker needs the model files pushed to it."""

    needs_data: Bool


@message(order=("filename", "offset", "total_size", "compressed", "checksum", "data"))
class ModelDataChunk:
    """Master → worker: one piece of a model file; `compressed`/`checksum` exist at V2 only."""

    filename: String
    offset: Usize
    total_size: Usize
    data: Bytes
    compressed: Annotated[Bool, Since(Revision.V2)] = False
    checksum: Annotated[U32, Since(Revision.V2)] = 0  # CRC-32 of `data` as sent (after zstd when compressed)


@message
class ModelDataDone:
    """Master → worker: every model file has been pushed."""


@message(since=Revision.V2)
class ModelDataResume:
    """Declared by Cake at V2 only and never sent by it; here so that V2 decodes completely."""

    filename: String
    offset: Usize


@message
class WorkerReady:
    """Worker → master: the setup is done; the worker closes the setup connection."""


@message
class WorkerError:
    """Worker → master: the request could not be served; the connection stays usable."""

    message: String


Message = Union[tuple(variant.cls for variant in VARIANTS)]  # noqa: UP007 (built from the declarations)

__all__ = ["Revision", "DType", "RawTensor", "LayerOp", "LayerOps", "Message", *(variant.cls.__name__ for variant in VARIANTS)]
