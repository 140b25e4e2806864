"""Which setup connection holds a zero-config node, as a state machine: no process, no socket, no loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cakemp.errors import SetupError
from cakemp.setup.state import SetupPhase, SetupState


def exchange(state: SetupState, connection: str) -> None:
    """`connection`, holding the setup, runs its exchange to the end of its push."""
    assert state.may_exchange(connection)
    state.exchanging(connection)
    state.exchanged(connection)


def test_a_setup_pushes_loads_and_then_the_node_serves():
    """One connection: it holds the setup, may exchange at once, loads once pushed; serving, later setups are refused."""
    state = SetupState()
    assert state.assigned("A") is None and state.phase is SetupPhase.PUSHING
    exchange(state, "A")
    assert state.pushed("A") and state.phase is SetupPhase.LOADING
    with pytest.raises(SetupError, match="another setup is loading its layers"):
        state.assigned("B")
    state.closed("B")
    state.serving()
    state.closed("A")  # its WorkerReady sent
    assert state.phase is SetupPhase.SERVING
    with pytest.raises(SetupError, match="just been set up"):
        state.assigned("C")


def test_a_newer_setup_replaces_a_push_and_waits_until_it_has_closed_its_files():
    """B takes the setup from A at once and is told whom it replaced; it begins only once A's
    exchange has ended; A's push, even if it got whole, no longer loads."""
    state = SetupState()
    state.assigned("A")
    state.exchanging("A")
    assert state.assigned("B") == "A"
    assert not state.holds("A") and not state.may_exchange("B")
    state.exchanged("A")  # A's push aborted when it was told
    assert not state.pushed("A")
    state.closed("A")
    assert state.phase is SetupPhase.PUSHING and state.holds("B")
    exchange(state, "B")
    assert state.pushed("B")


def test_three_setups_in_quick_succession_leave_the_last_its_turn():
    """A pushes; B replaces it, and C replaces B before B began (its exchange never ran, so it
    ended nothing): C waits only for A's exchange, and B's end changes nothing for C."""
    state = SetupState()
    state.assigned("A")
    state.exchanging("A")
    assert state.assigned("B") == "A"
    assert state.assigned("C") == "B"
    assert not state.holds("B")
    state.closed("B")  # told it was replaced
    assert state.holds("C") and not state.may_exchange("C")
    state.exchanged("A")
    state.closed("A")
    exchange(state, "C")
    assert state.pushed("C")


def test_an_abandoned_or_refused_setup_frees_the_node_for_the_next():
    """The holder gone before its push ended, or its load refused: the node waits again and the next setup starts at once."""
    state = SetupState()
    state.assigned("A")
    state.closed("A")  # gone right after its assignment
    assert state.phase is SetupPhase.WAITING
    assert state.assigned("B") is None
    exchange(state, "B")
    assert state.pushed("B")
    state.closed("B")  # its layers could not load: refused
    assert state.phase is SetupPhase.WAITING
    assert state.assigned("C") is None and state.may_exchange("C")


# Steps of a random sequence, each for connection number `n`: assign, begin or end the exchange
# (as its turn allows), report the push whole, or close.
STEPS = st.lists(st.tuples(st.sampled_from(["assign", "begin", "end", "pushed", "close"]), st.integers(0, 5)),
                 max_size=60)


@settings(max_examples=300)
@given(STEPS)
def test_any_sequence_of_setup_connections_leaves_the_node_able_to_take_the_next(steps):
    """Overlapping, replaced (before or during their exchange), abandoned and refused connections, in
    any order: once each has ended as its connection would, a new setup may exchange at once and load."""
    state = SetupState()
    exchanging: set[int] = set()
    for step, n in steps:
        if step == "assign":
            try:
                state.assigned(n)
            except SetupError:
                assert state.phase is SetupPhase.LOADING
        elif step == "begin" and n not in exchanging and state.may_exchange(n):
            state.exchanging(n)
            exchanging.add(n)
        elif step == "end" and n in exchanging:
            state.exchanged(n)
            exchanging.discard(n)
        elif step == "pushed" and n in exchanging:
            state.exchanged(n)
            exchanging.discard(n)
            state.pushed(n)
        elif step == "close" and n not in exchanging:
            state.closed(n)
    for n in sorted(exchanging):  # every connection still open ends (replaced, lost or refused)
        state.exchanged(n)
        state.closed(n)
    for n in range(6):
        state.closed(n)
    assert state.phase is SetupPhase.WAITING
    assert state.assigned("next") is None and state.may_exchange("next")
    exchange(state, "next")
    assert state.pushed("next")
