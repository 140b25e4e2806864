"""Speedy's BigEndian payload codec for the messages declared in `cakemp.wire.messages`.

The encoding is speedy 0.8.7's default for Cake's `#[derive(Readable, Writable)]` types
(docs/protocol.md, Encoding and Messages): enum tag u32, String = u32 length + UTF-8, Vec<T> = u32 count + elements,
usize = u64, u128 = 16 bytes, bool = 1 byte, every integer big-endian. Tensor element bytes
are the exception: they are the tensor's raw little-endian memory, passed through untouched.

Nothing here names a message. Each declared class is compiled once into a plan, a tree of
field codecs built from its annotations, and the plan at import into two Python functions per
message and revision, a writer and a reader, each field's packing (or reads and checks) written
out in them in wire order (`_Source`). A message is then one function call, not several per field:
a decode step's Batch decodes in about half the time the walk over the plan took. A Vec marked
`Columns` (a Batch's layer ops, one a layer: a name and integers each) is read into a tuple a field,
in one struct call where a layout learnt from an earlier Vec of as many items reads back its lengths
and names (`_Seen`).

Decoding never copies tensor or model data: `RawTensor.data` and `ModelDataChunk.data` are
memoryviews into the payload given to `decode_payload`, so a prefill-size message costs the
same to decode as a decode-size one. Every count is checked against the bytes left before
anything is allocated for it.
"""

from __future__ import annotations

import linecache
import struct
from collections.abc import Callable
from dataclasses import MISSING, is_dataclass
from dataclasses import fields as dataclass_fields
from enum import IntEnum
from typing import Annotated, NamedTuple, get_args, get_origin, get_type_hints

from cakemp.errors import BadTensor, EncodeError, ProtocolError
from cakemp.wire.messages import MAX_ITEMS, VARIANTS, Bound, Columns, DType, Message, RawTensor, Revision, Since

Buffer = bytes | bytearray | memoryview

_BIG_ENDIAN = ">"  # speedy's BigEndian: every integer on the wire


def _layout(codes: str) -> struct.Struct:
    """Integers of struct `codes`, big-endian, no padding."""
    return struct.Struct(_BIG_ENDIAN + codes)


_U32 = _layout("I")
_U64_MAX = 2**64 - 1
_RUNS_KEPT = 64  # the layouts of runs of integers an _Int keeps (a peer picks the counts)


class _Source:
    """A writer or reader function being written: its lines, and the objects they name.

    A writer's locals: `head` (a bytearray collecting the small fields) and `pieces` (the payload's
    buffers so far: bulk data is a piece of its own, by reference, so a tensor's bytes are never
    copied on the way to the socket). A reader's: `view` (the payload, bytes), `pos` (the next byte
    to read), `end` (the payload's size), `limits` (the decoder's bounds on counts) and `tensors`
    (each tensor read, with its path, checked once the whole message has decoded). Each field's
    value is in a local of its own (`value`)."""

    def __init__(self, revision: Revision) -> None:
        self.revision = revision
        self.lines: list[str] = []
        self.depth = 1
        self.scope: dict[str, object] = {}
        self._values = 0

    def const(self, value: object) -> str:
        """A name for `value` in the function's scope."""
        name = f"k{len(self.scope)}"
        self.scope[name] = value
        return name

    def value(self) -> str:
        self._values += 1
        return f"v{self._values}"

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def loop(self, items: str) -> str:
        """Open a loop over `items` (its body: the lines written until `end_loop`); its item's local."""
        item = self.value()
        self.line(f"for {item} in {items}:")
        self.depth += 1
        return item

    def end_loop(self) -> None:
        self.depth -= 1

    def need(self, size: int | str, what: str) -> None:
        """Check that `size` (a number, or a local's name) more bytes are left for `what`."""
        self.line(f"if pos + {size} > end: {self.const(_truncated)}({self.const(what)}, {size}, pos, end)")

    def function(self, name: str, arguments: str, first: str, result: str) -> Callable:
        """The function of the lines written, of `arguments`, starting with the line `first` and
        returning the local `result`."""
        body = "\n".join([f"def {name}({arguments}):", f"    {first}", *self.lines, f"    return {result}", ""])
        filename = f"<cakemp.wire.codec: {name}>"
        linecache.cache[filename] = (len(body), None, body.splitlines(True), filename)  # tracebacks show its lines
        exec(compile(body, filename, "exec"), self.scope)  # made of the declarations alone, never of a peer's bytes
        return self.scope[name]


