"""Speedy's BigEndian payload codec for the messages declared in `cakemp.wire.messages`.

The encoding is speedy 0.8.7's default for Cake's `#[derive(Readable, Writable)]` types
(docs/protocol.md, Encoding and Messages): enum tag u32, String = u32 length + UTF-8, Vec<T> = u32 count + elements,
usize = u64, u128 = 16 bytes, bool = 1 byte, every integer big-endian. Tensor element bytes
are the exception: they are the tensor's raw little-endian memory, passed through untouched.

Nothing here names a message. Each declared class is compiled once into a plan, a tree of
field codecs built from its annotations, and one writer and one reader walk that plan.

Decoding never copies tensor or model data: `RawTensor.data` and `ModelDataChunk.data` are
memoryviews into the payload given to `decode_payload`, so a prefill-size message costs the
same to decode as a decode-size one. Every count is checked against the bytes left before
anything is allocated for it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import MISSING, is_dataclass
from dataclasses import fields as dataclass_fields
from enum import IntEnum
from operator import attrgetter
from typing import Annotated, NamedTuple, get_args, get_origin, get_type_hints

from cakemp.errors import BadTensor, EncodeError, ProtocolError
from cakemp.wire.messages import MAX_ITEMS, VARIANTS, Bound, DType, Message, RawTensor, Revision, Since

Buffer = bytes | bytearray | memoryview

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")
_U64_MAX = 2**64 - 1
_RUNS_KEPT = 64  # the layouts of runs of integers an _Int keeps (a peer picks the counts)


class _Writer:
    """Collects a payload as buffers: small fields are packed together, bulk data is kept by
    reference so that a tensor's bytes are never copied on the way to the socket."""

    def __init__(self, reserve: int, revision: Revision) -> None:
        self.pieces: list[Buffer] = []
        self.head = bytearray(reserve)  # room for the frame header when encoding a frame
        self.revision = revision

    def bulk(self, data: bytes | memoryview) -> None:
        """Vec<u8>: the length, then `data` as its own piece (not copied)."""
        view = memoryview(data)
        self.head += _U32.pack(view.nbytes)
        self.pieces.append(self.head)
        self.pieces.append(view)
        self.head = bytearray()

    def finish(self) -> list[Buffer]:
        if self.head:
            self.pieces.append(self.head)
        return self.pieces


class _Reader:
    """Bounds-checked reads over a payload; every failure is a ProtocolError naming the field."""

    __slots__ = ("view", "pos", "end", "revision", "limits", "tensors")

    def __init__(self, payload: Buffer, revision: Revision, limits: dict[str, int]) -> None:
        self.view = memoryview(payload).cast("B")
        self.pos = 0
        self.end = self.view.nbytes
        self.revision = revision
        self.limits = limits
        self.tensors: list[tuple[str, RawTensor]] = []  # checked once the whole message has decoded

    def need(self, size: int, what: str) -> None:
        left = self.end - self.pos
        if size > left:
            raise ProtocolError(f"truncated payload: {what} needs {size} bytes at offset {self.pos}, only {left} left")

    def take(self, layout: struct.Struct, what: str) -> int:
        start = self.pos
        if start + layout.size > self.end:
            self.need(layout.size, what)
        self.pos = start + layout.size
        return layout.unpack_from(self.view, start)[0]

    def count(self, min_item_size: int, what: str) -> int:
        """A Vec's u32 count, rejected before anything is allocated for it when the rest of
        the payload cannot hold that many items of at least `min_item_size` bytes."""
        n = self.take(_U32, f"{what} count")
        left = self.end - self.pos
        if n * min_item_size > left:
            raise ProtocolError(
                f"{what} count {n} claims at least {n * min_item_size} bytes, only {left} left in the payload"
            )
        return n

    def bulk(self, what: str, length: str) -> memoryview:
        """Vec<u8> as a view into the payload (no copy); `length` names its length field."""
        start = self.pos + 4
        if start > self.end:
            self.need(4, length)
        size = _U32.unpack_from(self.view, self.pos)[0]
        end = self.pos = start + size
        if end > self.end:
            self.pos = start
            self.need(size, what)
        return self.view[start:end]


# --------------------------------------------------------------------------- field codecs
# Each is built for one place in one message (`path`, e.g. "Batch.x.shape"), so that errors
# name the field without composing text on the hot path.


