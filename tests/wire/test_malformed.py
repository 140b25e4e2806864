"""Every way a peer's bytes can be wrong raises ProtocolError (or BadTensor) saying what was wrong,
and every message cakemp cannot encode raises EncodeError."""

from __future__ import annotations

import mmap
import struct

import pytest

from cakemp.errors import BadOps, BadTensor, EncodeError, ProtocolError
from cakemp.wire import (
    MAX_PAYLOAD,
    Batch,
    DType,
    FrameDecoder,
    Hello,
    LayerAssignment,
    LayerOp,
    ModelDataChunk,
    ModelDataResume,
    RawTensor,
    Revision,
    TensorMessage,
    WorkerInfo,
    decode_payload,
    encode_frame,
    encode_payload,
    read_header,
)
from cakemp.wire.messages import MAX_DIMS, MAX_ITEMS

V2 = Revision.V2


def frame(payload: bytes) -> bytes:
    return struct.pack(">II", 0x0104F4C7, len(payload)) + payload


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def string(raw: bytes) -> bytes:
    return u32(len(raw)) + raw


def tensor(data: bytes, dtype: int, shape) -> bytes:
    return string(data) + bytes([dtype]) + u32(len(shape)) + b"".join(u64(d) for d in shape)


MALFORMED = [
    # (name, payload, error, message); every case is decoded at V2 except where the name says V1
    ("payload shorter than a tag", b"\x00\x00", ProtocolError, "truncated payload: message tag"),
    ("tag past the V2 enum", u32(13), ProtocolError, "unknown message tag 13"),
    ("WorkerInfo cut short", encode_payload(WorkerInfo("a", "b", "c", "d", "e", 1, 2), V2)[:-1], ProtocolError,
     "truncated payload: WorkerInfo.latency"),
    ("string longer than the payload", u32(12) + u32(1000) + b"boom", ProtocolError,
     "truncated payload: WorkerError.message needs 1000"),
    ("invalid UTF-8", u32(12) + string(b"\xff\xfe"), ProtocolError, "invalid UTF-8 in WorkerError.message"),
    ("Batch count past the payload", u32(3) + tensor(bytes(2), 4, [1]) + u32(0xFFFFFFFF), ProtocolError,
     "Batch.batch count 4294967295 claims"),
    ("layer count past the payload", u32(6) + u32(0x40000000) + string(b"x"), ProtocolError,
     "LayerAssignment.layers count 1073741824 claims"),
    ("ndim past the payload", u32(4) + string(b"") + b"\x04" + u32(0x10000000), ProtocolError,
     "TensorMessage.tensor.shape count 268435456 claims"),
    ("tensor data past the payload", u32(4) + u32(0xFFFFFFFF) + bytes(8), ProtocolError,
     "truncated payload: TensorMessage.tensor.data needs 4294967295"),
    ("unknown dtype tag", u32(4) + tensor(bytes(2), 8, [1]), BadTensor, "unknown dtype tag 8"),
    ("catch-all dtype tag", u32(4) + tensor(bytes(2), 255, [1]), BadTensor, "unknown dtype tag 255"),
    ("data shorter than the shape", u32(4) + tensor(bytes(6), 4, [1, 4]), BadTensor,
     "data is 6 bytes, shape [1, 4] of F16 needs 8"),
    ("element count overflow", u32(4) + tensor(b"", 5, [2**63, 4]), BadTensor, "overflows the element count"),
    ("HEAD's WorkerError tag at V1", u32(12) + string(b"boom"), ProtocolError, "unknown message tag 12 at protocol revision 1"),
]


@pytest.mark.parametrize(
    "payload, error, message",
    [pytest.param(p, e, m, id=name) for name, p, e, m in MALFORMED],
)
def test_malformed_payload_is_rejected_with_its_reason(payload, error, message):
    """Each malformed payload raises its own error, naming the field and the fault, through FrameDecoder too."""
    revision = Revision.V1 if "revision 1" in message else V2
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_payload(payload, revision)
    decoder = FrameDecoder(revision)
    decoder.feed(frame(payload))
    with pytest.raises(error):
        decoder.next_message()


def test_bad_magic():
    """A header with the wrong magic is rejected, naming the magic it got."""
    with pytest.raises(ProtocolError, match="invalid magic value 0xc7f40401"):
        read_header(bytes.fromhex("c7f40401 00000004"))


def test_oversized_length_is_rejected_but_the_limit_itself_is_accepted():
    """A length over 512 MiB is refused before any payload is read; exactly 512 MiB is allowed, as in Cake."""
    assert read_header(struct.pack(">II", 0x0104F4C7, MAX_PAYLOAD)) == MAX_PAYLOAD
    with pytest.raises(ProtocolError, match=f"payload length {MAX_PAYLOAD + 1} > maximum"):
        read_header(struct.pack(">II", 0x0104F4C7, MAX_PAYLOAD + 1))


def test_decoder_applies_its_own_limit():
    """FrameDecoder(max_payload=n) rejects a frame announcing n + 1 bytes as soon as the header is in."""
    decoder = FrameDecoder(V2, max_payload=100)
    decoder.feed(struct.pack(">II", 0x0104F4C7, 101))
    with pytest.raises(ProtocolError, match="payload length 101 > maximum 100"):
        decoder.next_message()


def test_bad_header_breaks_the_decoder_for_good():
    """After a bad magic the stream has no frame boundary, so every later call raises again."""
    decoder = FrameDecoder(V2)
    decoder.feed(b"\x00" * 8)
    with pytest.raises(ProtocolError, match="invalid magic"):
        decoder.next_message()
    with pytest.raises(ProtocolError, match="invalid magic"):
        decoder.feed(b"".join(encode_frame(Hello(), V2)))
    with pytest.raises(ProtocolError, match="invalid magic"):
        decoder.next_message()


