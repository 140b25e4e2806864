"""Scheduler: which waiting work a device step takes, in what order, and how it cuts a long prompt."""

from dataclasses import dataclass

import pytest

from cakemp.device.scheduler import (
    ALONE_CHUNK,
    ALONE_STEP_S,
    GATHER_FRACTION,
    GATHER_MAX_S,
    GATHER_MIN_S,
    GATHER_PROBE,
    GATHER_STALE,
    Gathering,
    Scheduler,
    StepCost,
)
from cakemp.ipc import Clear, End


@dataclass(eq=False)
class Work:
    session: int
    tokens: int = 1


def hop(session, tokens=1):
    return Work(session, tokens)


def taken(step):
    return [(type(m).__name__, m.session) for m in (*step.controls, *(piece.work for piece in step.pieces))]


def sessions(step):
    return [piece.work.session for piece in step.pieces]


def queue(*messages, max_batch=32, prefill_chunk=128, cut=True):
    scheduler = Scheduler(max_batch, prefill_chunk, cut)
    for message in messages:
        scheduler.add(message)
    return scheduler


def test_every_waiting_decode_runs_in_one_step_up_to_the_batch_limit():
    scheduler = queue(*(hop(s) for s in range(5)), max_batch=3)
    first = scheduler.next_step()
    assert sessions(first) == [0, 1, 2] and first.tokens == 3
    assert sessions(scheduler.next_step()) == [3, 4]
    assert not scheduler and not scheduler.next_step().pieces


def test_prefill_chunks_share_a_step_within_the_token_budget_and_the_first_always_runs():
    """Chunks of 100 and 28 tokens fill a prefill budget of 128 (decodes come on top); a third (50)
    waits. A call larger than the budget that is never cut (an image component's) still runs when
    it is the step's first."""
    scheduler = queue(hop(1), hop(2, 100), hop(3), hop(4, 28), hop(5, 50), prefill_chunk=128)
    step = scheduler.next_step()
    assert sessions(step) == [1, 2, 3, 4] and step.tokens == 130
    assert sessions(scheduler.next_step()) == [5]
    huge = queue(hop(1, 500), hop(2), prefill_chunk=128, cut=False).next_step()
    assert sessions(huge) == [1, 2] and [(p.start, p.end) for p in huge.pieces] == [(0, 500), (0, 1)]


def test_a_long_prompt_is_cut_into_even_pieces_one_a_step_beside_the_decodes():
    """A 300-token prompt with a budget of 128 runs as pieces of 100, 100 and 100 tokens in three steps,
    every decode waiting running beside each; the session's later work waits for its last piece, and
    a dropped prompt's pieces run no more."""
    prompt = hop(1, 300)
    scheduler = queue(hop(2), prompt, hop(1), hop(3), prefill_chunk=128)
    steps = []
    for _ in range(3):
        step = scheduler.next_step()
        steps.append([(p.work.session, p.start, p.end, p.first, p.last) for p in step.pieces])
        scheduler.add(hop(2))
        scheduler.add(hop(3))
    assert steps == [
        [(2, 0, 1, True, True), (1, 0, 100, True, False), (3, 0, 1, True, True)],
        [(1, 100, 200, False, False), (2, 0, 1, True, True), (3, 0, 1, True, True)],
        [(1, 200, 300, False, True), (2, 0, 1, True, True), (3, 0, 1, True, True)],
    ]
    assert sessions(scheduler.next_step()) == [1, 2, 3]  # the session's decode, after its prompt
    other = hop(4, 300)
    scheduler = queue(other, hop(4))
    assert [(p.start, p.end) for p in scheduler.next_step(live={4, 9}).pieces] == [(0, 100)]
    scheduler.drop(other)
    assert [(p.work.session, p.end) for p in scheduler.next_step(live={4, 9}).pieces] == [(4, 1)]