class _Field:
    """How one declared field is written and read; `min_size` is the fewest bytes it takes."""

    min_size = 0

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, w: _Writer, value: object) -> None:
        raise NotImplementedError

    def read(self, r: _Reader) -> object:
        raise NotImplementedError

    def write_all(self, w: _Writer, values: tuple) -> None:
        """The elements of a Vec (its count is written already)."""
        for value in values:
            self.write(w, value)

    def read_all(self, r: _Reader, n: int) -> tuple:
        """`n` elements of a Vec (its count is read and checked already)."""
        read = self.read
        return tuple([read(r) for _ in range(n)])


class _Int(_Field):
    """An integer; with `known`, an IntEnum, a value it names is read as its member."""

    def __init__(self, path: str, code: str, known: type[IntEnum] | None = None) -> None:
        super().__init__(path)
        self.code = code
        self.layout = struct.Struct(">" + code)
        self.min_size = self.layout.size
        self.known = {member.value: member for member in known} if known else None
        self._runs: dict[int, struct.Struct] = {}  # `_many`'s

    def write(self, w: _Writer, value: int) -> None:
        w.head += self.layout.pack(value)

    def read(self, r: _Reader) -> int:
        # r.take's work, inline: an integer is most of what a message holds
        start = r.pos
        end = r.pos = start + self.min_size
        if end > r.end:
            r.pos = start
            r.need(self.min_size, self.path)
        value = self.layout.unpack_from(r.view, start)[0]
        return self.known.get(value, value) if self.known else value

    def write_all(self, w: _Writer, values: tuple) -> None:
        w.head += self._many(len(values)).pack(*values)

    def read_all(self, r: _Reader, n: int) -> tuple:
        values = self._many(n).unpack_from(r.view, r.pos)
        r.pos += n * self.min_size
        return values

    def _many(self, n: int) -> struct.Struct:
        """The layout of `n` of them (a shape's few dims, a short Vec: kept once made)."""
        layout = self._runs.get(n)
        if layout is None:
            layout = struct.Struct(f">{n}{self.code}")
            if len(self._runs) < _RUNS_KEPT:
                self._runs[n] = layout
        return layout


class _U128(_Field):
    min_size = 16

    def write(self, w: _Writer, value: int) -> None:
        w.head += value.to_bytes(16, "big")

    def read(self, r: _Reader) -> int:
        r.need(16, self.path)
        value = int.from_bytes(r.view[r.pos : r.pos + 16], "big")
        r.pos += 16
        return value


class _Bool(_Field):
    min_size = 1

    def write(self, w: _Writer, value: bool) -> None:
        w.head += b"\x01" if value else b"\x00"

    def read(self, r: _Reader) -> bool:
        return r.take(_U8, self.path) != 0  # speedy reads any non-zero byte as true


class _Bulk(_Field):
    """Vec<u8>: bulk data, written and read by reference."""

    min_size = 4

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.length = f"{path} length"

    def write(self, w: _Writer, value: bytes | memoryview) -> None:
        w.bulk(value)

    def read(self, r: _Reader) -> memoryview:
        return r.bulk(self.path, self.length)


class _String(_Bulk):
    """String: UTF-8 bytes, as a Vec<u8>."""

    def write(self, w: _Writer, value: str) -> None:
        raw = value.encode("utf-8")
        w.head += _U32.pack(len(raw))
        w.head += raw

    def read(self, r: _Reader) -> str:
        raw = r.bulk(self.path, self.length)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"invalid UTF-8 in {self.path}: {exc.reason} at byte {exc.start}") from None


class _Vec(_Field):
    """Vec<T>, as a tuple; a bounded one refuses a count past its bound before reading an item."""

    min_size = 4

    def __init__(self, path: str, item: _Field, bound: Bound | None = None) -> None:
        super().__init__(path)
        self.item = item
        self.bound = bound

    def write(self, w: _Writer, value: tuple) -> None:
        w.head += _U32.pack(len(value))
        self.item.write_all(w, value)

    def read(self, r: _Reader) -> tuple:
        n = r.count(self.item.min_size, self.path)
        if self.bound is not None:
            limit = self.bound.limit if isinstance(self.bound.limit, int) else r.limits.get(self.bound.limit, MAX_ITEMS)
            if n > limit:
                raise self.bound.refusal(self.path, n, limit)
        return self.item.read_all(r, n)