def _truncated(what: str, size: int, pos: int, end: int) -> None:
    raise ProtocolError(f"truncated payload: {what} needs {size} bytes at offset {pos}, only {end - pos} left")


def _cut(fields: tuple[tuple[str, int], ...], pos: int, end: int) -> None:
    """Raise `_truncated` for the first of `fields` (path, size), read from `pos` on, that the payload cuts."""
    for what, size in fields:
        if pos + size > end:
            _truncated(what, size, pos, end)
        pos += size


def _overclaimed(what: str, n: int, size: int, left: int) -> None:
    raise ProtocolError(f"{what} count {n} claims at least {size} bytes, only {left} left in the payload")


def _not_utf8(exc: UnicodeDecodeError, what: str) -> None:
    raise ProtocolError(f"invalid UTF-8 in {what}: {exc.reason} at byte {exc.start}") from None


# --------------------------------------------------------------------------- field codecs
# Each is built for one place in one message (`path`, e.g. "Batch.x.shape"), so that errors
# name the field without composing text on the hot path.


class _Field:
    """How one declared field is written and read: `write` and `read` write its packing and its
    reads into a writer's and a reader's function. `min_size` is the fewest bytes it takes."""

    min_size = 0

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, code: _Source, value: str) -> None:
        """Write the packing of the local `value` into `code`."""
        raise NotImplementedError

    def read(self, code: _Source) -> str:
        """Write the reads of one value into `code`; the local that holds it."""
        raise NotImplementedError

    def write_all(self, code: _Source, values: str) -> None:
        """The elements of a Vec, the local `values` (its count is written already)."""
        self.write(code, code.loop(values))
        code.end_loop()

    def read_all(self, code: _Source, n: str) -> str:
        """Write the reads of a Vec's `n` (a local: its count, read and checked) elements; the local
        that holds them, as a tuple."""
        items = code.value()
        code.line(f"{items} = []")
        code.loop(f"range({n})")
        code.line(f"{items}.append({self.read(code)})")
        code.end_loop()
        code.line(f"{items} = tuple({items})")
        return items


class _Int(_Field):
    """An integer; with `known`, an IntEnum, a value it names is read as its member."""

    def __init__(self, path: str, code: str, known: type[IntEnum] | None = None) -> None:
        super().__init__(path)
        self.code = code
        self.layout = _layout(code)
        self.min_size = self.layout.size
        self.known = {member.value: member for member in known} if known else None
        self._runs: dict[int, struct.Struct] = {}  # `_many`'s

    def write(self, code: _Source, value: str) -> None:
        code.line(f"head += {code.const(self.layout.pack)}({value})")

    def read(self, code: _Source) -> str:
        value = code.value()
        code.need(self.min_size, self.path)
        code.line(f"{value} = {code.const(self.layout.unpack_from)}(view, pos)[0]")
        code.line(f"pos += {self.min_size}")
        if self.known:
            code.line(f"{value} = {code.const(self.known)}.get({value}, {value})")
        return value

    @staticmethod
    def write_run(code: _Source, run: list[_Int], values: list[str]) -> None:
        """Write the packing of consecutive integer fields `run`, the locals `values`, in one struct call."""
        code.line(f"head += {code.const(_layout(''.join(field.code for field in run)).pack)}({', '.join(values)})")

    @staticmethod
    def read_run(code: _Source, run: list[_Int]) -> list[str]:
        """Write the reads of consecutive integer fields `run`, in one struct call; their locals."""
        layout = _layout("".join(field.code for field in run))
        values = [code.value() for _ in run]
        cuts = tuple((field.path, field.min_size) for field in run)  # which of them a short payload cuts
        code.line(f"if pos + {layout.size} > end: {code.const(_cut)}({code.const(cuts)}, pos, end)")
        code.line(f"{', '.join(values)} = {code.const(layout.unpack_from)}(view, pos)")
        code.line(f"pos += {layout.size}")
        for field, value in zip(run, values):
            if field.known:
                code.line(f"{value} = {code.const(field.known)}.get({value}, {value})")
        return values

    def write_all(self, code: _Source, values: str) -> None:
        code.line(f"head += {code.const(self._many)}(len({values})).pack(*{values})")

    def read_all(self, code: _Source, n: str) -> str:
        values = code.value()  # in one struct call (the count's check left room for them all)
        code.line(f"{values} = {code.const(self._many)}({n}).unpack_from(view, pos)")
        code.line(f"pos += {n} * {self.min_size}")
        return values

    def _many(self, n: int) -> struct.Struct:
        """The layout of `n` of them (a shape's few dims, a short Vec: kept once made)."""
        layout = self._runs.get(n)
        if layout is None:
            layout = _layout(f"{n}{self.code}")
            if len(self._runs) < _RUNS_KEPT:
                self._runs[n] = layout
        return layout


