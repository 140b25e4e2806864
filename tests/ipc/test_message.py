"""The ipc frame codec: round trips, no copies of activation bytes, garbage refused, errors as codes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cakemp import errors
from cakemp.errors import BadTensor, ProtocolError
from cakemp.ipc import (
    Activation,
    Clear,
    Done,
    End,
    ErrorCode,
    Failure,
    Hop,
    Loaded,
    Op,
    Ping,
    Pong,
    Progress,
    Ready,
    Stage,
    StartFailure,
    StepReport,
    decode,
    encode,
    error_code,
    error_from,
)

ROUTE = (Stage(0, 3, (Op(0, 5, 12), Op(1, 5, 13))), Stage(2, 1, (Op(0, 5, 14),)))
MESSAGES = [
    Hop(7, 42, 4, (1, 3, 64), ROUTE, memoryview(bytearray(range(256)) * 3)[: 3 * 64 * 2], 2, 5, (123, 2**40)),
    Hop(2**64 - 1, 2**64 - 1, 5, (), (), b""),
    Activation(42, 3, (1, 1, 4096), memoryview(bytearray(8192)), chunk=4, kv=(2**40 + 3, 7)),
    Clear(7, 43),
    End(7, 44),
    Ping(),
    Pong(),
    Progress(45),
    Done(44, 3, 123456789),
    StepReport(16, 2**33),
    Ready("cuda", 16 * 2**30, 16),
    Loaded(3, 16),
    Failure(45, ErrorCode.CONTEXT_LIMIT, "position 70 is past the context limit of 64 positions", 3),
    StartFailure(ErrorCode.CHECKPOINT, "multi\nline message"),
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
    frames = encode(Hop(1, 1, 5, (1, 1024, 256), ROUTE, data))
    assert frames[1] is data
    assert decode(frames).data is frames[1]


def test_a_shape_of_any_ndim_round_trips():
    """300 dimensions (a one-byte ndim would wrap to 44) come back as sent: the device, not the header, judges them."""
    shape = (1,) * 299 + (64,)
    back = decode(encode(Hop(1, 1, 5, shape, ROUTE, bytes(256))))
    assert back.shape == shape


def test_a_field_too_large_for_the_header_is_a_request_error():
    """A dimension past 2^64 - 1 is refused as BadTensor (the master's WorkerError), not a struct error."""
    with pytest.raises(BadTensor, match="does not fit the device header"):
        encode(Hop(1, 1, 5, (2**64, 0), ROUTE, b""))


@pytest.mark.parametrize("frames", [
    [b""],
    [b"\x01" * 10],
    [bytes([99]) + bytes(23)],  # unknown kind
    [bytes([1, 5, 0, 0, 3, 0, 0, 0]) + bytes(16)],  # Hop claiming 3 dims that are not there
    [bytes([1, 5, 0, 0, 0, 0, 0, 0]) + bytes(16) + bytes([0] * 8 + [2, 0, 0, 0] + [0] * 4)],  # 2 stages, none there
    [bytes([1, 5, 0, 0, 255, 255, 255, 255]) + bytes(16)],  # 2^32 - 1 dims claimed
    [bytes([1, 5, 0, 0, 0, 0, 0, 0]) + bytes(16) + bytes(16)],  # Hop without its body frame
])
def test_garbage_is_a_protocol_error(frames):
    """Short, unknown or incomplete messages raise ProtocolError, never something else."""
    with pytest.raises(ProtocolError):
        decode(frames)


@pytest.mark.parametrize("error, code", [
    (errors.UnknownLayer("x"), ErrorCode.UNKNOWN_LAYER),
    (errors.BadTensor("x"), ErrorCode.BAD_TENSOR),
    (errors.ContextLimitExceeded("x"), ErrorCode.CONTEXT_LIMIT),
    (errors.CacheBudgetExceeded("x"), ErrorCode.CACHE_BUDGET),
    (errors.PositionGap("x"), ErrorCode.POSITION_GAP),
    (errors.DeviceLost("x"), ErrorCode.DEVICE_LOST),
    (errors.BadOps("x"), ErrorCode.BAD_OPS),
    (errors.SessionExpired("x"), ErrorCode.SESSION_EXPIRED),
    (errors.InternalError("x"), ErrorCode.INTERNAL),
    (errors.BadRequest("x"), ErrorCode.BAD_REQUEST),
    (errors.RequestError("x"), ErrorCode.REQUEST),
    (errors.CheckpointError("x"), ErrorCode.CHECKPOINT),
    (errors.ConfigError("x"), ErrorCode.CONFIG),
    (RuntimeError("x"), ErrorCode.INTERNAL),
])
def test_errors_travel_as_codes_and_come_back_as_the_same_class(error, code):
    """Each error of cakemp's tree has its code and is rebuilt as that class; anything else is INTERNAL,
    rebuilt as InternalError."""
    assert error_code(error) == code
    back = error_from(code, "message")
    assert str(back) == "message"
    if code is ErrorCode.INTERNAL:
        assert type(back) is errors.InternalError
    else:
        assert type(back) is type(error)


u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
ops = st.lists(st.builds(Op, u32, u64, u64), max_size=20).map(tuple)


@given(session=u64, request_id=u64, dtype=st.integers(0, 255),
       shape=st.lists(st.integers(0, 2**40), max_size=6).map(tuple),
       stages=st.lists(st.builds(Stage, u32, u32, ops), max_size=4).map(tuple),
       chunk=u32, chunks=u32, kv=st.lists(u64, max_size=4).map(tuple), data=st.binary(max_size=64))
def test_any_forward_round_trips(session, request_id, dtype, shape, stages, chunk, chunks, kv, data):
    """Every field of a Hop survives the codec at the edges of its integer range."""
    back = decode(encode(Hop(session, request_id, dtype, shape, stages, data, chunk, chunks, kv)))
    assert (back.session, back.request_id, back.dtype, back.shape, back.stages, back.chunk, back.chunks, back.kv,
            bytes(back.data)) == (session, request_id, dtype, shape, stages, chunk, chunks, kv, data)


@given(st.lists(st.binary(max_size=80), min_size=1, max_size=3))
def test_random_frames_decode_or_raise_protocol_error(frames):
    """Arbitrary frames either decode to a message or raise ProtocolError, nothing else."""
    try:
        decode(frames)
    except ProtocolError:
        pass