class _Struct(_Field):
    """A declared class: its fields in wire order, each skipped below the revision of its `Since`."""

    def __init__(self, cls: type, path: str, order: tuple[str, ...] | None = None) -> None:
        super().__init__(path)
        self.cls = cls
        hints = get_type_hints(cls, include_extras=True)  # in the order of the class's fields
        names = order or tuple(hints)
        if sorted(names) != sorted(hints):
            raise TypeError(f"{cls.__name__}: the wire order {names} must name each field once")
        fields = [(name, _compile(hints[name], f"{path}.{name}"), _since(hints[name])) for name in names]
        self.min_size = sum(field.min_size for _, field, since in fields if since == Revision.V1)
        self.layouts = {revision: _Layout.of(cls, tuple(hints), fields, revision) for revision in Revision}

    def write(self, w: _Writer, value: object) -> None:
        layout = self.layouts[w.revision]
        if layout.absent and any(getattr(value, name) != default for name, default in layout.absent):
            raise EncodeError(f"{self.cls.__name__} has no {'/'.join(name for name, _ in layout.absent)} "
                              f"fields at protocol revision {w.revision.value}")
        for write, item in zip(layout.writes, layout.values(value)):
            write(w, item)

    def read(self, r: _Reader) -> object:
        layout = self.layouts[r.revision]
        return layout.build(*[read(r) for read in layout.reads])


class _Layout(NamedTuple):
    """A struct's wire form at one revision: to write one, its fields' writers there, how to get
    their values from an instance, and the fields absent there with their defaults; to read one,
    its fields' readers there and how to build an instance from their values."""

    writes: tuple[Callable[[_Writer, object], None], ...]
    values: Callable[[object], tuple]
    absent: tuple[tuple[str, object], ...]
    reads: tuple[Callable[[_Reader], object], ...]
    build: Callable[..., object]

    @classmethod
    def of(cls, struct_cls: type, init_order: tuple[str, ...], fields: list, revision: Revision) -> _Layout:
        names = tuple(name for name, _, since in fields if since <= revision)
        getter = attrgetter(*names) if names else lambda value: ()
        values = getter if len(names) != 1 else lambda value: (getter(value),)
        # By position where the fields on the wire are the class's leading fields in order (the
        # usual case, and the fast one); else by name.
        build = struct_cls if names == init_order[: len(names)] else (
            lambda *items: struct_cls(**dict(zip(names, items))))
        defaults = {f.name: f.default for f in dataclass_fields(struct_cls)} if is_dataclass(struct_cls) else {}
        absent = tuple((name, defaults.get(name, MISSING)) for name, _, since in fields if since > revision)
        present = [field for _, field, since in fields if since <= revision]
        return cls(tuple(field.write for field in present), values, absent, tuple(field.read for field in present), build)


class _Tensor(_Struct):
    """A RawTensor. Its contents are checked only once the whole message has decoded, so that a
    structurally broken frame is always a ProtocolError (close the connection) and BadTensor
    always means "sound frame, unusable tensor" (answer WorkerError)."""

    def read(self, r: _Reader) -> RawTensor:
        tensor = super().read(r)
        r.tensors.append((self.path, tensor))
        return tensor


_INTEGERS = {"u8": "B", "u32": "I", "usize": "Q"}
_OTHERS = {"u128": _U128, "bool": _Bool, "String": _String, "Vec<u8>": _Bulk}


def _compile(hint: object, path: str) -> _Field:
    """The codec of a field annotated `hint`: a Rust type by name, a tuple as a Vec, a class as a struct."""
    if get_origin(hint) is Annotated:
        inner, *marks = get_args(hint)
        bound = next((mark for mark in marks if isinstance(mark, Bound)), None)
        if bound is not None:  # a bounded Vec
            vec = _compile(inner, path)
            vec.bound = bound
            return vec
        rust_type = next(mark for mark in marks if isinstance(mark, str))
        if rust_type in _INTEGERS:
            known = next((mark for mark in marks if isinstance(mark, type) and issubclass(mark, IntEnum)), None)
            return _Int(path, _INTEGERS[rust_type], known)
        return _OTHERS[rust_type](path)
    if get_origin(hint) is tuple:
        item, _ = get_args(hint)  # tuple[T, ...]
        return _Vec(path, _compile(item, path))
    if hint is RawTensor:
        return _Tensor(hint, path)
    return _Struct(hint, path)