class _U128(_Field):
    min_size = 16

    def write(self, code: _Source, value: str) -> None:
        code.line(f'head += {value}.to_bytes(16, "big")')

    def read(self, code: _Source) -> str:
        value = code.value()
        code.need(16, self.path)
        code.line(f'{value} = int.from_bytes(view[pos : pos + 16], "big")')
        code.line("pos += 16")
        return value


class _Bool(_Field):
    min_size = 1

    def write(self, code: _Source, value: str) -> None:
        code.line(f'head += b"\\x01" if {value} else b"\\x00"')

    def read(self, code: _Source) -> str:
        value = code.value()
        code.need(1, self.path)
        code.line(f"{value} = view[pos] != 0")  # speedy reads any non-zero byte as true
        code.line("pos += 1")
        return value


class _Bulk(_Field):
    """Vec<u8>: bulk data, written and read by reference (read: a view of the payload)."""

    min_size = 4

    def write(self, code: _Source, value: str) -> None:
        view = code.value()  # the length, then the data as a piece of its own (not copied)
        code.line(f"{view} = memoryview({value})")
        code.line(f"head += {code.const(_U32.pack)}({view}.nbytes)")
        code.line("pieces.append(head)")
        code.line(f"pieces.append({view})")
        code.line("head = bytearray()")

    def read(self, code: _Source) -> str:
        size, value = code.value(), code.value()
        code.need(4, f"{self.path} length")
        code.line(f"{size} = {code.const(_U32.unpack_from)}(view, pos)[0]")
        code.line("pos += 4")
        code.need(size, self.path)
        code.line(f"{value} = view[pos : pos + {size}]")
        code.line(f"pos += {size}")
        return value


class _String(_Bulk):
    """String: UTF-8 bytes, as a Vec<u8>."""

    def write(self, code: _Source, value: str) -> None:
        raw = code.value()
        code.line(f'{raw} = {value}.encode("utf-8")')
        code.line(f"head += {code.const(_U32.pack)}(len({raw}))")
        code.line(f"head += {raw}")

    def read(self, code: _Source) -> str:
        value = super().read(code)
        code.line("try:")
        code.line(f'    {value} = str({value}, "utf-8")')
        code.line("except UnicodeDecodeError as exc:")
        code.line(f"    {code.const(_not_utf8)}(exc, {code.const(self.path)})")
        return value


