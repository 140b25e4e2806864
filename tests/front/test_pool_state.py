"""The pool's state machine, driven by events and an injected clock: no process, no socket, no loop."""

from __future__ import annotations

import pytest

from cakemp.errors import CakempError, ConfigError, DeviceLost, PositionGap
from cakemp.front.pool_state import (
    BACKOFF_FIRST_S,
    Backoff,
    Complete,
    DeviceState,
    Failed,
    Forget,
    GiveUp,
    Kill,
    Killing,
    PoolState,
    Probe,
    Reloading,
    Restarted,
    RestartFailed,
    Restarting,
    Serving,
    Spawn,
    Started,
    StartFailed,
    Starting,
)

TIMEOUT = 10.0
LOAD_SILENCE = 100.0
ATTEMPTS = 3


def fresh(devices: int = 2) -> PoolState:
    return PoolState([f"cpu:{i}" for i in range(devices)], request_timeout=TIMEOUT, load_silence=LOAD_SILENCE,
                     restart_attempts=ATTEMPTS)


def serving(devices: int = 2) -> PoolState:
    """A pool whose devices all started at t=0 and are ready."""
    state = fresh(devices)
    state.start(0.0)
    for device in range(devices):
        state.ready(device, 0.0)
    return state


def test_start_spawns_every_device_and_reports_started_once_all_are_ready():
    """Each device is spawned as generation 1; Started comes with the last Ready, not before."""
    state = fresh(3)
    assert state.start(0.0) == [Spawn(0, 1), Spawn(1, 1), Spawn(2, 1)]
    assert [state.state(d) for d in range(3)] == [DeviceState.STARTING] * 3
    assert state.ready(0, 1.0) == [] and state.ready(2, 1.0) == []
    assert state.ready(1, 2.0) == [Started()]
    assert [state.state(d) for d in range(3)] == [DeviceState.READY] * 3
    assert state.next_deadline() is None


def test_a_first_start_that_fails_fails_the_node():
    """A StartFailure during the first start is StartFailed with the device's own error; so is a death while loading."""
    state = fresh()
    state.start(0.0)
    error = ConfigError("no such checkpoint")
    assert state.start_failed(0, 1.0, error) == [StartFailed(0, error)]
    assert state.state(0) is DeviceState.FAILED
    [failed] = state.exited(1, 2.0, -9)
    assert isinstance(failed, StartFailed) and str(failed.error) == "device cpu:1 died (exit code -9)"


def test_a_device_silent_while_loading_is_killed_and_its_exit_says_why():
    """No Loaded for LOAD_SILENCE seconds: Kill; a Loaded before then moves the deadline."""
    state = fresh(1)
    state.start(0.0)
    assert state.next_deadline() == LOAD_SILENCE
    state.heard(0, 50.0)  # a layer loaded
    assert state.tick(LOAD_SILENCE) == []
    assert state.tick(50.0 + LOAD_SILENCE) == [Kill(0, f"loaded no layer within {LOAD_SILENCE:g} s")]
    assert state.tick(60.0 + LOAD_SILENCE) == []  # killed once
    [failed] = state.exited(0, 200.0, -9)
    assert str(failed.error) == f"device cpu:0 loaded no layer within {LOAD_SILENCE:g} s"


def test_a_request_is_complete_once_every_chunk_sent_is_answered():
    """Three chunks: answers before the last send do not complete it; the last answer after sealing does."""
    state = serving()
    state.admit(1, (0, 1), (False, False))
    state.sent(7, 1, (0, 1), 0.0)
    state.sent(7, 1, (0, 1), 0.0)
    assert state.answered(1, 7, 1.0) == []
    state.sent(7, 1, (0, 1), 1.0)
    assert state.sealed(7) == []
    assert state.waiting(0) == state.waiting(1) == 1
    assert state.answered(1, 7, 2.0) == []
    assert state.answered(1, 7, 3.0) == [Complete(7, None)]
    assert not state.owed(7) and state.waiting(0) == 0
    assert state.answered(1, 7, 4.0) == []  # a late answer is ignored


