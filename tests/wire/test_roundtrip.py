"""Every message survives encode → decode at both revisions, however the stream is split."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cakemp.wire import (
    HEADER_SIZE,
    Batch,
    DType,
    FrameDecoder,
    LayerOp,
    RawTensor,
    Revision,
    TensorMessage,
    decode_payload,
    encode_frame,
    encode_payload,
)
from tests.wire.strategies import declared, instances, messages

BOTH = pytest.mark.parametrize("revision", [Revision.V1, Revision.V2])


def stream_of(msgs, revision) -> bytes:
    return b"".join(piece for msg in msgs for piece in encode_frame(msg, revision))


def drain(decoder: FrameDecoder) -> list:
    out = []
    while (msg := decoder.next_message()) is not None:
        out.append(msg)
    return out


@BOTH
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_payload_round_trip(revision, data):
    """decode_payload(encode_payload(m)) == m for any message valid at the revision."""
    msg = data.draw(messages(revision))
    assert decode_payload(encode_payload(msg, revision), revision) == msg


@pytest.mark.parametrize("cls, revision", [pytest.param(cls, revision, id=f"{cls.__name__} V{revision.value}")
                                            for revision in Revision for cls in declared(revision)])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_declared_message_round_trips(cls, revision, data):
    """Each message class that exists at a revision survives encode → decode there, whole and fed
    byte by byte, with any field values its declaration allows."""
    msg = data.draw(instances(cls, revision))
    frame = b"".join(encode_frame(msg, revision))
    assert decode_payload(encode_payload(msg, revision), revision) == msg
    decoder = FrameDecoder(revision)
    got = []
    for i in range(len(frame)):
        decoder.feed(frame[i : i + 1])
        got += drain(decoder)
    assert got == [msg]


@BOTH
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_frames_fed_whole_one_byte_and_random_splits(revision, data):
    """A stream of frames decodes to the same messages fed whole, byte by byte, or in random chunks."""
    msgs = data.draw(st.lists(messages(revision), min_size=1, max_size=4))
    stream = stream_of(msgs, revision)

    whole = FrameDecoder(revision)
    whole.feed(stream)
    assert drain(whole) == msgs

    bytewise = FrameDecoder(revision)
    got = []
    for i in range(len(stream)):
        bytewise.feed(stream[i : i + 1])
        got += drain(bytewise)
    assert got == msgs

    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    split = FrameDecoder(revision)
    got = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        split.feed(stream[start:end])
        got += drain(split)
    assert got == msgs


def test_decoded_tensor_is_a_view_of_the_payload():
    """The decoded tensor's data is a memoryview into the given payload, not a copy."""
    x = RawTensor(bytes(range(256)) * 32, DType.F16, (1, 1, 4096))
    payload = bytearray(encode_payload(Batch(x, (LayerOp("model.layers.0", 0, 0),)), Revision.V2))
    decoded = decode_payload(payload, Revision.V2)
    assert isinstance(decoded.x.data, memoryview)
    payload[8] ^= 0xFF  # the data starts after the tag (4) and its length (4)
    assert decoded.x.data[0] == x.data[0] ^ 0xFF


def test_encoded_frame_keeps_tensor_data_by_reference():
    """encode_frame hands the tensor's own buffer to the writer instead of copying it."""
    data = bytearray(8192)
    pieces = encode_frame(TensorMessage(RawTensor(data, DType.F16, (1, 1, 4096))), Revision.V2)
    data[0] = 7
    assert any(isinstance(p, memoryview) and p.obj is data for p in pieces)
    assert b"".join(pieces)[16] == 7  # header (8), tag (4), data length (4), then data


def test_random_splits_of_a_long_stream():
    """Sixty frames of mixed sizes fed in random 1..300-byte chunks all come out in order."""
    rng = random.Random(2)
    msgs = [
        TensorMessage(RawTensor(rng.randbytes(2 * n), DType.BF16, (1, n, 1)))
        for n in [rng.randrange(0, 500) for _ in range(60)]
    ]
    stream = stream_of(msgs, Revision.V2)
    decoder = FrameDecoder(Revision.V2)
    got, pos = [], 0
    while pos < len(stream):
        step = rng.randrange(1, 301)
        decoder.feed(stream[pos : pos + step])
        pos += step
        got += drain(decoder)
    assert got == msgs


@pytest.mark.parametrize("together", [False, True], ids=["frame by frame", "two frames at once"])
def test_decoded_tensors_survive_later_feeds(together):
    """A tensor taken from FrameDecoder keeps its bytes while later frames are fed and decoded."""
    first = TensorMessage(RawTensor(b"\x11" * 64, DType.F16, (1, 32)))
    second = TensorMessage(RawTensor(b"\x22" * 64, DType.F16, (1, 32)))
    decoder = FrameDecoder(Revision.V2)
    decoder.feed(stream_of([first, second] if together else [first], Revision.V2))
    got = decoder.next_message()
    decoder.feed(stream_of([second], Revision.V2))
    assert drain(decoder) == ([second, second] if together else [second])
    assert got == first


def test_the_header_alone_tells_the_size_and_the_payload_is_counted_down_as_it_comes():
    """A reader that acts between header and payload: `frame_size` once the 8 header bytes are in,
    `missing` and `received` as the payload comes in pieces, and the next frame's bytes after it kept."""
    msg = TensorMessage(RawTensor(bytes(range(200)), DType.F16, (1, 100)))
    stream = stream_of([msg], Revision.V2)
    size = len(stream) - HEADER_SIZE
    decoder = FrameDecoder(Revision.V2)
    decoder.feed(stream[:5])
    assert (decoder.frame_size(), decoder.missing()) == (None, HEADER_SIZE - 5)
    decoder.feed(stream[5:HEADER_SIZE])
    assert (decoder.frame_size(), decoder.missing(), decoder.received()) == (size, size, b"")
    decoder.feed(stream[HEADER_SIZE:HEADER_SIZE + 10])
    assert (decoder.missing(), decoder.received()) == (size - 10, stream[HEADER_SIZE:HEADER_SIZE + 10])
    decoder.feed(stream[HEADER_SIZE + 10:] + stream)
    assert decoder.missing() == 0
    assert drain(decoder) == [msg, msg]