class _Vec(_Field):
    """Vec<T>, as a tuple; a bounded one refuses a count past its bound before reading an item."""

    min_size = 4

    def __init__(self, path: str, item: _Field, bound: Bound | None = None) -> None:
        super().__init__(path)
        self.item = item
        self.bound = bound

    def write(self, code: _Source, value: str) -> None:
        code.line(f"head += {code.const(_U32.pack)}(len({value}))")
        self.item.write_all(code, value)

    def read(self, code: _Source) -> str:
        n = code.value()
        code.need(4, f"{self.path} count")
        code.line(f"{n} = {code.const(_U32.unpack_from)}(view, pos)[0]")
        code.line("pos += 4")
        # Refused before anything is allocated for it when the rest of the payload cannot hold that many.
        size = self.item.min_size
        code.line(f"if {n} * {size} > end - pos: "
                  f"{code.const(_overclaimed)}({code.const(self.path)}, {n}, {n} * {size}, end - pos)")
        if self.bound is not None:
            limit = self.bound.limit
            limit = str(limit) if isinstance(limit, int) else f"limits.get({code.const(limit)}, {MAX_ITEMS})"
            code.line(f"if {n} > {limit}: raise {code.const(self.bound.refusal)}({code.const(self.path)}, {n}, {limit})")
        return self.item.read_all(code, n)


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
        self.columns: type | None = None  # what a Vec of these is read into, a tuple a field (`Columns`)

    def write(self, code: _Source, value: str) -> None:
        layout = self.layouts[code.revision]
        if layout.absent:  # fields this revision has not: only their defaults can be written
            changed = " or ".join(f"{value}.{name} != {code.const(default)}" for name, default in layout.absent)
            refusal = (f"{self.cls.__name__} has no {'/'.join(name for name, _ in layout.absent)} "
                       f"fields at protocol revision {code.revision.value}")
            code.line(f"if {changed}: raise {code.const(EncodeError)}({code.const(refusal)})")
        values = [code.value() for _ in layout.present]
        for name, field_value in zip(layout.names, values):
            code.line(f"{field_value} = {value}.{name}")
        self._write_values(code, layout, values)

    def write_all(self, code: _Source, values: str) -> None:
        if self.columns is None:
            return super().write_all(code, values)
        # Held as columns (`Columns`): each item's fields taken from them as they are, no object an item.
        layout = self._columns_layout(code.revision)
        items = [code.value() for _ in layout.present]
        code.line(f"for {', '.join(items)} in zip(*{values}.columns):")
        code.depth += 1
        self._write_values(code, layout, items)
        code.end_loop()

    def _columns_layout(self, revision: Revision) -> _Layout:
        """The layout of items read and written as columns: a name, then integers, every field at `revision`."""
        layout = self.layouts[revision]
        fields = layout.present
        if layout.absent or not (fields and type(fields[0]) is _String and
                                 all(type(f) is _Int and not f.known for f in fields[1:])):
            raise TypeError(f"{self.path}: only a Vec of a name and integers is held as columns")
        return layout

    @staticmethod
    def _write_values(code: _Source, layout: _Layout, values: list[str]) -> None:
        """The packing of a struct's fields present at this revision, each in its local of `values`."""
        at = 0
        for run in _int_runs(layout.present):
            run_values, at = values[at : at + len(run)], at + len(run)
            if len(run) > 1:
                _Int.write_run(code, run, run_values)
            else:
                run[0].write(code, run_values[0])

    def read(self, code: _Source) -> str:
        layout = self.layouts[code.revision]
        values = []
        for run in _int_runs(layout.present):
            values += _Int.read_run(code, run) if len(run) > 1 else [run[0].read(code)]
        value = code.value()
        if layout.build is self.cls and issubclass(self.cls, tuple):  # a NamedTuple (a LayerOp: one per layer)
            # made by tuple's own constructor, which runs no Python (its class's __new__ does)
            code.line(f"{value} = {code.const(tuple.__new__)}({code.const(self.cls)}, ({', '.join(values)},))")
        else:
            code.line(f"{value} = {code.const(layout.build)}({', '.join(values)})")
        return value

    def read_all(self, code: _Source, n: str) -> str:
        if self.columns is None:
            return super().read_all(code, n)
        fields = self._columns_layout(code.revision).present
        # At once where a layout seen lately fits the items, else item by item (then learnt).
        seen, found, items = _Seen(self.columns, "".join(f.code for f in fields[1:])), code.value(), code.value()
        code.line(f"{found} = {code.const(seen.read)}(view, pos, end, {n})")
        code.line(f"if {found} is None:")
        code.depth += 1
        code.line(f"{items} = {code.const(self.columns.of)}({super().read_all(code, n)})")
        code.line(f"{code.const(seen.learn)}({items})")
        code.depth -= 1
        code.line("else:")
        code.line(f"    {items}, pos = {found}")
        return items


