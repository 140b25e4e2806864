"""One master session's rules, driven by decoded messages: no process, no socket, no loop."""

from __future__ import annotations

import pytest

from cakemp.errors import BadTensor, InternalError, SessionExpired, UnknownLayer
from cakemp.front.admission import LayerAdmission
from cakemp.front.session import Close, Forward, Greet, Note, Refuse, Reply, Reset, Session, SessionState
from cakemp.wire import (
    Batch,
    DType,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOp,
    RawTensor,
    SingleOp,
    WorkerError,
    WorkerReady,
)

LAYERS = ("model.layers.0", "model.layers.1")
HIDDEN = 4
ADMISSION = LayerAdmission(frozenset(LAYERS), hidden_size=HIDDEN, max_context=16, blocks=frozenset({0, 1}))
SERVED = LayerAssignment(LAYERS, "0123abcd")
IDLE = 30.0


def tokens(count: int) -> RawTensor:
    return RawTensor(bytes(count * HIDDEN * 4), DType.F32, (1, count, HIDDEN))


def batch(index_pos: int = 0, count: int = 1) -> Batch:
    return Batch(tokens(count), tuple(LayerOp(layer, index_pos, i) for i, layer in enumerate(LAYERS)))


def greeted(**options) -> Session:
    session = Session(ADMISSION, **options)
    assert session.received(Hello()) == [Greet()]
    return session


def test_hello_opens_the_session_and_requests_are_admitted_then_run():
    """Hello is greeted; a Batch, and a SingleOp as a run of one op, go to be run as they came."""
    session = greeted()
    assert session.state is SessionState.OPEN
    x = tokens(3)
    assert session.received(Batch(x, (LayerOp(LAYERS[1], 0, 1),))) == [Forward(x, (LayerOp(LAYERS[1], 0, 1),))]
    assert session.received(SingleOp(LAYERS[0], x, 5, 0)) == [Forward(x, (LayerOp(LAYERS[0], 5, 0),))]


def test_a_request_that_may_not_run_is_refused_and_the_session_goes_on():
    """Admission's error is the refusal; the next good request runs."""
    session = greeted()
    [refused] = session.received(Batch(tokens(1), (LayerOp("model.layers.9", 0, 0),)))
    assert isinstance(refused, Refuse) and isinstance(refused.error, UnknownLayer)
    [refused] = session.received(Batch(RawTensor(b"", DType.F32, (1, 1, HIDDEN)), ()))
    assert isinstance(refused, Refuse) and isinstance(refused.error, BadTensor)
    assert isinstance(session.received(batch())[0], Forward)


def test_the_first_message_must_be_hello_or_a_re_setup():
    """Anything else first ends the connection with a warning naming it; nothing after it counts."""
    session = Session(ADMISSION)
    assert session.received(batch()) == [
        Note("warning", "unexpected first message (expected Hello)", {"message": "Batch", "fault": "peer"}), Close()]
    assert session.state is SessionState.CLOSED
    assert session.received(Hello()) == []


def test_a_re_setup_is_answered_ready_unless_it_asks_for_another_model_or_layers():
    """A restarted master's LayerAssignment: Ack(false) and WorkerReady on a node without a setup or
    with the same one; a zero-config node set up otherwise refuses it, naming both; then the connection ends."""
    accepted = [Note("info", "master re-setup: accepting layer assignment", {"layers": 2}),
                Reply(LayerAssignmentAck(needs_data=False)), Reply(WorkerReady()), Close()]
    assert Session(ADMISSION).received(SERVED) == accepted
    assert Session(ADMISSION, served=SERVED).received(SERVED) == accepted
    other = LayerAssignment(("model.layers.0",), "ffff0000")
    note, reply, close = Session(ADMISSION, served=SERVED).received(other)
    assert note == Note("warning", "master re-setup with another assignment: refused",
                        {"layers": 1, "model_hash": "ffff0000"})
    assert reply == Reply(WorkerError("this node serves model.layers.0..model.layers.1 (2 layers) of model 0123abcd; "
                                      "restart it to take model.layers.0 of model ffff0000"))
    assert close == Close()


def test_goodbye_clears_every_device_the_session_used_and_is_greeted():
    """The devices its requests reached, in order; none before it sent any."""
    session = greeted()
    assert session.received(Goodbye()) == [Reset(()), Greet()]
    assert session.joined(1) and session.joined(0) and not session.joined(1)
    assert session.received(Goodbye()) == [Reset((0, 1)), Greet()]
    assert session.devices == (0, 1)


def test_any_other_message_ends_the_session():
    """A message a master never sends mid-session (a second Hello, a setup) closes the connection."""
    for message in (Hello(), SERVED):
        session = greeted()
        assert session.received(message) == [
            Note("warning", "unexpected message, closing", {"message": type(message).__name__, "fault": "peer"}),
            Close()]


def test_an_idle_session_has_its_state_freed_and_is_told_once_when_it_relies_on_it():
    """Idle expiry applies once the session has state somewhere; it clears that state; the next
    request past position 0 is refused with SessionExpired, once; after that requests run."""
    session = greeted(idle_timeout=IDLE)
    assert session.idle_after() is None  # no state anywhere yet
    session.joined(0)
    assert session.idle_after() == IDLE
    assert session.idle() == [Reset((0,)), Note("info", "session idle: freed its KV state", {"idle_timeout": IDLE})]
    assert session.idle_after() is None  # freed already: nothing more to watch
    [refused] = session.received(batch(index_pos=4))
    assert isinstance(refused, Refuse) and isinstance(refused.error, SessionExpired)
    assert "idle for more than 30 s" in str(refused.error)
    assert isinstance(session.received(batch(index_pos=5))[0], Forward)
    assert session.idle_after() == IDLE


@pytest.mark.parametrize("fresh_start", ["prefill", "goodbye"])
def test_a_fresh_start_after_expiry_is_never_refused(fresh_start):
    """After expiry a prefill at position 0 runs, and so does what follows it; so after Goodbye."""
    session = greeted(idle_timeout=IDLE)
    session.joined(0)
    session.idle()
    if fresh_start == "prefill":
        assert isinstance(session.received(batch(index_pos=0, count=3))[0], Forward)
    else:
        assert session.received(Goodbye()) == [Reset((0,)), Greet()]
    assert isinstance(session.received(batch(index_pos=3))[0], Forward)


def test_a_refusal_before_the_expiry_check_leaves_the_session_to_be_told():
    """A request admission refuses is not the one told of the expiry: the next that relies on the state is."""
    session = greeted(idle_timeout=IDLE)
    session.joined(0)
    session.idle()
    [refused] = session.received(Batch(tokens(1), (LayerOp("model.layers.9", 4, 0),)))
    assert isinstance(refused.error, UnknownLayer) and not isinstance(refused.error, InternalError)
    [refused] = session.received(batch(index_pos=4))
    assert isinstance(refused.error, SessionExpired)
