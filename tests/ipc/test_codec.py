"""The ipc frame codec: round trips, no copies of activation bytes, garbage refused as this node's fault,
every message declared in one place."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Annotated, get_args, get_origin, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cakemp.ipc
from cakemp.errors import BadIpcMessage, BadTensor, NodeFault, PeerFault
from cakemp.ipc import (
    Activation,
    Answers,
    Batch,
    Clear,
    Done,
    End,
    ErrorCode,
    ExpertReport,
    Failure,
    Hop,
    Hops,
    Kind,
    Loaded,
    Op,
    Ping,
    Pong,
    PrefixReport,
    Progress,
    Ready,
    Stage,
    StartFailure,
    decode,
    encode,
    rows,
)
from cakemp.ipc.message import MESSAGES
from tests.support.spelling import identifiers

ROUTE = (Stage.of(0, 3, (Op(0, 5, 12), Op(1, 5, 13))), Stage.of(2, 1, (Op(0, 5, 14),)))
TEXT = b"position 70 is past the context limit of 64 positions"
MESSAGES_BY_HAND = [
    Hops((Hop(7, 42, 4, 3 * 64 * 2, 2, 5, (1, 3, 64), ROUTE, (123, 2**40)),
          Hop(2**64 - 1, 2**64 - 1, 5, 0, 0, 1, (), ())), memoryview(bytearray(range(256)) * 3)[: 3 * 64 * 2]),
    Hops((), b""),
    Answers((Activation(42, 3, 8192, 4, (1, 1, 4096), kv=(2**40 + 3, 7)),),
            (Failure(45, ErrorCode.CONTEXT_LIMIT, 3, 1, len(TEXT)),), (Batch(16, 2**33),),
            (PrefixReport(1, 2, 3, 4, 5),), (ExpertReport(6, 7, 8, 9),), memoryview(bytearray(8192) + TEXT)),
    Answers(),
    Clear(7, 43),
    End(7, 44),
    Ping(),
    Pong(),
    Progress(45),
    Done(44, 3, 123456789),
    Ready("cuda", 16 * 2**30, 16),
    Loaded(3, 16),
    StartFailure(ErrorCode.CHECKPOINT, "multi\nline message"),
]


def assert_same(back, msg) -> None:
    """`back` is `msg` again, bodies compared by their bytes."""
    assert type(back) is type(msg)
    for field in msg.__dataclass_fields__:
        mine, theirs = getattr(msg, field), getattr(back, field)
        if field == "data":
            assert bytes(theirs) == bytes(mine)
        else:
            assert theirs == mine


@pytest.mark.parametrize("msg", MESSAGES_BY_HAND, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    """decode(encode(m)) gives back m, bodies compared by their bytes."""
    assert_same(decode(encode(msg)), msg)


MARKS = {
    "B": st.integers(0, 2**8 - 1),
    "I": st.integers(0, 2**32 - 1),
    "Q": st.integers(0, 2**64 - 1),
    "body": st.binary(max_size=64),
    "text": st.text(max_size=24),
}


def values(hint: object) -> st.SearchStrategy:
    """Any value a field annotated `hint` can carry, from its declaration alone."""
    if get_origin(hint) is Annotated:
        base, mark = get_args(hint)
        return st.sampled_from(base) if base is ErrorCode else MARKS[mark]
    if get_origin(hint) is tuple:
        return st.lists(values(get_args(hint)[0]), max_size=4).map(tuple)
    if hint is int:  # a plain int travels as a u64
        return MARKS["Q"]
    return instances(hint)


def instances(cls: type) -> st.SearchStrategy:
    return st.builds(cls, **{name: values(hint) for name, hint in get_type_hints(cls, include_extras=True).items()})


@pytest.mark.parametrize("cls", MESSAGES.values(), ids=lambda cls: cls.__name__)
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_every_declared_message_round_trips_at_the_edges_of_its_fields(cls, data):
    """Each declared message survives the codec with any values its declaration allows: integers
    over their whole range, tuples of any length, bodies and texts."""
    msg = data.draw(instances(cls))
    assert_same(decode(encode(msg)), msg)


def test_every_kind_is_one_message():
    """Each Kind is declared by exactly one message class (a forgotten declaration cannot slip by)."""
    assert sorted(MESSAGES) == sorted(Kind)


def test_each_message_is_spelled_once_in_the_ipc_package():
    """A message's class statement is the only place the ipc package names it: the codec, the
    Message union and the exports are derived from the declarations."""
    spelled = identifiers(sorted(Path(cakemp.ipc.__file__).parent.glob("*.py")))
    assert {cls.__name__: spelled[cls.__name__] for cls in MESSAGES.values()} == {
        cls.__name__: 1 for cls in MESSAGES.values()}


def test_the_header_is_the_kind_then_the_integers_then_the_tuples():
    """The layout the codec derives, spelled out for a Hops of one Hop: kind, the count of hops, the
    hops' integers in declaration order (`to_end`, 0, the last of them), then each tuple field as every hop's count and all their
    items, laid out the same way: the route's two stages' integers, then for each column of their ops
    (layers, positions, KV slots) the stages' counts (2 and 1) and the three ops' values (plain ints as
    u64s); the bytes as a frame of their own. An untraced Hop's stamps are an empty tuple, a count of 0."""
    data = memoryview(bytearray(16))
    frames = encode(Hops((Hop(7, 42, 4, 16, 2, 5, (1, 8), ROUTE, (123,)),), data))
    expected = (struct.pack("<BI", Kind.HOPS, 1) + struct.pack("<QQBQIIQ", 7, 42, 4, 16, 2, 5, 0)
                + struct.pack("<I2Q", 2, 1, 8)
                + struct.pack("<I", 2) + struct.pack("<IIII", 0, 3, 2, 1)
                + struct.pack("<II", 2, 1) + struct.pack("<QQQ", 0, 1, 0)
                + struct.pack("<II", 2, 1) + struct.pack("<QQQ", 5, 5, 5)
                + struct.pack("<II", 2, 1) + struct.pack("<QQQ", 12, 13, 14)
                + struct.pack("<IQ", 1, 123))
    assert bytes(frames[0]) == expected + struct.pack("<I", 0)
    assert frames[1:] == [data]
    traced = encode(Hops((Hop(7, 42, 4, 16, 2, 5, (1, 8), ROUTE, (123,), trace=(10**18, 7)),), data))
    assert bytes(traced[0]) == expected + struct.pack("<I2Q", 2, 10**18, 7)
    assert decode(traced).hops[0].trace == (10**18, 7)