class _Seen:
    """The wire layouts of a Vec read as columns (`Columns`: a Batch's layer ops, a name and integers
    an item) read lately, up to _LAYOUTS_KEPT of each count, with their names. A master sends one run
    of layers step after step: with its names known, the whole Vec is read in one struct call
    (`read`), not in a few lines of Python an item, and its names are the tuple read before. A layout
    is only a guess until the lengths and names it reads are those it was learnt from: then they are
    the bytes the item-by-item read takes, and its values the same."""

    def __init__(self, columns: type, codes: str) -> None:
        self._columns, self._codes = columns, codes
        self._width = 2 + len(codes)  # a name's length and bytes, then the integers
        # By count: each layout, its names' lengths, their bytes and the names.
        self._layouts: dict[int, list[tuple[struct.Struct, tuple[int, ...], tuple[bytes, ...], tuple[str, ...]]]] = {}

    def read(self, view: memoryview, pos: int, end: int, n: int) -> tuple[object, int] | None:
        """The `n` items at `pos`, as columns, and the position after them; None where no layout kept reads them."""
        width = self._width
        for layout, lengths, raw, names in self._layouts.get(n, ()):
            if pos + layout.size > end:
                continue
            values = layout.unpack_from(view, pos)
            if values[0::width] == lengths and values[1::width] == raw:
                return self._columns(names, *(values[i::width] for i in range(2, width))), pos + layout.size
        return None

    def learn(self, items) -> None:
        """Keep the layout of `items` (columns), just read one by one (the oldest of their count's goes)."""
        n = len(items)
        if not 0 < n <= _LAYOUT_ITEMS or (n not in self._layouts and len(self._layouts) >= _RUNS_KEPT):
            return
        names = items.layers
        raw = tuple(name.encode() for name in names)
        lengths = tuple(map(len, raw))
        kept = self._layouts.setdefault(n, [])
        kept.insert(0, (_layout("".join(f"I{length}s{self._codes}" for length in lengths)), lengths, raw, names))
        del kept[_LAYOUTS_KEPT:]


_LAYOUTS_KEPT = 4  # layouts _Seen keeps of each count (a node's masters send a few runs)
_LAYOUT_ITEMS = 256  # the most items of a layout _Seen keeps (32 KiB a layout; Llama 3 405B has 126 layers)


def _int_runs(fields: tuple[_Field, ...]) -> list[list[_Field]]:
    """`fields` cut into runs, in order: consecutive integers together (read and written in one struct
    call), any other field alone."""
    runs: list[list[_Field]] = []
    for field in fields:
        if runs and type(field) is _Int and type(runs[-1][-1]) is _Int:
            runs[-1].append(field)
        else:
            runs.append([field])
    return runs


class _Layout(NamedTuple):
    """A struct's wire form at one revision: its fields there and their names, the fields absent
    there with their defaults, and how to build an instance from the values of those present."""

    names: tuple[str, ...]
    present: tuple[_Field, ...]
    absent: tuple[tuple[str, object], ...]
    build: Callable[..., object]

    @classmethod
    def of(cls, struct_cls: type, init_order: tuple[str, ...], fields: list, revision: Revision) -> _Layout:
        names = tuple(name for name, _, since in fields if since <= revision)
        # By position where the fields on the wire are the class's leading fields in order (the
        # usual case, and the fast one); else by name.
        build = struct_cls if names == init_order[: len(names)] else (
            lambda *items: struct_cls(**dict(zip(names, items))))
        defaults = {f.name: f.default for f in dataclass_fields(struct_cls)} if is_dataclass(struct_cls) else {}
        absent = tuple((name, defaults.get(name, MISSING)) for name, _, since in fields if since > revision)
        return cls(names, tuple(field for _, field, since in fields if since <= revision), absent, build)


class _Tensor(_Struct):
    """A RawTensor. Its contents are checked only once the whole message has decoded, so that a
    structurally broken frame is always a ProtocolError (close the connection) and BadTensor
    always means "sound frame, unusable tensor" (answer WorkerError)."""

    def read(self, code: _Source) -> str:
        tensor = super().read(code)
        code.line(f"tensors.append(({code.const(self.path)}, {tensor}))")
        return tensor