def test_a_failed_chunk_fails_the_request_once_all_chunks_are_answered():
    """The first failure is the request's error; it is reported when the last chunk has its answer (after device
    0, which ran chunk 0 before device 1 failed it, and device 1 forget the session: nothing half-applied stays)."""
    state = serving()
    state.sent(3, 1, (0, 1), 0.0)
    state.sent(3, 1, (0, 1), 0.0)
    state.sealed(3)
    first, second = PositionGap("chunk 0"), PositionGap("chunk 1")
    assert state.answered(1, 3, 1.0, first) == []
    assert state.answered(1, 3, 1.0, second) == [Forget(0, 1), Forget(1, 1), Complete(3, first)]


def test_each_device_counts_the_requests_it_owes_until_each_is_answered_failed_or_stopped():
    """`waiting(d)` counts every request whose route passes d, once however often it passes, and
    drops it as it completes, as its device dies, and at the stop."""
    state = serving(3)
    for request_id, route in ((1, (0,)), (2, (0, 1)), (3, (1, 0, 1)), (4, (2,))):
        state.sent(request_id, request_id, route, 0.0)
        state.sealed(request_id)
    assert [state.waiting(d) for d in range(3)] == [3, 2, 1]
    assert state.answered(0, 1, 1.0) == [Complete(1, None)]
    assert [state.waiting(d) for d in range(3)] == [2, 2, 1]
    state.exited(1, 2.0, -9)  # requests 2 and 3 pass device 1: they fail with it
    assert not state.owed(2) and not state.owed(3) and [state.waiting(d) for d in range(3)] == [0, 0, 1]
    state.stop()
    assert [state.waiting(d) for d in range(3)] == [0, 0, 0]


def test_a_request_never_sent_is_never_owed():
    """Admission alone registers nothing: no deadline, no device owes it (a send that failed leaves nothing)."""
    state = serving()
    state.admit(1, (0, 1), (False, False))
    assert state.next_deadline() is None and state.waiting(0) == 0
    assert state.sealed(99) == [] and state.tick(1e9) == []


def test_a_silent_request_pings_its_route_then_kills_only_the_silent_device():
    """After TIMEOUT without a word the route's devices are pinged; the one that answers (Pong) lives,
    the one still silent another TIMEOUT later is killed, and its exit fails the request."""
    state = serving()
    state.sent(5, 1, (0, 1), 0.0)
    state.sealed(5)
    assert state.next_deadline() == TIMEOUT
    assert state.tick(TIMEOUT - 1) == []
    assert state.tick(TIMEOUT) == [Probe(0), Probe(1)]
    state.heard(0, TIMEOUT + 0.1)  # device 0's Pong
    assert state.tick(2 * TIMEOUT) == [Kill(1, f"did not answer within {TIMEOUT:g} s")]
    forget, complete, restarting = state.exited(1, 2 * TIMEOUT + 1, -9)
    assert forget == Forget(0, 1)  # what device 0 may have run of it is dropped
    assert isinstance(complete, Complete) and complete.request_id == 5 and isinstance(complete.error, DeviceLost)
    assert str(complete.error) == f"device cpu:1 did not answer within {TIMEOUT:g} s"
    assert restarting == Restarting(1, f"did not answer within {TIMEOUT:g} s")


def test_a_request_waiting_behind_a_long_one_on_a_live_device_is_not_a_hang():
    """Progress on another request (or a Pong) keeps the device alive: the silent request is re-armed, not killed."""
    state = serving(1)
    state.sent(1, 1, (0,), 0.0)  # a long prefill
    state.sent(2, 2, (0,), 0.0)  # queued behind it
    state.sealed(1)
    state.sealed(2)
    state.progressed(0, 1, TIMEOUT - 1)
    assert state.tick(TIMEOUT) == [Probe(0)]  # request 2 went silent
    state.progressed(0, 1, TIMEOUT + 5)
    assert state.tick(2 * TIMEOUT) == []  # device 0 is alive: no kill
    assert state.owed(1) and state.owed(2) and state.state(0) is DeviceState.READY


def test_progress_on_a_request_moves_its_deadline():
    """A device computing a long request reports progress; that request is never pinged while it does."""
    state = serving(1)
    state.sent(1, 1, (0,), 0.0)
    state.sealed(1)
    for t in range(5, 100, 5):
        state.progressed(0, 1, float(t))
        assert state.tick(float(t)) == []
    assert state.next_deadline() == 95.0 + TIMEOUT