def test_activation_bytes_are_handed_on_not_copied():
    """The data frame is the caller's buffer on the way out, and the received buffer on the way in;
    each item's bytes are views of it, one after another."""
    data = bytearray(1 << 20)
    frames = encode(Hops((Hop(1, 1, 5, 1 << 19, 0, 1, (1, 512, 256), ROUTE), Hop(2, 2, 5, 1 << 19, 0, 1, (1, 512, 256),
                                                                                ROUTE)), data))
    assert frames[1] is data
    back = decode(frames)
    assert back.data is frames[1]
    first, second = rows(back.hops, back.data)
    data[0], data[1 << 19] = 1, 2  # the views see the received buffer itself
    assert (first.nbytes, second.nbytes, first[0], second[0]) == (1 << 19, 1 << 19, 1, 2)


def test_a_stage_read_back_gives_its_ops_and_one_whose_columns_differ_in_length_none():
    """A stage's ops travel as columns: read back, they are the ops sent; a stage whose columns differ in
    length (a bug: ops would be dropped unseen) is this node's fault where its ops are asked for."""
    [hop] = decode(encode(Hops((Hop(1, 1, 5, 0, 0, 1, (1, 1, 2), ROUTE),), b""))).hops
    assert [list(stage.ops) for stage in hop.stages] == [[Op(0, 5, 12), Op(1, 5, 13)], [Op(0, 5, 14)]]
    [hop] = decode(encode(Hops((Hop(1, 1, 5, 0, 0, 1, (1, 1, 2), (Stage(0, 3, (0, 1), (5,), (12, 13)),)),), b""))).hops
    with pytest.raises(BadIpcMessage, match="2 layers, 1 positions and 2 KV slots"):
        list(hop.stages[0].ops)


def test_items_claiming_more_bytes_than_the_message_holds_are_this_nodes_fault():
    answers = decode(encode(Answers((Activation(1, 5, 8, 0, (1, 1, 2)),), data=bytes(4))))
    with pytest.raises(BadIpcMessage, match="claim 8 bytes of its 4"):
        rows(answers.activations, answers.data)


def test_a_shape_of_any_ndim_round_trips():
    """300 dimensions (a one-byte ndim would wrap to 44) come back as sent: the device, not the header, judges them."""
    shape = (1,) * 299 + (64,)
    back = decode(encode(Hops((Hop(1, 1, 5, 256, 0, 1, shape, ROUTE),), bytes(256))))
    assert back.hops[0].shape == shape


def test_a_field_too_large_for_the_header_is_a_request_error():
    """A dimension past 2^64 - 1 is refused as BadTensor (the master's WorkerError), not a struct error."""
    with pytest.raises(BadTensor, match="does not fit the device header"):
        encode(Hops((Hop(1, 1, 5, 0, 0, 1, (2**64, 0), ROUTE),), b""))


