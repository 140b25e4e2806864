"""Messages between the front and its device processes, and their multipart frame codec (no I/O).

Every message is one header frame: a fixed struct (kind, dtype, ndim, session, request id),
then what its kind carries. Hop and Activation add one body frame holding the activation
bytes, Failure, StartFailure and Ready one holding a UTF-8 text.

(`forward` names one thing in cakemp: a layer's computation. What travels is a Hop.)
A Hop names its whole route: the stages still to run, each a device, the generation of
that device's process the front expects, and the ops for it. The device that runs stage 0
passes the result, as a Hop holding the remaining stages, straight to the next device;
the last one answers the front with an Activation. A prompt cut into chunks is one Hop per
chunk, all with the request's id and their `chunk` of `chunks`.

The activation bytes are never copied or interpreted here: the body frame is the caller's
buffer (a memoryview into the master's Cake frame on the way in, the device's tensor memory on
the way out), handed to zmq with copy=False.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from cakemp import errors
from cakemp.errors import BadTensor, ProtocolError
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


class ErrorCode(IntEnum):
    """Why a device could not serve a request (or start), as it travels over ipc."""

    INTERNAL = 1  # a fault in cakemp or the device itself; details stay in the device's log
    REQUEST = 2  # a RequestError with no code of its own
    UNKNOWN_LAYER = 3
    BAD_TENSOR = 4
    CONTEXT_LIMIT = 5
    CACHE_BUDGET = 6
    POSITION_GAP = 7
    DEVICE_LOST = 8
    CONFIG = 9
    CHECKPOINT = 10
    BAD_OPS = 11
    SESSION_EXPIRED = 12
    BAD_REQUEST = 13


# Most specific first: the first class an exception is an instance of gives its code.
_CODES: tuple[tuple[type[errors.CakempError], ErrorCode], ...] = (
    (errors.UnknownLayer, ErrorCode.UNKNOWN_LAYER),
    (errors.BadTensor, ErrorCode.BAD_TENSOR),
    (errors.BadOps, ErrorCode.BAD_OPS),
    (errors.ContextLimitExceeded, ErrorCode.CONTEXT_LIMIT),
    (errors.SessionExpired, ErrorCode.SESSION_EXPIRED),
    (errors.PositionGap, ErrorCode.POSITION_GAP),
    (errors.CacheBudgetExceeded, ErrorCode.CACHE_BUDGET),
    (errors.DeviceLost, ErrorCode.DEVICE_LOST),
    (errors.InternalError, ErrorCode.INTERNAL),
    (errors.BadRequest, ErrorCode.BAD_REQUEST),
    (errors.RequestError, ErrorCode.REQUEST),
    (errors.CheckpointError, ErrorCode.CHECKPOINT),
    (errors.ConfigError, ErrorCode.CONFIG),
)
_CLASSES = {code: cls for cls, code in _CODES}


def error_code(error: BaseException) -> ErrorCode:
    """The code for `error`; anything not declared in cakemp.errors is INTERNAL."""
    return next((code for cls, code in _CODES if isinstance(error, cls)), ErrorCode.INTERNAL)


def error_from(code: int, message: str) -> errors.CakempError:
    """The exception a code stands for, with `message` (an unknown code: InternalError)."""
    cls = _CLASSES.get(code, errors.InternalError)
    return cls(message)


# kind u8 | dtype u8 | pad u16 | ndim u32 | session u64 | request id u64   (24 bytes)
_FIXED = struct.Struct("<BBxxIQQ")
_DIM = struct.Struct("<Q")
# Hop, after the fixed part: chunk u32 | chunks u32 | stages u32 | kv entries u32
_ROUTE = struct.Struct("<IIII")
# one stage: device u32 | generation u32 | n_ops u32
_STAGE = struct.Struct("<III")
# one op: layer (index into the device's layer list) u32 | index_pos u64 | block_idx u64
_OP = struct.Struct("<IQQ")
# Done: sessions u64 | kv bytes u64 ; Ready: memory bytes u64 | layers u64 ; Loaded: layers u64 | total u64 ;
# StepReport: requests u64 | tokens u64
_COUNTS = struct.Struct("<QQ")
# Activation: chunk u32 | kv entries u32 ; Failure: chunk u32 | code u32
_PAIR = struct.Struct("<II")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class Stage:
    """The part of a route one device runs: `ops` on `device`, if its process is still `generation`."""

    device: int
    generation: int
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Hop:
    """A chunk of a request on its way down its route: run `stages[0]` over x, then hand the
    result to the next stage's device as a Hop (or, from the last stage, answer the front).

    `data` holds [1, T, H] little-endian elements of wire `dtype` (`shape`), chunk `chunk` of the
    request's `chunks`; `kv` is the KV bytes reported by the stages already run, in route order.
    """

    session: int
    request_id: int
    dtype: int
    shape: tuple[int, ...]
    stages: tuple[Stage, ...]
    data: Buffer
    chunk: int = 0
    chunks: int = 1
    kv: tuple[int, ...] = ()


@dataclass(frozen=True)
class Clear:
    session: int
    request_id: int


@dataclass(frozen=True)
class End:
    session: int
    request_id: int


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Pong:
    pass


@dataclass(frozen=True)
class Ready:
    """The device loaded its layers; `device` is Cake's spelling: "cuda" or "cpu"."""

    device: str
    memory_bytes: int
    layers: int


