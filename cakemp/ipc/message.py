"""Messages between the front and a device process, and their multipart frame codec (no I/O).

Every message is one header frame: a small fixed struct, then what its kind carries (Forward:
the shape and the layer run; Activation: the shape and the KV bytes; Done, Ready, Loaded: two
counts). Forward and Activation add one body frame holding the activation bytes, Failure and
Ready one holding a UTF-8 text.

The activation bytes are never copied or interpreted here: the body frame is the caller's
buffer (a memoryview into the master's Cake frame on the way in, the device's tensor memory on
the way out), handed to zmq with copy=False.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from collections.abc import Sequence

from cakemp.errors import ProtocolError

Buffer = bytes | bytearray | memoryview


class Kind(IntEnum):
    # front -> device
    FORWARD = 1
    CLEAR = 2  # Goodbye: drop the session's caches, keep the session usable
    END = 3  # the connection closed: free everything of the session
    # device -> front
    READY = 16
    ACTIVATION = 17
    FAILURE = 18
    DONE = 19
    LOADED = 20


# kind u8 | dtype u8 | ndim u8 | pad | n_ops u32 | session u64 | request id u64   (24 bytes)
_FIXED = struct.Struct("<BBBxIQQ")
_DIM = struct.Struct("<Q")
# one op: layer (index into the device's layer list) u32 | index_pos u64 | block_idx u64
_OP = struct.Struct("<IQQ")
# Done: sessions u64 | kv bytes u64 ; Ready: memory bytes u64 | layers u64 ; Loaded: layers u64 | total u64
_COUNTS = struct.Struct("<QQ")
# Activation, after its shape: the device's KV bytes u64
_KV = struct.Struct("<Q")


@dataclass(frozen=True)
class Op:
    """One entry of a layer run: the device's `layer` at RoPE offset `index_pos`, KV slot `block_idx`."""

    layer: int
    index_pos: int
    block_idx: int


@dataclass(frozen=True)
class Forward:
    """Run `ops` in order over x: `data` holds [1, T, H] little-endian elements of wire `dtype`."""

    session: int
    request_id: int
    dtype: int
    shape: tuple[int, ...]
    ops: tuple[Op, ...]
    data: Buffer


@dataclass(frozen=True)
class Clear:
    session: int
    request_id: int


@dataclass(frozen=True)
class End:
    session: int
    request_id: int


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
class Activation:
    """The reply to Forward: same dtype and shape as the request.

    `kv_bytes` is the device's KV cache size after the request, for the front's metrics (it
    grows with every decode step, long before a Done would report it).
    """

    request_id: int
    dtype: int
    shape: tuple[int, ...]
    data: Buffer
    kv_bytes: int = 0


@dataclass(frozen=True)
class Failure:
    """A request (or, with request_id 0, the start) failed; `error` is the exception's class name."""

    request_id: int
    error: str
    message: str


@dataclass(frozen=True)
class Done:
    """The reply to Clear and End, with the device's live session count and KV bytes after it."""

    request_id: int
    sessions: int
    kv_bytes: int


Message = Forward | Clear | End | Ready | Loaded | Activation | Failure | Done


def _fixed(kind: Kind, *, dtype: int = 0, shape: tuple[int, ...] = (), n_ops: int = 0, session: int = 0,
           request_id: int = 0) -> bytearray:
    """The fixed part of a header frame, then the shape's dims."""
    head = bytearray(_FIXED.pack(kind, dtype, len(shape), n_ops, session, request_id))
    for dim in shape:
        head += _DIM.pack(dim)
    return head


def encode(msg: Message) -> list[Buffer]:
    """Frames for `msg`; a body buffer is returned as given (the caller sends it with copy=False)."""
    if isinstance(msg, Forward):
        head = _fixed(Kind.FORWARD, dtype=msg.dtype, shape=msg.shape, n_ops=len(msg.ops), session=msg.session,
                      request_id=msg.request_id)
        for op in msg.ops:
            head += _OP.pack(op.layer, op.index_pos, op.block_idx)
        return [bytes(head), msg.data]
    if isinstance(msg, Activation):
        head = _fixed(Kind.ACTIVATION, dtype=msg.dtype, shape=msg.shape, request_id=msg.request_id)
        head += _KV.pack(msg.kv_bytes)
        return [bytes(head), msg.data]
    if isinstance(msg, Clear):
        return [_fixed(Kind.CLEAR, session=msg.session, request_id=msg.request_id)]
    if isinstance(msg, End):
        return [_fixed(Kind.END, session=msg.session, request_id=msg.request_id)]
    if isinstance(msg, Done):
        return [_fixed(Kind.DONE, request_id=msg.request_id) + _COUNTS.pack(msg.sessions, msg.kv_bytes)]
    if isinstance(msg, Ready):
        return [_fixed(Kind.READY) + _COUNTS.pack(msg.memory_bytes, msg.layers), msg.device.encode()]
    if isinstance(msg, Loaded):
        return [_fixed(Kind.LOADED) + _COUNTS.pack(msg.layers, msg.total)]
    if isinstance(msg, Failure):
        return [_fixed(Kind.FAILURE, request_id=msg.request_id), f"{msg.error}\n{msg.message}".encode()]
    raise TypeError(f"not an ipc message: {type(msg).__name__}")


def decode(frames: Sequence[Buffer]) -> Message:
    """The message in `frames`; body buffers are kept as given (no copy). Raises ProtocolError."""
    try:
        return _decode(frames)
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed ipc message: {e}") from None


def _decode(frames: Sequence[Buffer]) -> Message:
    head = frames[0]
    kind_tag, dtype, ndim, n_ops, session, request_id = _FIXED.unpack_from(head, 0)
    kind = Kind(kind_tag)
    at = _FIXED.size
    shape = tuple(_DIM.unpack_from(head, at + i * _DIM.size)[0] for i in range(ndim))
    at += ndim * _DIM.size
    if kind is Kind.FORWARD:
        ops = tuple(Op(*_OP.unpack_from(head, at + i * _OP.size)) for i in range(n_ops))
        return Forward(session, request_id, dtype, shape, ops, frames[1])
    if kind is Kind.ACTIVATION:
        return Activation(request_id, dtype, shape, frames[1], _KV.unpack_from(head, at)[0])
    if kind is Kind.CLEAR:
        return Clear(session, request_id)
    if kind is Kind.END:
        return End(session, request_id)
    if kind is Kind.DONE:
        sessions, kv_bytes = _COUNTS.unpack_from(head, at)
        return Done(request_id, sessions, kv_bytes)
    if kind is Kind.READY:
        memory_bytes, layers = _COUNTS.unpack_from(head, at)
        return Ready(bytes(frames[1]).decode(), memory_bytes, layers)
    if kind is Kind.LOADED:
        return Loaded(*_COUNTS.unpack_from(head, at))
    error, _, message = bytes(frames[1]).decode().partition("\n")
    return Failure(request_id, error, message)
