"""The multipart frame codec of the ipc messages declared in `cakemp.ipc.message` (no I/O).

A message is one header frame, then one frame per `Body` or `Text` field, in declaration
order. The header frame is the kind (u8), then every integer field packed in declaration order
(little-endian, no padding), then every tuple field in declaration order: a u32 count and its
items. A tuple's items are laid out field by field, not item by item: every item's integers, item
after item, then for each tuple field of theirs every item's u32 count and all their items (laid
out the same way). A step's hundreds of hops then cost one struct call per field, not several
Python calls per hop. Nothing here names a message: each declared class is compiled once into a
layout from its annotations.

Decoding keeps body frames as given (no copy) and checks every count against the header bytes
left before anything is allocated for it. Only cakemp writes these frames, so one that does
not decode is cakemp's own fault: BadIpcMessage, a NodeFault.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from enum import IntEnum
from functools import partial
from operator import attrgetter, itemgetter
from typing import Annotated, get_args, get_origin, get_type_hints

from cakemp.errors import BadIpcMessage, BadTensor
from cakemp.ipc.message import MESSAGES, Buffer, Message

_KIND = struct.Struct("<B")
_COUNT = struct.Struct("<I")
_FRAMES = ("body", "text")  # the marks of fields that travel as frames of their own
# The layouts of runs of integers an _Integers keeps, by count: a step's sessions (up to --max-batch),
# a route's stages, a shape's dims recur; compiling a 32-hop step's layout costs more than its packing.
_RUNS_KEPT = 256


class _Header:
    """A header frame being read (`at`: where); every count is checked against the bytes left first."""

    def __init__(self, frame: Buffer) -> None:
        self.frame = frame
        self.size = memoryview(frame).nbytes
        self.at = 0

    def take(self, layout: struct.Struct) -> tuple:
        values = layout.unpack_from(self.frame, self.at)
        self.at += layout.size
        return values


class _Integers:
    """Runs of integers laid out by `code` (one mark: a tuple of integers; several: each item's integer
    fields, a `_Layout`'s), packed and unpacked `n` runs at a time in one struct call."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.min_size = struct.calcsize("<" + code)  # the bytes of one run
        self._structs: dict[int, struct.Struct] = {}  # by count: a shape's 3 dims, a route's 1 stage's kv...

    def many(self, n: int) -> struct.Struct:
        layout = self._structs.get(n)
        if layout is None:
            # One mark takes a count ("<96Q"): a long run is then compiled as fast as a short one.
            layout = struct.Struct(f"<{n}{self.code}" if len(self.code) == 1 else "<" + self.code * n)
            if len(self._structs) < _RUNS_KEPT:  # the counts that recur: a step's sessions, a route's stages
                self._structs[n] = layout
        return layout

    def write_all(self, head: bytearray, items: tuple) -> None:
        head += self.many(len(items)).pack(*items)

    def read_all(self, header: _Header, n: int) -> tuple:
        values = self.many(n).unpack_from(header.frame, header.at)
        header.at += n * self.min_size
        return values


_COUNTS = _Integers("I")  # the counts of a tuple field, one per item of a tuple of items


class _Layout:
    """A declared class compiled: its integers as one struct, then its tuples, then its frames."""

    def __init__(self, cls: type) -> None:
        hints = get_type_hints(cls, include_extras=True)  # in the order of the class's fields
        marks = {name: _mark(hint) for name, hint in hints.items() if _mark(hint) is not None}
        integers = [name for name, mark in marks.items() if mark not in _FRAMES]
        self.fixed = struct.Struct("<" + "".join(marks[name] for name in integers))
        self.integers = _getter(integers)
        self.width = len(integers)
        self._runs = _Integers(self.fixed.format[1:])  # the integers of several items, one after another
        # Integer fields typed by an IntEnum (an ErrorCode) are read as its members.
        self.enums = [(index, get_args(hints[name])[0]) for index, name in enumerate(integers)
                      if get_args(hints[name]) and issubclass(get_args(hints[name])[0], IntEnum)]
        self.tuples = [(name, _item(hint)) for name, hint in hints.items() if get_origin(hint) is tuple]
        self.tuple_fields = [(list(hints).index(name), item) for name, item in self.tuples]  # by position (items)
        self.frames = [(name, mark) for name, mark in marks.items() if mark in _FRAMES]
        self.min_size = self.fixed.size + _COUNT.size * len(self.tuples)
        self.flat = not (self.enums or self.tuples or self.frames)  # integers alone: one struct says it all
        # An instance of the values in its fields' order (`make`): a NamedTuple item (a step's many) made by
        # tuple's own constructor, which runs no Python (its class's __new__ does). The values are read
        # integers, then tuples, then frames; a class declaring a field out of that order (a Hop's to_end,
        # last for its default) has them put in its order by one C call (`declared`), for an item's values
        # or for the columns of a step's items.
        order = [*integers, *(name for name, _ in self.tuples), *(name for name, _ in self.frames)]
        self.make = partial(tuple.__new__, cls) if issubclass(cls, tuple) else lambda values: cls(*values)
        self.declared = None if order == list(hints) else itemgetter(*(order.index(name) for name in hints))
        self.build = self.make if self.declared is None else lambda values: self.make(self.declared(values))
        # Items that are their integers, in order (an Op: a route's one per layer): taken and made as tuples.
        self.as_tuples = self.flat and self.declared is None and issubclass(cls, tuple)
        self.cls = cls

    def write(self, head: bytearray, value: object) -> None:
        head += self.fixed.pack(*self.integers(value))
        for name, item in self.tuples:
            items = getattr(value, name)
            head += _COUNT.pack(len(items))
            item.write_all(head, items)

    def write_all(self, head: bytearray, items: tuple) -> None:
        """The items field by field: every item's integers, item after item, in one struct; then for
        each tuple field every item's count in one struct, and all the items' elements in one tuple
        (laid out the same way). Per item of a step's hops, a few bytes and no Python call."""
        if len(items) < 2:  # one item's layout is the same either way: the plain one costs less
            for value in items:
                self.write(head, value)
            return
        head += self._runs.many(len(items)).pack(
            *itertools.chain.from_iterable(items if self.as_tuples else map(self.integers, items)))
        fields = tuple(zip(*items)) if self.tuples else ()  # each field's values, item after item (NamedTuples)
        for index, item in self.tuple_fields:
            column = fields[index]
            head += _COUNTS.many(len(items)).pack(*map(len, column))
            item.write_all(head, tuple(itertools.chain.from_iterable(column)))

    def read(self, header: _Header, frames: Sequence[Buffer] = ()) -> object:
        # The header's reads inlined (a call each cost more than the read): this runs per item.
        frame, fixed = header.frame, self.fixed
        if self.flat:
            values = fixed.unpack_from(frame, header.at)
            header.at += fixed.size
            return self.build(values)
        values = list(fixed.unpack_from(frame, header.at))
        header.at += fixed.size
        for index, enum in self.enums:
            values[index] = enum(values[index])
        for _, item in self.tuples:
            (n,) = _COUNT.unpack_from(frame, header.at)
            header.at += _COUNT.size
            if n * item.min_size > header.size - header.at:
                raise ValueError(f"{n} items claimed, {header.size - header.at} bytes left")
            values.append(item.read_all(header, n) if n else ())
        for index, (_, mark) in enumerate(self.frames, 1):
            values.append(frames[index] if mark == "body" else bytes(frames[index]).decode())
        return self.build(values)

    def read_all(self, header: _Header, n: int) -> tuple:
        """`n` items written by `write_all` (their count checked already against the bytes left)."""
        if n < 2 and not self.flat:  # as `write_all`
            return (self.read(header),) if n else ()
        if self.as_tuples:  # every item's integers in one struct call, each item made of them by tuple's constructor
            values = iter(self._runs.read_all(header, n))
            return tuple(map(tuple.__new__, itertools.repeat(self.cls), zip(*[values] * self.width)))
        values = self._runs.read_all(header, n)
        columns = [values[i::self.width] for i in range(self.width)]  # each integer field's, of every item
        for index, enum in self.enums:
            columns[index] = [enum(value) for value in columns[index]]
        for _, item in self.tuples:
            counts = _COUNTS.read_all(header, n)
            total = sum(counts)
            if total * item.min_size > header.size - header.at:
                raise ValueError(f"{total} items claimed, {header.size - header.at} bytes left")
            elements = iter(item.read_all(header, total) if total else ())
            count = counts[0]
            if counts.count(count) == n:  # as many for every item (a step's shapes, its routes' ops): cut in C
                columns.append(list(zip(*[elements] * count)) if count else [()] * n)
            else:
                columns.append([tuple(itertools.islice(elements, count)) for count in counts])
        return tuple(map(self.make, zip(*(columns if self.declared is None else self.declared(columns)))))


def _mark(hint: object) -> str | None:
    """How a field annotated `hint` travels: its mark, "Q" for a plain int; None for a tuple."""
    if get_origin(hint) is Annotated:
        return get_args(hint)[1]
    return "Q" if hint is int else None


def _item(hint: object) -> _Integers | _Layout:
    """The items of a `tuple[T, ...]` field: integers, or a declared class."""
    item, _ = get_args(hint)
    mark = _mark(item)
    if mark is None and not issubclass(item, tuple):  # `write_all` reads an item's fields by position
        raise TypeError(f"the items of a tuple field are integers or NamedTuples, not {item.__name__}")
    return _Integers(mark) if mark is not None else _Layout(item)


def _getter(names: list[str]) -> Callable[[object], tuple]:
    """A function giving the values of the fields `names` of an instance, as a tuple."""
    if not names:
        return lambda value: ()
    getter = attrgetter(*names)
    return getter if len(names) > 1 else lambda value: (getter(value),)


_LAYOUTS = {kind: _Layout(cls) for kind, cls in MESSAGES.items()}
_KINDS = {cls: kind for kind, cls in MESSAGES.items()}


def encode(msg: Message) -> list[Buffer]:
    """Frames for `msg`; a body buffer is returned as given (the caller sends it with copy=False).

    Raises BadTensor when a field does not fit its slot (a dimension past 2^64 - 1, say).
    """
    kind = _KINDS.get(type(msg))
    if kind is None:
        raise TypeError(f"not an ipc message: {type(msg).__name__}")
    layout = _LAYOUTS[kind]
    head = bytearray(_KIND.pack(kind))
    try:
        layout.write(head, msg)
    except (struct.error, OverflowError) as e:
        raise BadTensor(f"the request does not fit the device header: {e}") from None
    return [head, *(getattr(msg, name) if mark == "body" else getattr(msg, name).encode()
                    for name, mark in layout.frames)]


def decode(frames: Sequence[Buffer]) -> Message:
    """The message in `frames`; body buffers are kept as given (no copy). Raises BadIpcMessage, for
    anything short, unknown or past the message's fields alike."""
    try:
        header = _Header(frames[0])
        (kind,) = header.take(_KIND)
        layout = _LAYOUTS.get(kind)
        if layout is None:
            raise ValueError(f"unknown kind {kind}")
        message = layout.read(header, frames)
        if header.at != header.size or len(frames) != 1 + len(layout.frames):  # a writer of another layout
            raise ValueError(f"{header.size - header.at} bytes and {len(frames) - 1 - len(layout.frames)} frames "
                             "past its fields")
        return message
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise BadIpcMessage(f"malformed ipc message: {e}") from None