@dataclass(frozen=True)
class Loaded:
    """Load progress of a starting device: `layers` of its `total` are on the device (0 as soon as it runs)."""

    layers: int
    total: int


@dataclass(frozen=True)
class StartFailure:
    """The device could not load its layers (then it exits)."""

    code: int
    message: str


@dataclass(frozen=True)
class Activation:
    """The last stage's answer to chunk `chunk` of a request: same dtype and shape as that chunk.

    `kv` is the KV cache size of every stage's device after the request, in route order, for
    the front's metrics (it grows with every decode step, long before a Done would report it).
    """

    request_id: int
    dtype: int
    shape: tuple[int, ...]
    data: Buffer
    chunk: int = 0
    kv: tuple[int, ...] = ()


@dataclass(frozen=True)
class Failure:
    """Chunk `chunk` of a request failed on the device that sends this; `code` is an ErrorCode."""

    request_id: int
    code: int
    message: str
    chunk: int = 0


@dataclass(frozen=True)
class Progress:
    """The device is still computing `request_id` (sent while a request runs long)."""

    request_id: int


@dataclass(frozen=True)
class StepReport:
    """The device began a step of `requests` requests and `tokens` tokens (for the front's metrics)."""

    requests: int
    tokens: int


@dataclass(frozen=True)
class Done:
    """The reply to Clear and End, with the device's live session count and KV bytes after it."""

    request_id: int
    sessions: int
    kv_bytes: int


Message = (Hop | Clear | End | Ping | Pong | Ready | Loaded | StartFailure | Activation | Failure | Progress | Done
           | StepReport)


def _head(kind: Kind, *, dtype: int = 0, shape: tuple[int, ...] = (), session: int = 0,
          request_id: int = 0) -> bytearray:
    """The fixed part of a header frame, then the shape's dims."""
    head = bytearray(_FIXED.pack(kind, dtype, len(shape), session, request_id))
    head += struct.pack(f"<{len(shape)}Q", *shape)
    return head


def _u64s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def encode(msg: Message) -> list[Buffer]:
    """Frames for `msg`; a body buffer is returned as given (the caller sends it with copy=False).

    Raises BadTensor when a field does not fit its slot (a dimension past 2^64 - 1, say).
    """
    try:
        return _encode(msg)
    except (struct.error, OverflowError) as e:
        raise BadTensor(f"the request does not fit the device header: {e}") from None