def _since(hint: object) -> Revision:
    marks = get_args(hint)[1:] if get_origin(hint) is Annotated else ()
    return next((mark.revision for mark in marks if isinstance(mark, Since)), Revision.V1)


def _check_tensor(t: RawTensor, what: str) -> None:
    """BadTensor when the tensor's tag is unknown or its byte count does not match its shape."""
    if not isinstance(t.dtype, DType):
        raise BadTensor(f"{what} has unknown dtype tag {t.dtype}")
    elements = 1
    for dim in t.shape:
        elements *= dim
        if elements > _U64_MAX:  # a usize product in Cake: checked multiplication fails here
            raise BadTensor(f"{what} shape {list(t.shape)} overflows the element count")
    expected = elements * t.dtype.itemsize
    if t.data.nbytes != expected:
        raise BadTensor(f"{what} data is {t.data.nbytes} bytes, shape {list(t.shape)} of {t.dtype.name} needs {expected}")


_PLANS = {variant.cls: _Struct(variant.cls, variant.cls.__name__, variant.order) for variant in VARIANTS}
_TAGS: dict[Revision, dict[type, int]] = {}
_BY_TAG: dict[Revision, tuple[_Struct, ...]] = {}
for _revision in Revision:
    _present = [variant.cls for variant in VARIANTS if variant.since <= _revision]
    _TAGS[_revision] = {cls: tag for tag, cls in enumerate(_present)}
    _BY_TAG[_revision] = tuple(_PLANS[cls] for cls in _present)


def _revision(revision: Revision | int) -> Revision:
    """`revision` as the enum (an enum's own call costs a message's decode a tenth of its time)."""
    return revision if type(revision) is Revision else Revision(revision)


def encode_buffers(msg: Message, revision: Revision, reserve: int) -> list[Buffer]:
    """`msg` as buffers, the first a bytearray starting with `reserve` spare bytes (room for
    the frame header); used by `encode_payload` and `frames.encode_frame`. Raises EncodeError."""
    revision = _revision(revision)
    tag = _TAGS[revision].get(type(msg))
    if tag is None:
        raise EncodeError(f"{type(msg).__name__} does not exist at protocol revision {revision.value}")
    w = _Writer(reserve, revision)
    w.head += _U32.pack(tag)
    try:
        _PLANS[type(msg)].write(w, msg)
    except (struct.error, OverflowError, UnicodeEncodeError) as exc:
        # A negative or oversized integer, or a str with lone surrogates: not representable.
        raise EncodeError(f"cannot encode {type(msg).__name__}: {exc}") from None
    return w.finish()


def encode_payload(msg: Message, revision: Revision) -> bytes:
    """The speedy BigEndian payload of `msg` (no frame header)."""
    return b"".join(encode_buffers(msg, revision, 0))


def decode_payload(payload: Buffer, revision: Revision, limits: dict[str, int] | None = None) -> Message:
    """Decode one speedy BigEndian payload; raises ProtocolError, BadTensor or BadOps, all PeerFaults.

    `limits` bounds the Vecs whose `Bound` names one ("ops": the layers a node serves); a count
    past its bound is refused before any of its items is built.

    Like speedy's `read_from_buffer` (docs/protocol.md, Encoding), bytes after the message are ignored: Cake
    accepts them, and being as liberal as Cake keeps cakemp a drop-in for any master that
    Cake itself accepts.

    A tensor with an unknown dtype tag or a byte count that does not match its shape raises
    BadTensor: the frame itself was sound, and Cake's worker answers such a request with
    WorkerError and keeps the connection, so callers may do the same.
    """
    r = _Reader(payload, _revision(revision), limits or {})
    tag = r.take(_U32, "message tag")
    plans = _BY_TAG[r.revision]
    if tag >= len(plans):
        raise ProtocolError(f"unknown message tag {tag} at protocol revision {r.revision.value}")
    msg = plans[tag].read(r)
    for what, tensor in r.tensors:
        _check_tensor(tensor, what)
    return msg