def test_the_next_deadline_is_the_earliest_whichever_request_was_heard_of_last():
    """Deadlines move as requests are heard of (progress, an answered chunk, a Probe): the next is always
    the earliest owed, and a tick probes the requests due and no other."""
    state = serving(2)
    state.sent(1, 1, (0, 1), 0.0)
    state.sent(2, 2, (0, 1), 1.0)
    state.sent(2, 2, (0, 1), 1.0)  # a prompt in two chunks
    state.sent(3, 3, (0, 1), 2.0)
    for request_id in (1, 2, 3):
        state.sealed(request_id)
    state.progressed(0, 1, 3.0)  # request 1 heard of last: 2's deadline is now the next
    assert state.next_deadline() == 1.0 + TIMEOUT
    state.answered(1, 2, 4.0)  # its first chunk: 3's now
    assert state.next_deadline() == 2.0 + TIMEOUT
    assert state.tick(2.0 + TIMEOUT) == [Probe(0), Probe(1)]  # request 3 alone went silent
    assert state.next_deadline() == 3.0 + TIMEOUT
    assert state.tick(3.0 + TIMEOUT) == [Probe(0), Probe(1)]  # then request 1
    assert state.next_deadline() == 4.0 + TIMEOUT  # request 2's, probed neither time
    state.heard(0, 13.0)  # device 0 answered the Probes, device 1 did not
    actions = state.tick(2.0 + 2 * TIMEOUT)  # request 2 due, and request 3 probed a timeout ago
    assert actions[:2] == [Probe(0), Probe(1)] and [a.device for a in actions if isinstance(a, Kill)] == [1]
    assert state.next_deadline() == 3.0 + 2 * TIMEOUT  # request 1's, probed once


def test_a_death_fails_only_the_requests_through_that_device_and_restarts_it():
    """Requests routed through the dead device fail with DeviceLost; others stay owed; the device restarts
    after the first backoff as the next generation and is Restarted on its Ready."""
    state = serving()
    state.sent(1, 1, (0, 1), 0.0)
    state.sent(2, 2, (0,), 0.0)
    actions = state.exited(1, 5.0, -9)
    assert [(type(a), getattr(a, "request_id", None)) for a in actions] == [(Forget, None), (Complete, 1),
                                                                            (Restarting, None)]
    assert str(actions[1].error) == "device cpu:1 died (exit code -9)" and isinstance(actions[1].error, DeviceLost)
    assert state.owed(2) and state.state(1) is DeviceState.RESTARTING
    with pytest.raises(DeviceLost, match="device cpu:1 is restarting after it died"):
        state.admit(3, (1,), (False,))
    assert state.next_deadline() == 5.0 + BACKOFF_FIRST_S
    assert state.tick(5.0 + BACKOFF_FIRST_S) == [Spawn(1, 2)]
    assert state.generation(1) == 2
    assert state.ready(1, 7.0) == [Restarted(1)]
    assert state.state(1) is DeviceState.READY


def test_restart_attempts_back_off_and_the_pool_gives_up_after_the_last():
    """Each failed restart (its StartFailure, then its exit) is counted with its error; the backoff doubles;
    after ATTEMPTS in a row the device is FAILED and the pool gives up."""
    state = serving(1)
    state.exited(0, 0.0, -9)
    now = BACKOFF_FIRST_S
    for attempt in range(1, ATTEMPTS + 1):
        assert state.tick(now) == [Spawn(0, attempt + 1)]
        assert state.start_failed(0, now + 1, CakempError("model.safetensors is gone")) == [
            Kill(0, "model.safetensors is gone")]
        actions = state.exited(0, now + 2, 1)
        assert actions[0] == RestartFailed(0, attempt, "model.safetensors is gone")
        if attempt < ATTEMPTS:
            assert len(actions) == 1
            assert state.next_deadline() == now + 2 + BACKOFF_FIRST_S * 2**attempt
            now = state.next_deadline()
    assert actions[1] == GiveUp(f"device cpu:0 failed to start {ATTEMPTS} times in a row (last: model.safetensors is gone)")
    assert state.state(0) is DeviceState.FAILED and state.next_deadline() is None


def test_a_successful_restart_resets_the_attempt_count():
    """Ready after a failed attempt puts the count back to zero: the next failure starts from the first backoff."""
    state = serving(1)
    state.exited(0, 0.0, -9)
    state.tick(BACKOFF_FIRST_S)
    state.exited(0, 1.0, 1)  # attempt 1 died while loading
    state.tick(10.0)
    assert state.ready(0, 11.0) == [Restarted(0)]
    assert state.exited(0, 20.0, -9)[-1] == Restarting(0, "died (exit code -9)")
    assert state.next_deadline() == 20.0 + BACKOFF_FIRST_S