def _encode(msg: Message) -> list[Buffer]:
    if isinstance(msg, Hop):
        head = _head(Kind.HOP, dtype=msg.dtype, shape=msg.shape, session=msg.session, request_id=msg.request_id)
        head += _ROUTE.pack(msg.chunk, msg.chunks, len(msg.stages), len(msg.kv)) + _u64s(msg.kv)
        for stage in msg.stages:
            head += _STAGE.pack(stage.device, stage.generation, len(stage.ops))
            for op in stage.ops:
                head += _OP.pack(op.layer, op.index_pos, op.block_idx)
        return [bytes(head), msg.data]
    if isinstance(msg, Activation):
        head = _head(Kind.ACTIVATION, dtype=msg.dtype, shape=msg.shape, request_id=msg.request_id)
        head += _PAIR.pack(msg.chunk, len(msg.kv)) + _u64s(msg.kv)
        return [bytes(head), msg.data]
    if isinstance(msg, Clear):
        return [_head(Kind.CLEAR, session=msg.session, request_id=msg.request_id)]
    if isinstance(msg, End):
        return [_head(Kind.END, session=msg.session, request_id=msg.request_id)]
    if isinstance(msg, Ping):
        return [_head(Kind.PING)]
    if isinstance(msg, Pong):
        return [_head(Kind.PONG)]
    if isinstance(msg, Progress):
        return [_head(Kind.PROGRESS, request_id=msg.request_id)]
    if isinstance(msg, StepReport):
        return [_head(Kind.STEP_REPORT) + _COUNTS.pack(msg.requests, msg.tokens)]
    if isinstance(msg, Done):
        return [_head(Kind.DONE, request_id=msg.request_id) + _COUNTS.pack(msg.sessions, msg.kv_bytes)]
    if isinstance(msg, Ready):
        return [_head(Kind.READY) + _COUNTS.pack(msg.memory_bytes, msg.layers), msg.device.encode()]
    if isinstance(msg, Loaded):
        return [_head(Kind.LOADED) + _COUNTS.pack(msg.layers, msg.total)]
    if isinstance(msg, Failure):
        return [_head(Kind.FAILURE, request_id=msg.request_id) + _PAIR.pack(msg.chunk, msg.code), msg.message.encode()]
    if isinstance(msg, StartFailure):
        return [_head(Kind.START_FAILURE) + _U32.pack(msg.code), msg.message.encode()]
    raise TypeError(f"not an ipc message: {type(msg).__name__}")


def decode(frames: Sequence[Buffer]) -> Message:
    """The message in `frames`; body buffers are kept as given (no copy). Raises ProtocolError."""
    try:
        return _Reader(frames).message()
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed ipc message: {e}") from None


class _Reader:
    """Reads one header frame front to back; every count is checked against the bytes left first."""

    def __init__(self, frames: Sequence[Buffer]):
        self.frames = frames
        self.head = frames[0]
        self.size = memoryview(self.head).nbytes
        self.at = 0

    def take(self, layout: struct.Struct) -> tuple:
        values = layout.unpack_from(self.head, self.at)
        self.at += layout.size
        return values

    def u64s(self, count: int) -> tuple[int, ...]:
        if count * 8 > self.size - self.at:
            raise ValueError(f"{count} values claimed, {self.size - self.at} bytes left")
        values = struct.unpack_from(f"<{count}Q", self.head, self.at)
        self.at += count * 8
        return values

    def ops(self, count: int) -> tuple[Op, ...]:
        if count * _OP.size > self.size - self.at:
            raise ValueError(f"{count} ops claimed, {self.size - self.at} bytes left")
        return tuple(Op(*self.take(_OP)) for _ in range(count))

    def text(self) -> str:
        return bytes(self.frames[1]).decode()

    def message(self) -> Message:
        kind_tag, dtype, ndim, session, request_id = self.take(_FIXED)
        kind = Kind(kind_tag)
        shape = self.u64s(ndim)
        if kind is Kind.HOP:
            chunk, chunks, n_stages, n_kv = self.take(_ROUTE)
            kv = self.u64s(n_kv)
            if n_stages * _STAGE.size > self.size - self.at:
                raise ValueError(f"{n_stages} stages claimed, {self.size - self.at} bytes left")
            stages = []
            for _ in range(n_stages):
                device, generation, n_ops = self.take(_STAGE)
                stages.append(Stage(device, generation, self.ops(n_ops)))
            return Hop(session, request_id, dtype, shape, tuple(stages), self.frames[1], chunk, chunks, kv)
        if kind is Kind.ACTIVATION:
            chunk, n_kv = self.take(_PAIR)
            return Activation(request_id, dtype, shape, self.frames[1], chunk, self.u64s(n_kv))
        if kind is Kind.CLEAR:
            return Clear(session, request_id)
        if kind is Kind.END:
            return End(session, request_id)
        if kind is Kind.PING:
            return Ping()
        if kind is Kind.PONG:
            return Pong()
        if kind is Kind.PROGRESS:
            return Progress(request_id)
        if kind is Kind.STEP_REPORT:
            return StepReport(*self.take(_COUNTS))
        if kind is Kind.DONE:
            return Done(request_id, *self.take(_COUNTS))
        if kind is Kind.READY:
            memory_bytes, layers = self.take(_COUNTS)
            return Ready(self.text(), memory_bytes, layers)
        if kind is Kind.LOADED:
            return Loaded(*self.take(_COUNTS))
        if kind is Kind.FAILURE:
            chunk, code = self.take(_PAIR)
            return Failure(request_id, code, self.text(), chunk)
        (code,) = self.take(_U32)
        return StartFailure(code, self.text())
