"""Cake's wire protocol with no I/O: framing and the speedy BigEndian message codec.

No sockets, no asyncio, no torch here: the front imports this package and must stay small.
Every message declared in `messages` is exported here by name.
"""

from cakemp.wire import messages
from cakemp.wire.codec import decode_payload, encode_payload
from cakemp.wire.frames import HEADER_SIZE, MAGIC, MAX_PAYLOAD, FrameDecoder, encode_frame, read_header
from cakemp.wire.messages import *  # noqa: F403 (Revision, DType, RawTensor, LayerOp, Message, every message)

__all__ = [
    *messages.__all__, "MAGIC", "MAX_PAYLOAD", "HEADER_SIZE", "encode_payload", "encode_frame", "decode_payload",
    "FrameDecoder", "read_header",
]  # fmt: skip
