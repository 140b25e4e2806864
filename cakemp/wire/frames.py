"""Cake's framing: an 8-byte header (u32 BE magic, u32 BE payload length) before each payload.

One TCP stream carries frame after frame with no other delimiter (docs/protocol.md, Frames). `FrameDecoder`
is sans-I/O in the manner of h11: feed it whatever bytes arrived, take out whole messages
(`cakemp.streams.FrameReader` is the asyncio reader around it, for every stream).
"""

from __future__ import annotations

import struct

from cakemp.errors import EncodeError, ProtocolError
from cakemp.wire.codec import decode_payload, encode_buffers
from cakemp.wire.messages import Message, Revision

MAGIC = 0x0104F4C7
MAX_PAYLOAD = 512 * 1024 * 1024  # Cake's MESSAGE_MAX_SIZE; exactly this size is accepted
HEADER_SIZE = 8

_HEADER = struct.Struct(">II")


def read_header(header: bytes | bytearray | memoryview, max_payload: int = MAX_PAYLOAD) -> int:
    """The payload length announced by an 8-byte frame header; ProtocolError when the magic is
    wrong or the length is over `max_payload`."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(header)}")
    magic, size = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"invalid magic value 0x{magic:08x} (expected 0x{MAGIC:08x})")
    if size > max_payload:
        raise ProtocolError(f"payload length {size} > maximum {max_payload}")
    return size


def encode_frame(msg: Message, revision: Revision) -> list[bytes | bytearray | memoryview]:
    """Header and payload of `msg` as buffers for `writer.writelines`; tensor and model data
    are passed by reference, never copied here. Raises EncodeError."""
    pieces = encode_buffers(msg, revision, HEADER_SIZE)
    size = sum([memoryview(piece).nbytes for piece in pieces]) - HEADER_SIZE
    if size > MAX_PAYLOAD:
        # Cake's writer refuses too, and sends nothing.
        raise EncodeError(f"{type(msg).__name__} payload of {size} bytes > maximum {MAX_PAYLOAD}")
    _HEADER.pack_into(pieces[0], 0, MAGIC, size)
    return pieces


class FrameDecoder:
    """Reassembles frames from arbitrary chunks of a stream and decodes their messages.

    A bad header (magic, length) loses the frame boundary for good: the error is raised again
    on every later call. A payload that does not decode raises once, after the frame has been
    consumed, so the decoder stays in step with the stream and a caller that chooses to go on
    (a BadTensor answered with WorkerError) reads the next frame normally.

    A reader that must act between a frame's header and its payload (take the payload's size from
    a budget before reading it) feeds the header, asks `frame_size`, then feeds the `missing`
    bytes. A payload that arrives in pieces is gathered into one buffer of its size, allocated at
    its first piece (not at its header, so a header alone holds no memory); decoded tensors are
    views of that buffer.
    """

    def __init__(self, revision: Revision, max_payload: int = MAX_PAYLOAD,
                 limits: dict[str, int] | None = None) -> None:
        """`max_payload`: the largest payload a header may announce (a reader may change it
        between frames); `limits`: `decode_payload`'s bounds on counts."""
        self.revision = Revision(revision)
        self.max_payload = max_payload
        self.limits = limits
        self._buf = bytearray()  # bytes not yet gathered into a payload: a header, or a frame's start
        self._payload_size: int | None = None  # known once the current frame's header is in
        self._payload: bytearray | None = None  # the current frame's payload being gathered, of its size
        self._got = 0  # bytes of `_payload` filled
        self._broken: ProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes received from the peer."""
        if self._broken is not None:
            raise self._broken
        size = self._payload_size
        if self._payload is None and size is not None and len(self._buf) + len(data) < size:
            self._payload, self._got = bytearray(size), 0
            self._fill(self._buf)
            self._buf = bytearray()
        if self._payload is not None:
            data = self._fill(data)
        self._buf += data

    def _fill(self, data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        """Copy what of `data` the payload being gathered still lacks into it; the rest of `data`."""
        count = min(len(data), len(self._payload) - self._got)
        with memoryview(self._payload) as payload, memoryview(data) as view:
            payload[self._got:self._got + count] = view[:count]
        self._got += count
        return data[count:]

    def frame_size(self) -> int | None:
        """The payload length the current frame's header announces, once the header is in (None
        until then); ProtocolError when the magic is wrong or the length over `max_payload`."""
        if self._broken is not None:
            raise self._broken
        if self._payload_size is None and len(self._buf) >= HEADER_SIZE:
            try:
                self._payload_size = read_header(self._buf[:HEADER_SIZE], self.max_payload)
            except ProtocolError as exc:
                self._broken = exc
                raise
            del self._buf[:HEADER_SIZE]
        return self._payload_size

    def missing(self) -> int:
        """Bytes still to be fed before the current frame is whole (its header's, until that is in)."""
        if self._payload_size is None:
            return max(0, HEADER_SIZE - len(self._buf))
        if self._payload is not None:
            return self._payload_size - self._got
        return max(0, self._payload_size - len(self._buf))

    def buffered(self) -> int:
        """Bytes fed that are not yet gathered into a payload: past the frame being read, or between frames."""
        return len(self._buf)

    def received(self) -> bytes:
        """What has been fed of the current frame's payload (for an error saying how much came)."""
        return bytes(self._buf if self._payload is None else self._payload[:self._got])

    def next_message(self) -> Message | None:
        """The next whole message, or None until more bytes are fed."""
        size = self.frame_size()
        if size is None:
            return None
        if self._payload is not None:
            if self._got < size:
                return None
            payload, self._payload = self._payload, None
        elif len(self._buf) < size:
            return None
        # Decoded tensors are views of `payload`, so it must never change afterwards: when the
        # buffer holds exactly this frame (the usual case, Cake never pipelines requests) it is
        # handed over whole; otherwise the payload is copied out once.
        elif len(self._buf) == size:
            payload, self._buf = self._buf, bytearray()
        else:
            with memoryview(self._buf) as view:
                payload = bytes(view[:size])
            del self._buf[:size]
        self._payload_size = None
        return decode_payload(payload, self.revision, self.limits)
