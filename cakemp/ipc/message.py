"""Messages between the front and its device processes, each declared once, here (no I/O).

A message class names its `Kind` in `@message(Kind.X)` and declares its fields; each field's
annotation says how it travels, and `cakemp.ipc.codec` walks these declarations:
`U8`/`U32`/`U64` are integers (a plain `int`, as in `cakemp.op.Op`, which is declared outside
ipc, is a U64), packed together into the header frame after the kind; a `tuple[T, ...]` is a
count and its items, after them; `Body` and `Text` travel as frames of their own after the header.

A Hop names its whole route: the stages still to run, each a device, the generation of
that device's process the front expects, and the ops for it. The device that runs stage 0
passes the result, as a Hop holding the remaining stages, straight to the next device;
the last one answers the front with an Activation. A prompt cut into chunks (only where its
route spans devices) is one Hop per chunk, all with the request's id and their `chunk` of `chunks`.

One message carries a whole device step in each direction: `Hops` every request the front (or
a device handing on) has for a device at once, `Answers` every result a device's step has for
the front. Their items carry no bytes of their own: item i's bytes are `nbytes` of the
message's one `data` frame, after the earlier items' (`rows`), so the codec, the tensor
conversion and the socket's work are paid once per message, not once per request.

A message's items (a Stage, a Hop, an Activation, a Failure, a step's Batch and reports) are
NamedTuples: each end makes several per request, and a tuple is made in about a quarter of a frozen
dataclass's time (a Hop: 0.29 µs against 1.15).

The activation bytes are never copied or interpreted here: a `Body` frame is the caller's
buffer (a memoryview into the master's Cake frame on the way in, the device's tensor memory on
the way out), handed to zmq with copy=False.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, NamedTuple, Union, dataclass_transform

from cakemp.errors import BadIpcMessage, ErrorCode
from cakemp.op import Op, Ops

Buffer = bytes | bytearray | memoryview


class Kind(IntEnum):
    # front -> device (and device -> device: HOPS)
    HOPS = 1
    CLEAR = 2  # Goodbye: drop the session's caches, keep the session usable
    END = 3  # the connection closed: free everything of the session
    PING = 4  # are you alive? (asked of the devices of a request that went silent)
    # device -> front
    READY = 16
    ANSWERS = 17  # a step's activations, failures and reports
    DONE = 19
    LOADED = 20
    START_FAILURE = 21
    PROGRESS = 22  # still computing a request: not hung
    PONG = 23


# How a field travels (the codec knows these marks).
U8 = Annotated[int, "B"]
U32 = Annotated[int, "I"]
U64 = Annotated[int, "Q"]
Code = Annotated[ErrorCode, "I"]
Body = Annotated[Buffer, "body"]  # a frame of its own: the caller's buffer, never copied
Text = Annotated[str, "text"]  # a frame of its own, UTF-8

MESSAGES: dict[Kind, type] = {}  # every message class, by its kind


@dataclass_transform(frozen_default=True)
def message(kind: Kind) -> Callable[[type], type]:
    """Declare a frozen dataclass as the ipc message of `kind`."""

    def declare(cls: type) -> type:
        if kind in MESSAGES:
            raise TypeError(f"{cls.__name__} is declared as {kind!r}, which {MESSAGES[kind].__name__} is already")
        MESSAGES[kind] = dataclass(frozen=True)(cls)
        return MESSAGES[kind]

    return declare


class Stage(NamedTuple):
    """The part of a route one device runs: its ops on `device`, if its process is still `generation`.

    The ops as columns, a tuple each: each op's layer (its index on the device), index_pos and block_idx.
    The front slices them from a Batch's columns (wire.LayerOps), and the device runs them as they are
    (`ops`, cakemp/op.py's Ops): a route of 80 layers costs neither an object an op."""

    device: U32
    generation: U32
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    blocks: tuple[int, ...]

    @classmethod
    def of(cls, device: int, generation: int, ops: Iterable[Op]) -> Stage:
        return cls(device, generation, *Ops.of(ops).columns)

    @property
    def ops(self) -> Ops:
        """BadIpcMessage where the columns' lengths differ (ops would be dropped unseen)."""
        if not len(self.layers) == len(self.positions) == len(self.blocks):
            raise BadIpcMessage(f"a stage's ops have {len(self.layers)} layers, {len(self.positions)} positions and "
                                f"{len(self.blocks)} KV slots")
        return Ops(self.layers, self.positions, self.blocks)


class Hop(NamedTuple):
    """A chunk of a request on its way down its route (an item of `Hops`): run `stages[0]` over x,
    then hand the result to the next stage's device (or, from the last stage, answer the front).

    x is [1, T, H] little-endian elements of wire `dtype` (`shape`): `nbytes` of its message's
    data; chunk `chunk` of the request's `chunks`; `kv` the KV bytes reported by the stages
    already run, in route order; `trace` the request's stamps so far when the front traces it
    (ipc/trace.py; else empty); `to_end` the rows from x's first to the end of the request it is a
    chunk of (0: x's own, T): longrope picks its factors by where the whole request ends. Fields in
    the order the codec reads them (integers, then tuples), but `to_end`, last for its default.
    """

    session: U64
    request_id: U64
    dtype: U8
    nbytes: U64
    chunk: U32
    chunks: U32
    shape: tuple[U64, ...]
    stages: tuple[Stage, ...]
    kv: tuple[U64, ...] = ()
    trace: tuple[U64, ...] = ()
    to_end: U64 = 0


@message(Kind.HOPS)
class Hops:
    """Every hop one sender has for a device at once (distinct sessions or not), their bytes one
    after another in `data`."""

    hops: tuple[Hop, ...]
    data: Body


@message(Kind.CLEAR)
class Clear:
    session: U64
    request_id: U64


@message(Kind.END)
class End:
    session: U64
    request_id: U64


@message(Kind.PING)
class Ping:
    pass


@message(Kind.PONG)
class Pong:
    pass


@message(Kind.READY)
class Ready:
    """The device loaded its layers; `device` is Cake's spelling: "cuda" or "cpu"."""

    device: Text
    memory_bytes: U64
    layers: U64


@message(Kind.LOADED)
class Loaded:
    """Load progress of a starting device: `layers` of its `total` are on the device (0 as soon as it runs)."""

    layers: U64
    total: U64


@message(Kind.START_FAILURE)
class StartFailure:
    """The device could not load its layers (then it exits)."""

    code: Code
    message: Text


class Activation(NamedTuple):
    """The last stage's answer to chunk `chunk` of a request (an item of `Answers`): `nbytes` of the
    message's data, of the chunk's dtype and shape (an image component's: its own).

    `kv` is the KV cache size of every stage's device after the request, in route order, for
    the front's metrics (it grows with every decode step, long before a Done would report it);
    `trace` the Hop's stamps and the last device's (ipc/trace.py; empty untraced).
    """

    request_id: U64
    dtype: U8
    nbytes: U64
    chunk: U32
    shape: tuple[U64, ...]
    kv: tuple[U64, ...] = ()
    trace: tuple[U64, ...] = ()


class Failure(NamedTuple):
    """Chunk `chunk` of a request failed on the device that sends this (an item of `Answers`); its
    message is `nbytes` of the message's data, UTF-8. `ran`: part of the request had run on this
    device before it failed (an earlier piece of a prompt the device cut), whose state is not rolled
    back: the front then drops the session's state on the route (front/pool_state.py)."""

    request_id: U64
    code: Code
    chunk: U32
    ran: U8
    nbytes: U64


class Batch(NamedTuple):
    """The device computed `requests` requests of `tokens` tokens as one batch (for the front's metrics)."""

    requests: U64
    tokens: U64


class PrefixReport(NamedTuple):
    """What prefix reuse did on the device since its last report: requests that adopted a retired
    prefix (`hits`), positions answered from kept rows instead of computed (`tokens`), prefixes
    given up for room (`evictions`); and the bytes it holds now for reuse alone: retired
    prefixes, and live sessions' kept output rows and recurrent states (for the front's metrics)."""

    hits: U64
    tokens: U64
    evictions: U64
    retired_bytes: U64
    kept_bytes: U64


class ExpertReport(NamedTuple):
    """What the device's cache of offloaded MoE experts did since its last report: experts found in
    it (`hits`), experts read from the checkpoint (`misses`, `read_bytes` of it as stored); and the
    bytes of experts it holds now (for the front's metrics)."""

    hits: U64
    misses: U64
    read_bytes: U64
    resident_bytes: U64


@message(Kind.PROGRESS)
class Progress:
    """The device is still computing `request_id` (sent while a request runs long)."""

    request_id: U64


@message(Kind.ANSWERS)
class Answers:
    """What one step of a device has for the front: the activations it finished and the failures,
    their bytes one after another in `data` (the activations' first); the batches it computed; and
    what prefix reuse and the offloaded experts did, when that changed (at most one of each)."""

    activations: tuple[Activation, ...] = ()
    failures: tuple[Failure, ...] = ()
    batches: tuple[Batch, ...] = ()
    prefixes: tuple[PrefixReport, ...] = ()
    experts: tuple[ExpertReport, ...] = ()
    data: Body = b""


def rows(items: Sequence[Hop | Activation | Failure], data: Buffer, at: int = 0) -> list[memoryview]:
    """Each item's bytes: `nbytes` of `data` after the earlier items' (from byte `at`), as views (no copy).
    Raises BadIpcMessage when they claim more than `data` holds."""
    view = memoryview(data).cast("B")
    slices = []
    for item in items:
        end = at + item.nbytes
        slices.append(view[at:end])
        at = end
    if at > view.nbytes:
        raise BadIpcMessage(f"malformed ipc message: its items claim {at} bytes of its {view.nbytes}")
    return slices


def joined(buffers: Sequence[Buffer]) -> Buffer:
    """One buffer of `buffers` one after another: the only one as it is, else one copy of them all."""
    if len(buffers) == 1:
        return buffers[0]
    return b"".join(buffers)


@message(Kind.DONE)
class Done:
    """The reply to Clear and End, with the device's live session count and KV bytes after it."""

    request_id: U64
    sessions: U64
    kv_bytes: U64


Message = Union[tuple(MESSAGES.values())]  # noqa: UP007 (built from the declarations)

__all__ = ["Kind", "Op", "Stage", "Hop", "Activation", "Failure", "Batch", "PrefixReport", "ExpertReport", "Message",
           "Buffer", "rows", "joined", *(cls.__name__ for cls in MESSAGES.values())]
