"""Messages between the front and its device processes, each declared once, here (no I/O).

A message class names its `Kind` in `@message(Kind.X)` and declares its fields; each field's
annotation says how it travels, and `cakemp.ipc.codec` walks these declarations:
`U8`/`U32`/`U64` are integers (a plain `int`, as in `cakemp.op.Op`, which is declared outside
ipc, is a U64), packed together into the header frame after the kind; a `tuple[T, ...]` is a
count and its items, after them; `Body` and `Text` travel as frames of their own after the header.

A Hop names its whole route: the stages still to run, each a device, the generation of
that device's process the front expects, and the ops for it. The device that runs stage 0
passes the result, as a Hop holding the remaining stages, straight to the next device;
the last one answers the front with an Activation. A prompt cut into chunks is one Hop per
chunk, all with the request's id and their `chunk` of `chunks`.

The activation bytes are never copied or interpreted here: a `Body` frame is the caller's
buffer (a memoryview into the master's Cake frame on the way in, the device's tensor memory on
the way out), handed to zmq with copy=False.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Union, dataclass_transform

from cakemp.errors import ErrorCode
from cakemp.op import Op

Buffer = bytes | bytearray | memoryview


class Kind(IntEnum):
    # front -> device (and device -> device: HOP)
    HOP = 1
    CLEAR = 2  # Goodbye: drop the session's caches, keep the session usable
    END = 3  # the connection closed: free everything of the session
    PING = 4  # are you alive? (asked of the devices of a request that went silent)
    # device -> front
    READY = 16
    ACTIVATION = 17
    FAILURE = 18
    DONE = 19
    LOADED = 20
    START_FAILURE = 21
    PROGRESS = 22  # still computing a request: not hung
    PONG = 23
    STEP_REPORT = 24  # a step began: its size, for the metrics
    PREFIX_REPORT = 25  # what prefix reuse did, for the metrics
    EXPERT_REPORT = 26  # what the offloaded experts' cache did, for the metrics


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


@dataclass(frozen=True)
class Stage:
    """The part of a route one device runs: `ops` on `device`, if its process is still `generation`."""

    device: U32
    generation: U32
    ops: tuple[Op, ...]


@message(Kind.HOP)
class Hop:
    """A chunk of a request on its way down its route: run `stages[0]` over x, then hand the
    result to the next stage's device as a Hop (or, from the last stage, answer the front).

    `data` holds [1, T, H] little-endian elements of wire `dtype` (`shape`), chunk `chunk` of the
    request's `chunks`; `kv` is the KV bytes reported by the stages already run, in route order;
    `trace` the request's stamps so far when the front traces it (ipc/trace.py; else empty).
    """

    session: U64
    request_id: U64
    dtype: U8
    shape: tuple[U64, ...]
    stages: tuple[Stage, ...]
    data: Body
    chunk: U32 = 0
    chunks: U32 = 1
    kv: tuple[U64, ...] = ()
    trace: tuple[U64, ...] = ()


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


@message(Kind.ACTIVATION)
class Activation:
    """The last stage's answer to chunk `chunk` of a request: same dtype and shape as that chunk.

    `kv` is the KV cache size of every stage's device after the request, in route order, for
    the front's metrics (it grows with every decode step, long before a Done would report it);
    `trace` the Hop's stamps and the last device's (ipc/trace.py; empty untraced).
    """

    request_id: U64
    dtype: U8
    shape: tuple[U64, ...]
    data: Body
    chunk: U32 = 0
    kv: tuple[U64, ...] = ()
    trace: tuple[U64, ...] = ()


@message(Kind.FAILURE)
class Failure:
    """Chunk `chunk` of a request failed on the device that sends this."""

    request_id: U64
    code: Code
    message: Text
    chunk: U32 = 0


@message(Kind.PROGRESS)
class Progress:
    """The device is still computing `request_id` (sent while a request runs long)."""

    request_id: U64


@message(Kind.STEP_REPORT)
class StepReport:
    """The device began computing `requests` requests of `tokens` tokens as one batch (for the front's metrics)."""

    requests: U64
    tokens: U64


@message(Kind.PREFIX_REPORT)
class PrefixReport:
    """What prefix reuse did on the device since its last report: requests that adopted a retired
    prefix (`hits`), positions answered from kept rows instead of computed (`tokens`), prefixes
    given up for room (`evictions`); and the bytes it holds now for reuse alone: retired
    prefixes, and live sessions' kept output rows and recurrent states (for the front's metrics)."""

    hits: U64
    tokens: U64
    evictions: U64
    retired_bytes: U64
    kept_bytes: U64


@message(Kind.EXPERT_REPORT)
class ExpertReport:
    """What the device's cache of offloaded MoE experts did since its last report: experts found in
    it (`hits`), experts read from the checkpoint (`misses`, `read_bytes` of it as stored); and the
    bytes of experts it holds now (for the front's metrics)."""

    hits: U64
    misses: U64
    read_bytes: U64
    resident_bytes: U64


@message(Kind.DONE)
class Done:
    """The reply to Clear and End, with the device's live session count and KV bytes after it."""

    request_id: U64
    sessions: U64
    kv_bytes: U64


Message = Union[tuple(MESSAGES.values())]  # noqa: UP007 (built from the declarations)

__all__ = ["Kind", "Op", "Stage", "Message", *(cls.__name__ for cls in MESSAGES.values())]