def test_a_prompt_alone_on_its_device_runs_in_pieces_of_about_alone_step_s():
    """With no other session holding state or waiting (its own state does not count), a prompt's
    pieces are what the device computes in about ALONE_STEP_S at the rate of its last step holding a
    prompt's piece: the budget's size before any, then (1 ms a token) even pieces of at most 250
    tokens; never more than ALONE_CHUNK (even pieces of a 9000-token prompt at 1 µs a token) nor
    fewer than the budget (at 0.1 s a token). A step of decodes does not set the rate. Once another
    session holds state, what is left is cut to the budget again."""
    assert ALONE_STEP_S == 0.25 and ALONE_CHUNK == 4096

    def pieces(step):
        return [(p.start, p.end) for p in step.pieces]

    scheduler = queue(hop(1, 700), prefill_chunk=100)
    step = scheduler.next_step(live={1})
    assert pieces(step) == [(0, 100)]
    scheduler.ran(step, 0.1)  # 1 ms a token
    decodes = queue(hop(2), hop(3)).next_step()
    scheduler.ran(decodes, 10.0)  # decodes alone: no rate
    step = scheduler.next_step(live={1})
    assert pieces(step) == [(100, 300)]
    scheduler.ran(step, 20.0)  # 0.1 s a token
    step = scheduler.next_step()
    assert pieces(step) == [(300, 400)]
    scheduler.ran(step, 1e-4)  # 1 µs a token
    assert pieces(scheduler.next_step()) == [(400, 700)]
    scheduler.add(hop(1, 9000))
    assert pieces(scheduler.next_step()) == [(0, 3000)]
    assert pieces(scheduler.next_step(live={1, 2})) == [(3000, 3100)]
    scheduler.add(hop(3))  # a decode waiting shares the device as well
    assert [(p.work.session, p.start, p.end) for p in scheduler.next_step(live={1}).pieces] == [
        (1, 3100, 3200), (3, 0, 1)]


def test_a_session_runs_one_hop_per_step_and_keeps_its_order():
    """Two chunks of one prompt run in successive steps; a Clear behind a session's hop waits for it,
    and the session's later hop waits behind the Clear; another session's End runs at once."""
    scheduler = queue(hop(1, 4), hop(1, 4), Clear(1, 11), hop(1, 1), End(2, 13), hop(3))
    assert taken(scheduler.next_step()) == [("End", 2), ("Work", 1), ("Work", 3)]
    assert taken(scheduler.next_step()) == [("Work", 1)]
    assert taken(scheduler.next_step()) == [("Clear", 1), ("Work", 1)]
    assert not scheduler


def test_the_waiting_sessions_are_known():
    scheduler = queue(hop(1), hop(2), Clear(4, 9))
    assert scheduler.sessions() == {1, 2, 4} and len(scheduler) == 3


def test_a_step_awaits_its_sessions_only_while_they_come_back_within_the_window():
    """After a 40 ms step the window is 10 ms: sessions not back are awaited until they show they take
    longer than that (a master busy with other workers), and a session that skipped a step is dropped."""
    gathering = Gathering()
    assert gathering.awaited() == set() and gathering.window_s == 0.0
    gathering.stepped({1, 2, 3}, step_s=0.040, now=10.0)
    assert gathering.window_s == pytest.approx(GATHER_FRACTION * 0.040)
    assert gathering.awaited() == {1, 2, 3}  # never seen leaving before: assumed quick
    gathering.arrived(1, now=10.001)  # back in 1 ms
    gathering.arrived(2, now=10.050)  # back in 50 ms: slower than the window
    assert gathering.awaited() == {3}
    gathering.stepped({1, 2}, step_s=0.040, now=11.0)  # 3 did not come back: no longer awaited
    assert gathering.awaited() == {1}
    gathering.stepped({1, 2}, step_s=1.0, now=12.0)  # a long step: the window is capped
    assert gathering.window_s == GATHER_MAX_S
    gathering.stepped({1, 2}, step_s=0.001, now=12.5)  # a short one: it has a floor
    assert gathering.window_s == GATHER_MIN_S
    gathering.ended(1)  # its connection closed
    assert gathering.awaited() == set()  # 2 took 50 ms last time, past even the capped window


