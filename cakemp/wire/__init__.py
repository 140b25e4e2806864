"""Cake's wire protocol with no I/O: framing and the speedy BigEndian message codec.

No sockets, no asyncio, no torch here: the front imports this package and must stay small.
"""

from cakemp.wire.frames import HEADER_SIZE, MAGIC, MAX_PAYLOAD, FrameDecoder, encode_frame, read_header
from cakemp.wire.messages import (
    Batch,
    DType,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOp,
    Message,
    ModelDataChunk,
    ModelDataDone,
    ModelDataResume,
    RawTensor,
    Revision,
    SingleOp,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    WorkerReady,
    decode_payload,
    encode_payload,
)

__all__ = [
    "MAGIC", "MAX_PAYLOAD", "HEADER_SIZE", "Revision", "DType", "RawTensor", "LayerOp",
    "Hello", "WorkerInfo", "SingleOp", "Batch", "TensorMessage", "Goodbye", "LayerAssignment",
    "LayerAssignmentAck", "ModelDataChunk", "ModelDataDone", "ModelDataResume", "WorkerReady",
    "WorkerError", "Message", "encode_payload", "encode_frame", "decode_payload", "FrameDecoder",
    "read_header",
]  # fmt: skip