# kind, one hop: session, request id, dtype, nbytes, chunk, chunks
HOP_FIXED = struct.pack("<BIQQBQII", Kind.HOPS, 1, 1, 1, 5, 0, 0, 1)


@pytest.mark.parametrize("frames", [
    pytest.param([b""], id="empty header"),
    pytest.param([HOP_FIXED[:-1]], id="header cut short"),
    pytest.param([bytes([99]) + bytes(23)], id="unknown kind"),
    pytest.param([HOP_FIXED + struct.pack("<I", 3)], id="3 dims claimed, none there"),
    pytest.param([HOP_FIXED + struct.pack("<I", 2**32 - 1)], id="2^32 - 1 dims claimed"),
    pytest.param([HOP_FIXED + struct.pack("<II", 0, 2)], id="2 stages claimed, none there"),
    pytest.param([HOP_FIXED + struct.pack("<IIIIII", 0, 1, 0, 0, 9, 0)], id="a stage claims 9 ops, none there"),
    pytest.param([HOP_FIXED + struct.pack("<IIII", 0, 0, 0, 0)], id="Hops without its data frame"),
    pytest.param([struct.pack("<BII", Kind.ANSWERS, 0, 1) + struct.pack("<QIIBQ", 1, 99, 0, 0, 0)
                   + struct.pack("<III", 0, 0, 0), b""], id="unknown error code"),
    pytest.param([struct.pack("<BI", Kind.START_FAILURE, 1), b"\xff"], id="text not UTF-8"),
    pytest.param([encode(Progress(5))[0] + b"junk"], id="bytes past the fields"),
    pytest.param([*encode(Progress(5)), b""], id="a frame past the message"),
    pytest.param([*encode(Hops((), b"")), b""], id="a frame past the data"),
])
def test_garbage_is_this_nodes_fault(frames):
    """Short, unknown or incomplete messages raise BadIpcMessage, a NodeFault (only cakemp writes
    these frames), never a peer's ProtocolError or anything else."""
    with pytest.raises(BadIpcMessage) as caught:
        decode(frames)
    assert isinstance(caught.value, NodeFault) and not isinstance(caught.value, PeerFault)


def test_a_steps_hops_claiming_more_elements_than_the_header_holds_are_refused_before_any_is_made():
    """Two hops whose shapes claim 2^31 dims each, and whose stages claim 2^20 ops: the sum of what
    every hop of the step claims is checked against the bytes left before a struct is made for them."""
    hop = struct.pack("<QQBQII", 1, 1, 5, 0, 0, 1)
    shapes = [struct.pack("<BI", Kind.HOPS, 2) + hop * 2 + struct.pack("<II", 2**31, 2**31), b""]
    stages = [struct.pack("<BI", Kind.HOPS, 2) + hop * 2 + struct.pack("<II", 0, 0)  # no dims
              + struct.pack("<II", 1, 1) + struct.pack("<IIII", 0, 0, 0, 0)  # a stage each
              + struct.pack("<II", 2**20, 2**20), b""]  # claiming 2^20 ops each
    for frames in (shapes, stages):
        with pytest.raises(BadIpcMessage, match="items claimed"):
            decode(frames)


u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
ops = st.lists(st.builds(Op, u32, u64, u64), max_size=20).map(tuple)


@given(session=u64, request_id=u64, dtype=st.integers(0, 255),
       shape=st.lists(st.integers(0, 2**40), max_size=6).map(tuple),
       stages=st.lists(st.builds(Stage.of, u32, u32, ops), max_size=4).map(tuple),
       chunk=u32, chunks=u32, kv=st.lists(u64, max_size=4).map(tuple), data=st.binary(max_size=64))
def test_any_hop_round_trips(session, request_id, dtype, shape, stages, chunk, chunks, kv, data):
    """Every field of a Hop survives the codec at the edges of its integer range, its bytes with it."""
    hop = Hop(session, request_id, dtype, len(data), chunk, chunks, shape, stages, kv)
    back = decode(encode(Hops((hop, hop), data + data)))
    assert back.hops == (hop, hop) and [bytes(row) for row in rows(back.hops, back.data)] == [data, data]


@given(st.lists(st.binary(max_size=80), min_size=1, max_size=3))
def test_random_frames_decode_or_raise_bad_ipc_message(frames):
    """Arbitrary frames either decode to a message or raise BadIpcMessage, nothing else."""
    try:
        decode(frames)
    except BadIpcMessage:
        pass