def test_a_steps_fixed_cost_is_read_off_two_batch_sizes_at_least_twice_apart():
    """Steps of F + c * k seconds: F once two sizes, the larger at least twice the smaller, have run;
    a running average of each size's times; never below 0 nor above the smaller size's step."""
    cost = StepCost()
    cost.ran(8, 0.002 + 8 * 0.0001)
    assert cost.fixed_s() is None  # one size
    cost.ran(5, 0.002 + 5 * 0.0001)
    assert cost.fixed_s() is None  # too close to tell a slope from noise
    cost.ran(2, 0.002 + 2 * 0.0001)
    assert cost.fixed_s() == pytest.approx(0.002)
    cost.ran(2, 0.0042)  # its average (0.0022) moves by a tenth of the difference: to 0.0024
    assert cost.fixed_s() == pytest.approx(0.0024 - 2 * (0.0028 - 0.0024) / 6)
    flat = StepCost()
    flat.ran(1, 0.010)
    flat.ran(4, 0.009)  # a larger batch measured faster (noise): the fixed cost is at most the smaller's step
    assert flat.fixed_s() == 0.010
    steep = StepCost()
    steep.ran(2, 0.001)
    steep.ran(8, 0.010)  # the line crosses 0 above 0 requests: no fixed cost
    assert steep.fixed_s() == 0.0


def test_a_batch_size_not_run_for_a_while_no_longer_counts():
    cost = StepCost()
    cost.ran(1, 0.005)
    for _ in range(GATHER_STALE - 1):
        cost.ran(8, 0.006)
    assert cost.fixed_s() is not None
    cost.ran(8, 0.006)  # GATHER_STALE steps since a step of 1
    assert cost.fixed_s() is None


def test_the_window_is_a_steps_fixed_cost_once_known_and_a_probe_looks_for_it_until_then():
    """With the fixed cost unknown, the window is the last step's quarter (5 ms at least), but one decode
    step in GATHER_PROBE waits for no one; once known, it is the fixed cost (capped); a step holding a
    prompt's piece teaches it nothing."""
    gathering = Gathering()
    for step in range(1, GATHER_PROBE + 1):
        gathering.stepped({1, 2}, step_s=0.004, now=float(step), decodes=2)
        assert gathering.window_s == (0.0 if step == GATHER_PROBE else GATHER_MIN_S)
    gathering.stepped({1, 2}, step_s=0.300, now=200.0, decodes=None)  # a prompt's piece: not a batch size
    assert gathering.window_s == GATHER_MAX_S and gathering.cost.steps == GATHER_PROBE
    gathering.stepped({1}, step_s=0.0035, now=201.0, decodes=1)  # 2 requests took 4 ms, 1 took 3.5: 3 ms fixed
    assert gathering.window_s == pytest.approx(0.003) and gathering.awaited() == {1}
    gathering.arrived(1, now=201.002)  # back in 2 ms: within the fixed cost, awaited next time
    gathering.stepped({1, 2}, step_s=0.004, now=202.0, decodes=2)
    assert gathering.awaited() == {1, 2}
    gathering.arrived(2, now=202.004)  # back in 4 ms: longer than a step of its own would take
    gathering.stepped({1, 2}, step_s=0.004, now=203.0, decodes=2)
    assert gathering.awaited() == {1}
    heavy = Gathering()
    heavy.stepped({1}, step_s=0.030, now=1.0, decodes=1)
    heavy.stepped({1, 2}, step_s=0.031, now=2.0, decodes=2)  # weights: ~29 ms a step whatever its rows
    assert heavy.window_s == GATHER_MAX_S


def test_a_step_of_decodes_alone_is_a_batch_size_and_one_holding_a_prompts_piece_is_not():
    scheduler = queue(hop(1), hop(2), hop(3))
    assert scheduler.next_step().decodes == 3
    scheduler = queue(hop(1), hop(2, tokens=5))
    assert scheduler.next_step().decodes is None
