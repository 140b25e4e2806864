"""Whole frames as Cake's speedy encoder writes them, byte for byte, at both protocol revisions
(docs/protocol.md, Worked examples)."""

from __future__ import annotations

import pytest

from cakemp.wire import (
    Batch,
    DType,
    FrameDecoder,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOp,
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
    encode_frame,
)

BOTH = (Revision.V1, Revision.V2)
ZEROS_1X4 = RawTensor(bytes(8), DType.F16, (1, 4))
TENSOR_HEX = "00000008 0000000000000000 04 00000002 0000000000000001 0000000000000004"
LAYER0 = "0000000e 6d6f64656c2e6c61796572732e30"  # "model.layers.0"

EXAMPLES = [
    ("A Hello", Hello(), BOTH, "0104f4c7 00000004 00000000"),
    ("B Goodbye", Goodbye(), BOTH, "0104f4c7 00000004 00000005"),
    (
        "C WorkerInfo",
        WorkerInfo("0.1.0", "F16", "linux", "x86_64", "cuda", 2, 42),
        BOTH,
        "0104f4c7 00000047 00000001"
        " 00000005 302e312e30 00000003 463136 00000005 6c696e7578 00000006 7838365f3634"
        " 00000004 63756461 0000000000000002 0000000000000000000000000000002a",
    ),
    (
        "D Batch",
        Batch(ZEROS_1X4, (LayerOp("model.layers.0", 7, 0), LayerOp("model.layers.1", 7, 1))),
        BOTH,
        f"0104f4c7 0000006d 00000003 {TENSOR_HEX} 00000002"
        f" {LAYER0} 0000000000000007 0000000000000000"
        " 0000000e 6d6f64656c2e6c61796572732e31 0000000000000007 0000000000000001",
    ),
    ("E Tensor", TensorMessage(ZEROS_1X4), BOTH, f"0104f4c7 00000025 00000004 {TENSOR_HEX}"),
    ("F WorkerError fa7d08a", WorkerError("boom"), (Revision.V1,), "0104f4c7 0000000c 0000000b 00000004 626f6f6d"),
    ("F WorkerError HEAD", WorkerError("boom"), (Revision.V2,), "0104f4c7 0000000c 0000000c 00000004 626f6f6d"),
    (
        "G SingleOp",
        SingleOp("model.layers.5", ZEROS_1X4, 42, 5),
        BOTH,
        "0104f4c7 00000047 00000002 0000000e 6d6f64656c2e6c61796572732e35"
        f" {TENSOR_HEX} 000000000000002a 0000000000000005",
    ),
    (
        "H LayerAssignment",
        LayerAssignment(("model.layers.0",), "deadbeef"),
        BOTH,
        f"0104f4c7 00000026 00000006 00000001 {LAYER0} 00000008 6465616462656566",
    ),
    ("H LayerAssignmentAck", LayerAssignmentAck(True), BOTH, "0104f4c7 00000005 00000007 01"),
    ("H ModelDataDone", ModelDataDone(), BOTH, "0104f4c7 00000004 00000009"),
    ("H WorkerReady fa7d08a", WorkerReady(), (Revision.V1,), "0104f4c7 00000004 0000000a"),
    ("H WorkerReady HEAD", WorkerReady(), (Revision.V2,), "0104f4c7 00000004 0000000b"),
    (
        "H ModelDataChunk fa7d08a",
        ModelDataChunk("a", 0, 3, b"\x01\x02\x03"),
        (Revision.V1,),
        "0104f4c7 00000020 00000008 00000001 61 0000000000000000 0000000000000003 00000003 010203",
    ),
    (
        "H ModelDataChunk HEAD",
        ModelDataChunk("a", 0, 3, b"\x01\x02\x03", compressed=False, checksum=0x55BC801D),
        (Revision.V2,),
        "0104f4c7 00000025 00000008 00000001 61 0000000000000000 0000000000000003 00 55bc801d 00000003 010203",
    ),
    (
        "H ModelDataResume HEAD",
        ModelDataResume("a", 3),
        (Revision.V2,),
        "0104f4c7 00000011 0000000a 00000001 61 0000000000000003",
    ),
]

CASES = [
    pytest.param(msg, rev, bytes.fromhex(hexa.replace(" ", "")), id=f"{name} V{rev.value}")
    for name, msg, revisions, hexa in EXAMPLES
    for rev in revisions
]


@pytest.mark.parametrize("msg, revision, frame", CASES)
def test_encode_matches_spec(msg, revision, frame):
    """Encoding the example's message gives exactly the spec's frame bytes."""
    assert b"".join(encode_frame(msg, revision)) == frame


@pytest.mark.parametrize("msg, revision, frame", CASES)
def test_decode_matches_spec(msg, revision, frame):
    """Decoding the spec's frame bytes gives back exactly the example's message."""
    decoder = FrameDecoder(revision)
    decoder.feed(frame)
    assert decoder.next_message() == msg
    assert decoder.next_message() is None