def test_malformed_tensor_leaves_the_decoder_at_the_next_frame():
    """A frame whose tensor is unusable is consumed, so the frame after it decodes normally."""
    decoder = FrameDecoder(V2)
    decoder.feed(frame(u32(4) + tensor(bytes(2), 200, [1])) + b"".join(encode_frame(Hello(), V2)))
    with pytest.raises(BadTensor):
        decoder.next_message()
    assert decoder.next_message() == Hello()


def test_structural_fault_wins_over_a_bad_tensor():
    """A Batch with a bad tensor and a truncated op list is a plain ProtocolError, not BadTensor."""
    payload = u32(3) + tensor(bytes(3), 4, [1]) + u32(1) + string(b"model.layers.0") + u64(0)
    with pytest.raises(ProtocolError) as caught:
        decode_payload(payload, V2)
    assert not isinstance(caught.value, BadTensor)
    assert "Batch.batch.block_idx" in str(caught.value)


def test_trailing_bytes_are_ignored_like_speedy():
    """Bytes after a complete message are ignored, as speedy's read_from_buffer does (docs/protocol.md, Encoding)."""
    assert decode_payload(bytes.fromhex("00000000ffff"), V2) == Hello()


def test_any_nonzero_bool_reads_true_like_speedy():
    """A bool byte other than 0 or 1 reads as true, as speedy does."""
    payload = encode_payload(ModelDataChunk("a", 0, 1, b"x", compressed=False), V2)
    at = 4 + 4 + 1 + 8 + 8  # tag, filename, offset, total_size
    assert decode_payload(payload[:at] + b"\x07" + payload[at + 1 :], V2).compressed is True


@pytest.mark.parametrize(
    "msg, revision, message",
    [
        pytest.param(ModelDataResume("a", 0), Revision.V1, "does not exist at protocol revision 1", id="resume@V1"),
        pytest.param(ModelDataChunk("a", 0, 1, b"x", checksum=5), Revision.V1, "no compressed/checksum", id="crc@V1"),
        pytest.param(WorkerInfo("", "", "", "", "", -1, 0), V2, "cannot encode WorkerInfo", id="negative"),
        pytest.param(WorkerInfo("", "", "", "", "", 0, 2**128), V2, "cannot encode WorkerInfo", id="u128 overflow"),
        pytest.param(Batch(RawTensor(b"", 256, ()), ()), V2, "cannot encode Batch", id="dtype tag > u8"),
        pytest.param(Batch(RawTensor(b"", 4, ()), (LayerOp("\ud800", 0, 0),)), V2, "cannot encode", id="surrogate"),
    ],
)
def test_unencodable_messages_are_refused(msg, revision, message):
    """A message the revision cannot carry, or a value out of its field's range, raises EncodeError."""
    with pytest.raises(EncodeError, match=message):
        encode_frame(msg, revision)


def test_oversized_frame_is_not_encoded():
    """A message whose payload would pass 512 MiB is refused, as Cake's writer refuses it."""
    huge = mmap.mmap(-1, MAX_PAYLOAD)  # untouched anonymous pages: nothing is really allocated
    msg = TensorMessage(RawTensor(memoryview(huge), DType.U8, (MAX_PAYLOAD,)))
    # tag, data length, data, dtype, ndim, one dim
    with pytest.raises(EncodeError, match=f"payload of {4 + 4 + MAX_PAYLOAD + 1 + 4 + 8} bytes > maximum"):
        encode_frame(msg, V2)


def test_a_batch_with_more_ops_than_the_node_serves_is_refused_at_its_count():
    """With the node's limit of 4 ops, a Batch of 5 (or 500,000) valid ops is BadOps naming both counts,
    raised from the count alone; without a limit, MAX_ITEMS applies."""
    x = RawTensor(bytes(4), DType.F32, (1, 1, 1))
    op = LayerOp("model.layers.0", 0, 0)
    for count in (5, 500_000):
        payload = encode_payload(Batch(x, (op,) * count), Revision.V2)
        with pytest.raises(BadOps, match=f"has {count} ops; this worker serves 4 layers"):
            decode_payload(payload, Revision.V2, {"ops": 4})
    assert len(decode_payload(encode_payload(Batch(x, (op,) * 4), Revision.V2), Revision.V2, {"ops": 4}).batch) == 4
    with pytest.raises(BadOps, match=f"this worker serves {MAX_ITEMS} layers"):
        decode_payload(encode_payload(Batch(x, (op,) * (MAX_ITEMS + 1)), Revision.V2), Revision.V2)


def test_a_shape_of_more_dimensions_than_any_tensor_has_is_refused_before_it_is_built():
    """A tensor claiming a million dimensions (all there, 8 MB) is BadTensor saying how many, in a few
    words: its shape is neither built nor repeated."""
    payload = encode_payload(TensorMessage(RawTensor(b"", DType.F32, (1,) * 1_000_000)), Revision.V2)
    with pytest.raises(BadTensor, match=f"shape of 1000000 dimensions, at most {MAX_DIMS}") as error:
        decode_payload(payload, Revision.V2)
    assert len(str(error.value)) < 100


def test_a_layer_assignment_past_max_items_is_not_cake_protocol():
    """More layer names than any model has is refused from the count, before any name is read."""
    payload = encode_payload(LayerAssignment(("l.0",) * (MAX_ITEMS + 1), "0a1b2c3d"), Revision.V2)
    with pytest.raises(ProtocolError, match=f"has {MAX_ITEMS + 1} items, at most {MAX_ITEMS}"):
        decode_payload(payload, Revision.V2)
