"""The front ⇄ device frame codec: round trips, no copies of activation bytes, garbage refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cakemp.errors import ProtocolError
from cakemp.ipc import Activation, Clear, Done, End, Failure, Forward, Loaded, Op, Ready, decode, encode

MESSAGES = [
    Forward(7, 42, 4, (1, 3, 64), (Op(0, 5, 12), Op(1, 5, 13)), memoryview(bytearray(range(256)) * 3)[: 3 * 64 * 2]),
    Forward(2**64 - 1, 2**64 - 1, 5, (), (), b""),
    Activation(42, 3, (1, 1, 4096), memoryview(bytearray(8192)), kv_bytes=2**40 + 3),
    Clear(7, 43),
    End(7, 44),
    Done(44, 3, 123456789),
    Ready("cuda", 16 * 2**30, 16),
    Loaded(3, 16),
    Failure(45, "ContextLimitExceeded", "position 70 is past the context limit of 64 positions"),
    Failure(0, "CheckpointError", "multi\nline message"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    """decode(encode(m)) gives back m, bodies compared by their bytes."""
    back = decode(encode(msg))
    assert type(back) is type(msg)
    for field in msg.__dataclass_fields__:
        mine, theirs = getattr(msg, field), getattr(back, field)
        if field == "data":
            assert bytes(theirs) == bytes(mine)
        else:
            assert theirs == mine


def test_activation_bytes_are_handed_on_not_copied():
    """The body frame is the caller's buffer on the way out, and the received buffer on the way in."""
    data = memoryview(bytearray(1 << 20))
    frames = encode(Forward(1, 1, 5, (1, 1024, 256), (Op(0, 0, 0),), data))
    assert frames[1] is data
    assert decode(frames).data is frames[1]


@pytest.mark.parametrize("frames", [
    [b""],
    [b"\x01" * 10],
    [bytes([99]) + bytes(23)],  # unknown kind
    [bytes([1, 5, 3, 0, 0, 0, 0, 0]) + bytes(16)],  # Forward claiming 3 dims that are not there
    [bytes([1, 5, 0, 0, 0, 0, 0, 0]) + bytes(16)],  # Forward without its body frame
])
def test_garbage_is_a_protocol_error(frames):
    """Short, unknown or incomplete messages raise ProtocolError, never something else."""
    with pytest.raises(ProtocolError):
        decode(frames)


u64 = st.integers(0, 2**64 - 1)


@given(session=u64, request_id=u64, dtype=st.integers(0, 255),
       shape=st.lists(st.integers(0, 2**40), max_size=6).map(tuple),
       ops=st.lists(st.builds(Op, st.integers(0, 2**32 - 1), u64, u64), max_size=40).map(tuple),
       data=st.binary(max_size=64))
def test_any_forward_round_trips(session, request_id, dtype, shape, ops, data):
    """Every field of a Forward survives the codec at the edges of its integer range."""
    back = decode(encode(Forward(session, request_id, dtype, shape, ops, data)))
    assert (back.session, back.request_id, back.dtype, back.shape, back.ops, bytes(back.data)) == (
        session, request_id, dtype, shape, ops, data)


@given(st.lists(st.binary(max_size=80), min_size=1, max_size=3))
def test_random_frames_decode_or_raise_protocol_error(frames):
    """Arbitrary frames either decode to a message or raise ProtocolError, nothing else."""
    try:
        decode(frames)
    except ProtocolError:
        pass