_INTEGERS = {"u8": "B", "u32": "I", "usize": "Q"}
_OTHERS = {"u128": _U128, "bool": _Bool, "String": _String, "Vec<u8>": _Bulk}


def _compile(hint: object, path: str) -> _Field:
    """The codec of a field annotated `hint`: a Rust type by name, a tuple as a Vec, a class as a struct."""
    if get_origin(hint) is Annotated:
        inner, *marks = get_args(hint)
        bound = next((mark for mark in marks if isinstance(mark, Bound)), None)
        columns = next((mark for mark in marks if isinstance(mark, Columns)), None)
        if bound is not None or columns is not None:  # a bounded Vec, or one read as columns
            vec = _compile(inner, path)
            vec.bound = bound
            if columns is not None:
                vec.item.columns = columns.cls
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


Writer = Callable[[Message, bytearray, list], bytearray]
Reader = Callable[[memoryview, int, dict[str, int], list], Message]


def _writer(plan: _Struct, tag: int, revision: Revision) -> Writer:
    """The function that writes a message of `plan` at `revision`: (msg, head: a bytearray of the
    room reserved before the payload, pieces: []) -> the last piece's bytes, its tag first."""
    code = _Source(revision)
    plan.write(code, "msg")
    return code.function(f"write_{plan.cls.__name__}_v{revision.value}", "msg, head, pieces",
                         f"head += {code.const(_U32.pack(tag))}", "head")


def _reader(plan: _Struct, revision: Revision) -> Reader:
    """The function that reads a payload of `plan`'s message at `revision`: (view, end, limits,
    tensors) -> the message, its tag (4 bytes) already read."""
    code = _Source(revision)
    message = plan.read(code)
    return code.function(f"read_{plan.cls.__name__}_v{revision.value}", "view, end, limits, tensors", "pos = 4", message)


_WRITERS: dict[Revision, dict[type, Writer]] = {}
_READERS: dict[Revision, tuple[Reader, ...]] = {}
for _revision_ in Revision:
    _plans = [_Struct(variant.cls, variant.cls.__name__, variant.order) for variant in VARIANTS
              if variant.since <= _revision_]
    _WRITERS[_revision_] = {plan.cls: _writer(plan, tag, _revision_) for tag, plan in enumerate(_plans)}
    _READERS[_revision_] = tuple(_reader(plan, _revision_) for plan in _plans)


def _revision(revision: Revision | int) -> Revision:
    """`revision` as the enum (an enum's own call costs a message's decode a tenth of its time)."""
    return revision if type(revision) is Revision else Revision(revision)


def encode_buffers(msg: Message, revision: Revision, reserve: int) -> list[Buffer]:
    """`msg` as buffers, the first a bytearray starting with `reserve` spare bytes (room for
    the frame header); used by `encode_payload` and `frames.encode_frame`. Raises EncodeError."""
    revision = _revision(revision)
    write = _WRITERS[revision].get(type(msg))
    if write is None:
        raise EncodeError(f"{type(msg).__name__} does not exist at protocol revision {revision.value}")
    pieces: list[Buffer] = []
    try:
        head = write(msg, bytearray(reserve), pieces)
    except (struct.error, OverflowError, UnicodeEncodeError) as exc:
        # A negative or oversized integer, or a str with lone surrogates: not representable.
        raise EncodeError(f"cannot encode {type(msg).__name__}: {exc}") from None
    if head:
        pieces.append(head)
    return pieces


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
    revision = _revision(revision)
    view = memoryview(payload).cast("B")
    end = view.nbytes
    if end < 4:
        _truncated("message tag", 4, 0, end)
    tag = _U32.unpack_from(view)[0]
    readers = _READERS[revision]
    if tag >= len(readers):
        raise ProtocolError(f"unknown message tag {tag} at protocol revision {revision.value}")
    tensors: list[tuple[str, RawTensor]] = []
    msg = readers[tag](view, end, limits or {}, tensors)
    for what, tensor in tensors:
        _check_tensor(tensor, what)
    return msg
