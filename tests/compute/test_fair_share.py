"""A full KV budget shared out among masters' addresses (compute/fair_share.py), through a BlockRunner:
a source under its share is given room by the source most past its own, least recently asked first,
never from a session of the step; a session given up is told so until it starts again at 0."""

import pytest
import torch

from cakemp.compute.fair_share import GIVEN_UP
from cakemp.compute.runner import BlockRunner, Request
from cakemp.errors import CacheBudgetExceeded
from cakemp.sources import session_id, session_source
from tests.support.checkpoints import make_checkpoint
from tests.support.tolerance import assert_close

LAYERS = ["model.layers.0", "model.layers.1"]
# Four sessions of 31 positions (two blocks of 16 in each of two layers: 4 x 4 KiB) fill it.
BUDGET = 4 * 4 * 16 * 256
A = [session_id("10.0.0.1", serial) for serial in range(1, 6)]  # one master's connections
B = [session_id("10.0.0.2", serial) for serial in range(1, 3)]  # another's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def load(checkpoint, budget=BUDGET) -> BlockRunner:
    return BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32, kv_budget_bytes=budget)


def ops(runner, position):
    return runner.ops([(layer, position, i) for i, layer in enumerate(LAYERS)])


def x(T, seed=0):
    return torch.randn(1, T, 64, generator=torch.Generator().manual_seed(seed))


def filled(checkpoint) -> BlockRunner:
    """A runner whose budget A's first four sessions fill (31 positions each), A[0] asked last."""
    runner = load(checkpoint)
    for session in (*A[1:4], A[0]):
        runner.run(session, x(31, session % 97), ops(runner, 0))
    assert runner.cache.room() < 4 * 4096
    return runner


def test_session_ids_carry_their_source():
    assert session_source(A[0]) == session_source(A[4]) != session_source(B[0])
    assert A[0] != A[1] and session_source(7) == 0  # a test's small ids: one source


def test_a_source_under_its_share_takes_room_from_the_one_past_its_own(checkpoint):
    runner, reference = filled(checkpoint), load(checkpoint, None)
    prompt = x(31, 5)
    assert_close(runner.run(B[0], prompt, ops(runner, 0)), reference.run(B[0], prompt, ops(reference, 0)))
    # A's least recently asked session (A[1]) was given up for it, and is told so until it starts again.
    with pytest.raises(CacheBudgetExceeded) as given_up:
        runner.run(A[1], x(1), ops(runner, 31))
    assert str(given_up.value) == GIVEN_UP
    for session in (A[2], A[3], A[0]):
        runner.run(session, x(1), ops(runner, 31))


def test_a_source_asking_past_its_share_is_refused_and_the_other_keeps_its_sessions(checkpoint):
    runner = filled(checkpoint)
    with pytest.raises(CacheBudgetExceeded, match="budget is left"):  # 3 of 4 sessions' room: past a half
        runner.run(B[0], x(3 * 32 - 1), ops(runner, 0))
    for session in A[:4]:
        runner.run(session, x(1), ops(runner, 31))


def test_one_source_alone_is_first_come_first_served(checkpoint):
    runner = filled(checkpoint)
    with pytest.raises(CacheBudgetExceeded, match="budget is left"):
        runner.run(A[4], x(31), ops(runner, 0))
    for session in A[:4]:
        runner.run(session, x(1), ops(runner, 31))


def test_a_source_in_every_step_gives_up_its_session_once_the_step_is_computed(checkpoint):
    """A's four sessions decode in every step, as a master sending a row for each of its sessions at every
    step would (rewriting their last one: they never grow), and B's prompt comes in beside them: none is
    given up under the step (their slots are reserved), so B's prompt is refused and each decode
    answered; once the step is computed A's least recently asked session is given up, so that in the
    next such step B's prompt is computed, and that session is told why."""

    def step():
        return runner.run_batch([Request(B[0], x(31), ops(runner, 0)),
                                 *(Request(session, x(1), ops(runner, 30)) for session in (A[1], A[2], A[3], A[0]))])

    runner = filled(checkpoint)
    results = step()
    assert isinstance(results[0], CacheBudgetExceeded) and "budget is left" in str(results[0])
    assert all(isinstance(result, torch.Tensor) for result in results[1:])
    results = step()
    assert isinstance(results[0], torch.Tensor) and str(results[1]) == GIVEN_UP
    assert all(isinstance(result, torch.Tensor) for result in results[2:])


def test_blocks_a_sources_sessions_share_count_once(checkpoint):
    """With shared prefixes, five of X's chats share the first three blocks of a system prompt (16
    blocks in all, within a share of 20 of 60); Z's four sessions hold 32, unshared. Y's prompt of 16
    blocks takes its room from Z alone: counted per session, X's shared blocks would make it look past
    its share, and give up its chats for next to nothing."""
    runner = BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32, kv_budget_bytes=60 * 4096,
                              prefix_reuse=True, share_prefixes=True)
    X = [session_id("10.0.0.1", serial) for serial in range(1, 7)]
    Z = [session_id("10.0.0.2", serial) for serial in range(1, 5)]
    Y = session_id("10.0.0.3", 1)
    system = x(64, 1)
    runner.run(X[0], system, ops(runner, 0))
    runner.clear_session(X[0])  # retired: the chats after it take its first blocks up
    for serial, session in enumerate(X[1:]):
        runner.run(session, torch.cat([system[:, :48], x(8, 10 + serial)], dim=1), ops(runner, 0))
    for serial, session in enumerate(Z):
        runner.run(session, x(64, 20 + serial), ops(runner, 0))
    runner.run(Y, x(128, 30), ops(runner, 0))
    for session in X[1:]:
        runner.run(session, x(1), ops(runner, 56))
    with pytest.raises(CacheBudgetExceeded, match="given up to make room"):
        runner.run(Z[0], x(1), ops(runner, 64))


def test_a_session_given_up_starts_again_at_zero(checkpoint):
    runner = filled(checkpoint)
    runner.run(B[0], x(31), ops(runner, 0))  # A[1] given up
    runner.free_session(B[0])
    reference = load(checkpoint, None)
    prompt = x(31, 9)
    assert_close(runner.run(A[1], prompt, ops(runner, 0)), reference.run(A[1], prompt, ops(reference, 0)))
    runner.run(A[1], x(1), ops(runner, 31))  # no longer told it was given up