def test_a_session_that_lost_its_state_is_told_once_and_only_when_it_relies_on_it():
    """After a restart a session's request past position 0 on that device gets DeviceLost once; the next
    goes ahead; a fresh prefill (position 0) is never refused; Goodbye forgets the loss."""
    state = serving()
    for session in (1, 2, 3):
        state.admit(session, (0, 1), (False, False))
    state.exited(1, 0.0, -9)
    state.tick(BACKOFF_FIRST_S)
    state.ready(1, 1.0)
    with pytest.raises(DeviceLost, match="device cpu:1 restarted; this session's KV state was lost"):
        state.admit(1, (0, 1), (True, True))
    state.admit(1, (0, 1), (True, True))  # told once
    state.admit(2, (0, 1), (True, False))  # relies on device 0 only: goes ahead, and the loss is forgotten
    state.admit(2, (1,), (True,))
    state.cleared(1, 3)
    state.admit(3, (1,), (True,))


def test_a_session_ended_is_forgotten_everywhere():
    """After End a session's loss is no longer remembered, and a new death does not count it."""
    state = serving(1)
    state.admit(1, (0,), (False,))
    state.ended(0, 1)
    state.exited(0, 0.0, -9)
    state.tick(BACKOFF_FIRST_S)
    state.ready(0, 1.0)
    state.admit(1, (0,), (True,))


def test_stop_fails_every_request_and_ends_restarts():
    """Stopping completes every owed request naming its route's devices as stopping; a death afterwards restarts nothing."""
    state = serving()
    state.sent(1, 1, (0, 1), 0.0)
    [done] = state.stop()
    assert isinstance(done, Complete) and str(done.error) == "devices cpu:0, cpu:1 are stopping"
    assert state.exited(0, 1.0, 0) == [] and state.state(0) is DeviceState.STOPPED
    with pytest.raises(DeviceLost, match="is stopping"):
        state.admit(2, (0,), (False,))
    assert state.next_deadline() is None


def test_a_late_ready_of_a_process_already_gone_changes_nothing():
    """A Ready arriving after the device's exit (RESTARTING, not loading) neither marks it ready nor restarts it."""
    state = serving(1)
    state.exited(0, 0.0, -9)
    assert state.ready(0, 0.1) == [] and state.state(0) is DeviceState.RESTARTING


def test_each_phase_carries_what_it_needs_through_a_restart():
    """A hung device: Killing (with why) while still READY, Backoff with its failure and respawn time,
    Reloading as the next generation, Killing with its start error, Backoff counting the attempt."""
    state = serving(1)
    state.sent(1, 1, (0,), 0.0)
    state.sealed(1)
    state.tick(TIMEOUT)
    state.tick(2 * TIMEOUT)
    hung = f"did not answer within {TIMEOUT:g} s"
    assert state.phase(0) == Killing(hung, Serving()) and state.state(0) is DeviceState.READY
    state.exited(0, 21.0, -9)
    assert state.phase(0) == Backoff(hung, 0, 21.0 + BACKOFF_FIRST_S)
    state.tick(21.0 + BACKOFF_FIRST_S)
    assert state.phase(0) == Reloading(hung, 0) and state.generation(0) == 2
    state.start_failed(0, 22.0, CakempError("out of memory"))
    assert state.phase(0) == Killing("out of memory", Reloading(hung, 0))
    with pytest.raises(DeviceLost, match=f"device cpu:0 is restarting after it {hung}"):
        state.admit(2, (0,), (False,))
    state.exited(0, 23.0, -9)
    assert state.phase(0) == Backoff(hung, 1, 23.0 + 2 * BACKOFF_FIRST_S)


def test_a_ready_or_start_failure_from_a_process_being_killed():
    """A process killed for its silence while loading: its late Ready changes nothing (its exit
    follows), and its StartFailure during the first start fails the node with the device's own error."""
    state = fresh(2)
    state.start(0.0)
    assert state.tick(LOAD_SILENCE) == [Kill(0, f"loaded no layer within {LOAD_SILENCE:g} s"),
                                        Kill(1, f"loaded no layer within {LOAD_SILENCE:g} s")]
    assert state.ready(0, LOAD_SILENCE + 1) == []
    assert isinstance(state.phase(0), Killing) and state.state(0) is DeviceState.STARTING
    error = ConfigError("no such checkpoint")
    assert state.start_failed(1, LOAD_SILENCE + 1, error) == [StartFailed(1, error)]
    assert state.phase(1) == Failed()
    [failed] = state.exited(0, LOAD_SILENCE + 2, -9)
    assert str(failed.error) == f"device cpu:0 loaded no layer within {LOAD_SILENCE:g} s"


def test_a_hop_for_a_replaced_process_is_refused_by_name():
    """`unusable` is None for the current generation of a serving device, and says why otherwise."""
    state = serving(1)
    assert state.unusable(0, 1) is None and state.phase(0) == Serving()
    state.exited(0, 0.0, -9)
    assert str(state.unusable(0, 1)) == "device cpu:0 is restarting after it died (exit code -9)"
    state.tick(BACKOFF_FIRST_S)
    state.ready(0, 1.0)
    assert str(state.unusable(0, 1)) == "device cpu:0 restarted" and state.unusable(0, 2) is None
    assert fresh(1).phase(0) == Starting()


def three_devices(stateful: bool = True) -> PoolState:
    """Three ready devices, of requests that keep state on them (a text model's) or none (image components)."""
    state = PoolState(["cpu:0", "cpu:1", "cpu:2"], request_timeout=TIMEOUT, load_silence=LOAD_SILENCE,
                      restart_attempts=ATTEMPTS, stateful=stateful)
    state.start(0.0)
    for device in range(3):
        state.ready(device, 0.0)
    return state


def test_a_request_failing_after_part_of_it_ran_drops_the_sessions_state_on_its_route():
    """A prompt whose second chunk fails on the last device: chunk 0 stays written on every device of its route
    (a device rolls back the step that failed, not the request's earlier ones), so every one of them forgets
    the session (Forget, before the request completes), and its next request relying on them is told once."""
    state = three_devices()
    state.admit(1, (0, 1, 2), (False, False, False))
    for _ in range(2):
        state.sent(5, 1, (0, 1, 2), 0.0)
    state.sealed(5)
    assert state.answered(2, 5, 1.0) == []  # chunk 0 went through every device
    failure = PositionGap("over the budget")
    assert state.answered(2, 5, 2.0, failure, chunk=1) == [Forget(0, 1), Forget(1, 1), Forget(2, 1),
                                                           Complete(5, failure)]
    with pytest.raises(DeviceLost, match="failed part-way, after part of it had run: its state on device cpu:0 was "
                                         "dropped rather than kept half-applied.*start again with a fresh prefill"):
        state.admit(1, (0, 1, 2), (True, True, True))
    state.admit(1, (0, 1, 2), (True, True, True))  # told once


def test_image_components_failing_part_way_forget_nothing():
    """Requests that keep no state (image components) leave nothing half-applied to drop."""
    state = three_devices(stateful=False)
    state.sent(5, 1, (0, 1), 0.0)
    state.sealed(5)
    failure = PositionGap("refused")
    assert state.answered(1, 5, 1.0, failure) == [Complete(5, failure)]


def test_a_request_refused_before_anything_ran_leaves_the_state_alone():
    """The first chunk failing on the route's first device ran nowhere: no Forget, nothing lost."""
    state = three_devices()
    state.sent(6, 1, (0, 2), 0.0)
    state.sent(6, 1, (0, 2), 0.0)
    state.sealed(6)
    failure = PositionGap("index_pos 9")
    assert state.answered(0, 6, 1.0, failure, chunk=0) == []
    assert state.answered(0, 6, 1.0, failure, chunk=1) == [Complete(6, failure)]
    state.admit(1, (0, 2), (True, True))


def test_a_death_on_the_route_drops_the_state_the_other_devices_advanced():
    """Device 2 dies under a request that device 0 already ran: device 0 forgets the session too."""
    state = three_devices()
    state.admit(1, (0, 2), (False, False))
    state.sent(8, 1, (0, 2), 0.0)
    actions = state.exited(2, 1.0, -9)
    assert actions[:2] == [Forget(0, 1), Complete(8, actions[1].error)] and isinstance(actions[1].error, DeviceLost)
    with pytest.raises(DeviceLost, match="its state on device cpu:0 was dropped"):
        state.admit(1, (0,), (True,))
