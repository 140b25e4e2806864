"""Prefix reuse in BlockRunner, without processes: what a session's next prompt reuses, and what it costs.

The requests are what a Cake master serving a chat sends: a prompt from position 0 (in chunks,
as the front cuts it), one decode step per generated token, Goodbye, then the next turn from 0
with the whole history again. Each answer is compared with a fresh runner's prefill of the same
rows: reuse must give the hidden states a fresh prefill gives.
"""

import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute import prefix_cache
from cakemp.compute.kv_cache import BLOCK
from cakemp.compute.prefix_cache import MAX_RETIRED, MIN_REUSE, PrefixCache
from cakemp.compute.runner import BlockRunner, Request
from cakemp.errors import ContextLimitExceeded, PositionGap, RecurrentRewind
from cakemp.front.router import chunk_bounds
from cakemp.sources import session_id
from tests.support.checkpoints import make_checkpoint
from tests.support.families import family_checkpoint
from tests.support.tolerance import assert_close

HIDDEN = 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", shards=1)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", shards=1)


class Node:
    """A runner serving layers 0-3 of a checkpoint, with requests sent as a Cake master sends them."""

    def __init__(self, checkpoint, chunk: int = 16, **kwargs):
        config = ModelConfig.from_dir(checkpoint)
        self.layers = [config.layer_name(i) for i in range(4)]
        self.runner = BlockRunner.load(checkpoint, self.layers, "cpu", torch.float32, **kwargs)
        self.chunk = chunk

    def ops(self, index_pos: int):
        return self.runner.ops([(layer, index_pos, i) for i, layer in enumerate(self.layers)])

    def prompt(self, session: int, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x: [1, T, H] from `start`, in the chunks the front would cut: the output rows."""
        outputs = [self.runner.run(session, x[:, a:b], self.ops(start + a)) for a, b in chunk_bounds(x.shape[1], self.chunk)]
        return torch.cat(outputs, dim=1)

    def decode(self, session: int, rows: torch.Tensor, start: int) -> None:
        for i in range(rows.shape[1]):
            self.runner.run(session, rows[:, i:i + 1], self.ops(start + i))

    def turn(self, session: int, history: torch.Tensor, generated: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `history` from 0, decode `generated` rows, Goodbye: (the prefill's output, the rows
        the next turn's history holds: the prompt and the decoded rows)."""
        out = self.prompt(session, history)
        decoded = rows(generated, seed)
        self.decode(session, decoded, history.shape[1])
        self.runner.clear_session(session)
        return out, torch.cat([history, decoded], dim=1)


def rows(count: int, seed: int) -> torch.Tensor:
    return torch.randn(1, count, HIDDEN, generator=torch.Generator().manual_seed(seed))


def fresh(checkpoint, x: torch.Tensor) -> torch.Tensor:
    """x's output from a runner that never saw anything (one prefill, no reuse)."""
    node = Node(checkpoint, chunk=x.shape[1])
    return node.prompt(1, x)


def figures(runner: BlockRunner) -> tuple[int, int, int]:
    prefixes = runner.prefixes
    return prefixes.hits, prefixes.tokens, prefixes.evictions


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_a_three_turn_chat_gives_a_fresh_prefills_hidden_states(family, request):
    """Three turns (prompt, 5 decoded rows, Goodbye; then the history and a new prompt from 0): each
    turn's prompt gives what a fresh prefill of the same rows gives, and turns 2 and 3 reuse rows."""
    checkpoint = request.getfixturevalue(family)
    node = Node(checkpoint, prefix_reuse=True)
    history = rows(37, 0)
    reused = []
    for turn in range(3):
        before = node.runner.prefixes.tokens
        out, history = node.turn(1, history, 5, seed=10 + turn)
        reused.append(node.runner.prefixes.tokens - before)
        assert_close(out, fresh(checkpoint, history[:, :out.shape[1]]))
        history = torch.cat([history, rows(20, 20 + turn)], dim=1)
    # The whole history each time (42, then 67 rows); recurrent layers too, although the turns' chunks
    # end elsewhere than the states kept (at the earlier turns' chunk ends): the state follows the
    # agreeing rows from one kept state to the next, and the last turn's end holds one.
    assert reused == [0, 42, 67] and node.runner.prefixes.hits == 2


def test_the_kept_rows_are_the_first_turns_output_bit_for_bit(llama):
    """The rows answered from a retired prefix are exactly what the first turn computed (so the next
    device's input matches its own kept rows), and the new rows agree with a fresh prefill."""
    node = Node(llama, prefix_reuse=True)
    first, history = node.turn(1, rows(40, 0), 0, seed=1)
    second = node.prompt(1, torch.cat([history, rows(9, 2)], dim=1))
    assert torch.equal(second[:, :40], first)
    assert_close(second, fresh(llama, torch.cat([history, rows(9, 2)], dim=1)))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """Phi-4-mini's longrope: a request ending past position 16 rotates all its rows with the long factors."""
    return family_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


def test_rows_rotated_otherwise_are_not_reused_across_longrope_s_switch(phi3):
    """A longrope request ending past the original context rotates every row of it with the long factors,
    so rows of the same bytes are other rows in a shorter request: a prompt's rows are not answered from
    a prefix computed on the other side of the switch (each answer as a fresh prefill's), and are from
    one computed on the same side."""
    node = Node(phi3, chunk=64, prefix_reuse=True)
    long_first, _ = node.turn(1, rows(20, 0), 0, seed=1)  # ends at 20: long factors
    short = rows(20, 0)[:, :16]  # the same first 16 rows, ending at 16: short factors
    assert_close(node.prompt(1, short), fresh(phi3, short))
    assert node.runner.prefixes.tokens == 0
    node.runner.clear_session(1)

    node = Node(phi3, chunk=64, prefix_reuse=True)
    _, history = node.turn(1, rows(16, 2), 4, seed=3)  # the prompt's 16 rows short, the decoded 4 long
    longer = torch.cat([history, rows(2, 4)], dim=1)  # ends at 22: every row long
    assert_close(node.prompt(1, longer), fresh(phi3, longer))
    assert node.runner.prefixes.tokens == 0
    node.runner.clear_session(1)

    again = torch.cat([rows(20, 0), rows(4, 5)], dim=1)  # a long prefix, continued past the switch
    node = Node(phi3, chunk=64, prefix_reuse=True)
    node.turn(1, rows(20, 0), 0, seed=1)
    out = node.prompt(1, again)
    assert node.runner.prefixes.tokens == 20 and torch.equal(out[:, :20], long_first)
    assert_close(out, fresh(phi3, again))


def test_a_longrope_prompt_cut_into_pieces_computes_as_it_does_whole(phi3):
    """A prompt reaching past longrope's switch, sent in pieces each knowing its rows to the request's end (as
    a node's front or device cuts it: `to_end`), gives what it gives whole, with prefix reuse on; pieces sent as
    requests of their own take each their own factors (the first two the short ones), as transformers' calls do."""
    x = rows(24, 7)
    node = Node(phi3, chunk=64, prefix_reuse=True)
    pieces = [node.runner.run_batch([Request(1, x[:, a:b], node.ops(a), None, 24 - a)])[0] for a, b in ((0, 8), (8, 16), (16, 24))]
    assert_close(torch.cat(pieces, dim=1), fresh(phi3, x))
    alone = [node.runner.run(2, x[:, a:b], node.ops(a)) for a, b in ((0, 8), (8, 16), (16, 24))]
    assert (torch.cat(alone, dim=1) - fresh(phi3, x)).abs().max() > 1e-3


def test_rows_are_named_by_the_bytes_a_request_came_with(llama):
    """A request's `data` (a device's received bytes) is what names its rows, not a copy of x's: a prompt
    whose data repeats a retired prompt's is answered that prompt's kept rows, whatever its x; without
    data, its x's bytes name it and it misses. (The device passes data only where it is x's own bytes.)"""
    node = Node(llama, prefix_reuse=True)
    first = node.runner.run(1, rows(20, 0), node.ops(0))
    node.runner.clear_session(1)
    named_as_first = node.runner.run_batch([Request(1, rows(20, 5), node.ops(0), _bytes(rows(20, 0)))])[0]
    assert torch.equal(named_as_first, first) and figures(node.runner)[:2] == (1, 20)
    node.runner.clear_session(1)
    own = node.runner.run_batch([Request(1, rows(20, 5), node.ops(0))])[0]
    assert figures(node.runner)[:2] == (1, 20)  # no second hit
    assert_close(own, fresh(llama, rows(20, 5)))


def _bytes(x: torch.Tensor) -> memoryview:
    return memoryview(x.reshape(-1).numpy()).cast("B")


def test_decodes_batched_keep_each_session_s_own_output_rows(llama):
    """Three sessions decoding together (their rows kept in one copy a step), each crossing into a new
    KV block on its own step (a decode planned apart): each one's next turn is answered its own
    prompt's and decodes' outputs, bit for bit."""
    node = Node(llama, prefix_reuse=True)
    prompts = [rows(BLOCK - 2 + s, s) for s in range(3)]
    outputs = [node.prompt(s, prompt) for s, prompt in enumerate(prompts)]
    decoded = [rows(4, 10 + s) for s in range(3)]
    for i in range(4):
        step = node.runner.run_batch([Request(s, decoded[s][:, i:i + 1], node.ops(BLOCK - 2 + s + i)) for s in range(3)])
        outputs = [torch.cat([out, y], dim=1) for out, y in zip(outputs, step, strict=True)]
    for s in range(3):
        node.runner.clear_session(s)
    for s in range(3):
        again = node.prompt(s, torch.cat([prompts[s], decoded[s]], dim=1))
        assert torch.equal(again, outputs[s])
    assert figures(node.runner)[:2] == (3, 3 * (BLOCK + 2) + 3)


def test_a_session_no_longer_followed_gives_its_output_rows_back(llama):
    """A session that rewinds (its run no longer followed), one whose connection closes (reuse not
    shared) and one retired too short to keep give their kept output rows back to the pool: none is
    held for a prefix no one keeps."""
    node = Node(llama, prefix_reuse=True)
    node.prompt(1, rows(20, 0))
    node.prompt(2, rows(20, 1))
    pool = node.runner.prefixes._outputs
    assert pool.used == 2 * -(-20 // BLOCK)
    node.runner.run(1, rows(1, 2), node.ops(5))  # a rewind: session 1 is no longer followed
    assert pool.used == -(-20 // BLOCK) and recounted(node.runner.prefixes) > 0
    node.runner.free_session(2)
    assert pool.used == 0 and recounted(node.runner.prefixes) == 0
    node.prompt(3, rows(MIN_REUSE - 1, 3))
    node.runner.clear_session(3)  # fewer rows than a reuse needs: not kept
    assert pool.used == 0 and node.runner.prefixes.retired_count() == 0


def test_kept_rows_that_find_no_memory_are_given_up_and_the_request_answered(llama, monkeypatch):
    """A GPU out of memory for the kept output rows (the pool's growth raises torch.OutOfMemoryError, as
    CUDA's allocator does; injected here, where a CPU's allocator raises no such thing): the prompt that
    ran is answered what a fresh prefill gives, its session is no longer followed, and another session's
    kept rows are untouched."""
    node = Node(llama, prefix_reuse=True)
    first = node.prompt(1, rows(20, 0))
    prefixes = node.runner.prefixes

    def out_of_memory(at_least: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(prefixes._outputs, "_grow", out_of_memory)
    x = rows(16 * BLOCK, 1)  # past the blocks the pool's first size has left
    assert_close(node.prompt(2, x), fresh(llama, x))
    assert 2 not in prefixes._live and figures(node.runner)[2] == 1 and recounted(prefixes) > 0
    monkeypatch.undo()
    node.runner.clear_session(1)
    assert torch.equal(node.prompt(1, rows(20, 0)), first) and figures(node.runner)[:2] == (1, 20)


def test_a_history_differing_in_one_early_row_reuses_nothing_past_it(llama, qwen):
    """Row 20 of the history differs: attention layers reuse the 20 rows before it; a run with
    recurrent layers keeps states only where requests ended (the first turn's chunks: 14, 27, 40),
    so it resumes at 14; both answer what a fresh prefill does."""
    for checkpoint, resumed in ((llama, 20), (qwen, 14)):
        node = Node(checkpoint, prefix_reuse=True)
        _, history = node.turn(1, rows(40, 0), 0, seed=1)
        changed = history.clone()
        changed[0, 20] += 1.0
        out = node.prompt(1, changed)
        assert figures(node.runner)[:2] == (1, resumed)
        assert_close(out, fresh(checkpoint, changed))


def test_recurrent_layers_resume_at_the_latest_kept_state_before_the_match(llama, qwen):
    """A 40-row prompt and 8 decoded rows; the next history differs at row 45. Attention layers
    resume there (45); recurrent ones at the latest state kept before it, the prompt's end (40), as
    no state was kept between decode steps. Both answer a fresh prefill's rows."""
    for checkpoint, resumed in ((llama, 45), (qwen, 40)):
        node = Node(checkpoint, prefix_reuse=True)
        _, history = node.turn(1, rows(40, 0), 8, seed=1)
        changed = history.clone()
        changed[0, 45] -= 1.0
        out = node.prompt(1, changed)
        assert figures(node.runner)[:2] == (1, resumed)
        assert_close(out, fresh(checkpoint, changed))


def test_a_recurrent_run_computes_agreeing_rows_again_from_its_last_state(qwen):
    """Chunks 14, 27, 40 the first turn; the next history differs at row 17, in its second chunk
    [16, 32), which holds no kept state before the difference: its first chunk was answered from
    kept rows while the state stayed at 14, so rows 14-15 are computed again with the chunk's."""
    node = Node(qwen, prefix_reuse=True)
    _, history = node.turn(1, rows(40, 0), 0, seed=1)
    changed = history.clone()
    changed[0, 17] += 1.0
    out = node.prompt(1, changed)
    assert figures(node.runner)[:2] == (1, 14)
    assert_close(out, fresh(qwen, changed))


def test_a_request_not_continuing_rows_answered_past_the_last_state_is_refused_and_the_run_goes_on(qwen):
    """The first turn's chunks end at 14, 27 and 40 (its kept states); the next turn's first 20 rows are
    answered from kept rows while the recurrent state stays at 14, the rows after it held to compute with
    the session's next ones. A rewind then is refused as it would be had the session computed them (it has
    20 positions, not 14), and the session goes on from 20, each answer a fresh prefill's."""
    node = Node(qwen, prefix_reuse=True)
    _, history = node.turn(1, rows(40, 0), 0, seed=1)
    node.runner.run(1, history[:, :20], node.ops(0))
    for position in (10, 14):
        with pytest.raises(RecurrentRewind, match="consumed 20 positions"):
            node.runner.run(1, rows(1, 5), node.ops(position))
    with pytest.raises(PositionGap, match="follow the 20 positions"):
        node.runner.run(1, rows(1, 5), node.ops(21))
    more = torch.cat([history[:, :20], rows(6, 6)], dim=1)
    assert_close(node.runner.run(1, more[:, 20:], node.ops(20)), fresh(qwen, more)[:, 20:])


def test_another_chat_sharing_only_the_start_leaves_a_prefix_whole(llama, qwen):
    """Chats A and B on one session share their first 20 rows (a system prompt). B's first turn takes
    up A's retired prefix for those rows and leaves it there: A's second turn still reuses all of A."""
    for checkpoint in (llama, qwen):
        node = Node(checkpoint, prefix_reuse=True)
        system = rows(20, 0)
        _, chat_a = node.turn(1, torch.cat([system, rows(30, 1)], dim=1), 2, seed=2)
        before = node.runner.prefixes.tokens
        out_b, _ = node.turn(1, torch.cat([system, rows(30, 3)], dim=1), 2, seed=4)
        shared = node.runner.prefixes.tokens - before
        assert 0 < shared <= 20
        second = torch.cat([chat_a, rows(10, 5)], dim=1)
        before = node.runner.prefixes.tokens
        out_a = node.prompt(1, second)
        assert node.runner.prefixes.tokens - before == chat_a.shape[1] == 52
        assert_close(out_b, fresh(checkpoint, torch.cat([system, rows(30, 3)], dim=1)))
        assert_close(out_a, fresh(checkpoint, second))


def test_a_prompt_resent_whole_is_answered_without_computing(llama):
    """The same 48 rows again, in chunks: each chunk is answered from the kept rows, bit for bit."""
    node = Node(llama, prefix_reuse=True)
    first, history = node.turn(1, rows(48, 0), 0, seed=1)
    again = node.prompt(1, history)
    assert torch.equal(again, first) and figures(node.runner)[:2] == (1, 48)


def test_a_new_prompt_at_0_without_goodbye_reuses_the_session_s_rows(llama):
    """A master restarting at position 0 on the same session (no Goodbye) gets the same reuse."""
    node = Node(llama, prefix_reuse=True)
    history = rows(40, 0)
    node.prompt(1, history)
    longer = torch.cat([history, rows(8, 1)], dim=1)
    out = node.prompt(1, longer)
    assert figures(node.runner)[:2] == (1, 40)
    assert_close(out, fresh(llama, longer))


def test_goodbye_half_way_through_a_resent_prefix_keeps_it_whole(llama):
    """After only the first 16 of 48 kept rows were sent again, Goodbye keeps all 48: the next
    turn reuses them all."""
    node = Node(llama, prefix_reuse=True)
    _, history = node.turn(1, rows(48, 0), 0, seed=1)
    node.prompt(1, history[:, :16])
    node.runner.clear_session(1)
    out = node.prompt(1, torch.cat([history, rows(4, 2)], dim=1))
    assert figures(node.runner)[:2] == (2, 16 + 48)
    assert_close(out, fresh(llama, torch.cat([history, rows(4, 2)], dim=1)))


def test_prefixes_are_reused_within_their_session_unless_shared(llama):
    """Another session does not see session 1's retired prefix, and a closed session's are freed; with
    shared prefixes another session reuses them, and a closed session's rows are kept."""
    own = Node(llama, prefix_reuse=True)
    _, history = own.turn(1, rows(32, 0), 0, seed=1)
    own.prompt(2, history)
    assert figures(own.runner)[:2] == (0, 0)
    own.runner.free_session(1)
    assert own.runner.prefixes.retired_count() == 0
    shared = Node(llama, prefix_reuse=True, share_prefixes=True)
    shared.prompt(1, history)
    shared.runner.free_session(1)  # a closed connection's rows are retired, not freed
    out = shared.prompt(2, history)
    assert figures(shared.runner)[:2] == (1, 32)
    assert_close(out, fresh(llama, history))


def test_retired_prefixes_give_way_to_live_sessions(llama):
    """With a budget that holds one session's blocks and kept rows, a second session's prompt evicts
    the first's retired prefix rather than fail, and decodes on to the end of its blocks."""
    probe = Node(llama, prefix_reuse=True)
    probe.prompt(1, rows(20, 0))
    one_session = probe.runner.kv_bytes() + probe.runner.prefixes.kept_bytes()
    node = Node(llama, prefix_reuse=True, kv_budget_bytes=one_session)
    node.turn(1, rows(20, 0), 0, seed=1)
    assert node.runner.prefixes.retired_count() == 1
    node.prompt(2, rows(20, 2))
    assert node.runner.prefixes.retired_count() == 0 and figures(node.runner)[2] == 1
    node.decode(2, rows(-(-20 // BLOCK) * BLOCK - 20, 3), 20)  # up to its blocks' end, within the budget
    assert node.runner.kv_bytes() <= one_session


def test_a_live_session_gives_up_its_kept_rows_before_it_is_refused(llama):
    """Budget for the KV blocks of a 20-row prompt and no more: the output rows kept for reuse go (the
    session is no longer followed), the session's requests all succeed."""
    probe = Node(llama)
    probe.prompt(1, rows(20, 0))
    node = Node(llama, prefix_reuse=True, kv_budget_bytes=probe.runner.kv_bytes())
    node.prompt(1, rows(20, 0))
    assert node.runner.prefixes.kept_bytes() == 0 and figures(node.runner)[2] == 1
    node.decode(1, rows(-(-20 // BLOCK) * BLOCK - 20, 1), 20)


def test_a_failed_request_leaves_a_prefix_that_still_matches(llama):
    """A chunk past the context limit fails; the session's rows up to it are still kept whole, and
    the next turn reuses them."""
    node = Node(llama, prefix_reuse=True, max_context=64)
    history = rows(48, 0)
    node.prompt(1, history)
    with pytest.raises(ContextLimitExceeded):
        node.runner.run(1, rows(20, 1), node.ops(48))
    node.runner.clear_session(1)
    out = node.prompt(1, torch.cat([history, rows(4, 2)], dim=1))
    assert figures(node.runner)[:2] == (1, 48)
    assert_close(out, fresh(llama, torch.cat([history, rows(4, 2)], dim=1)))


def test_a_batch_mixing_a_hit_a_kept_chunk_and_a_miss_answers_each_as_alone(llama):
    """One run_batch of three sessions: one whose prompt reuses 32 rows, one whose chunk is kept whole,
    one with nothing kept: each gets what it gets alone."""
    node = Node(llama, prefix_reuse=True, share_prefixes=True)
    _, first = node.turn(1, rows(48, 0), 0, seed=1)
    _, second = node.turn(2, rows(48, 1), 0, seed=1)
    hit, kept, miss = torch.cat([first[:, :32], rows(6, 2)], dim=1), second[:, :16], rows(10, 3)
    results = node.runner.run_batch([Request(3, hit, node.ops(0)), Request(4, kept, node.ops(0)),
                                     Request(5, miss, node.ops(0))])
    for result, x in zip(results, (hit, kept, miss), strict=True):
        assert_close(result, fresh(llama, x))
    assert figures(node.runner)[:2] == (2, 32 + 16)


def test_retired_prefixes_are_bounded_in_number(llama):
    """Without a budget, at most MAX_RETIRED prefixes are kept; the oldest go first."""
    node = Node(llama, prefix_reuse=True, share_prefixes=True)
    for session in range(MAX_RETIRED + 2):
        node.runner.run(session, rows(16, session), node.ops(0))
        node.runner.clear_session(session)
    assert node.runner.prefixes.retired_count() == MAX_RETIRED and figures(node.runner)[2] == 2


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_past_the_retired_cap_a_master_saying_goodbye_again_and_again_pushes_out_its_own(llama, monkeypatch, shared):
    """Past MAX_RETIRED (4 here) the oldest retired prefix of the source that retired the most goes: a
    master at one address whose sessions retire prompt after prompt leaves another's first prompts kept,
    which the other's sessions then reuse, where the oldest of all would have gone first."""
    monkeypatch.setattr(prefix_cache, "MAX_RETIRED", 4)
    node = Node(llama, prefix_reuse=True, share_prefixes=shared)
    kept = [session_id("10.0.0.2", serial) for serial in (1, 2)]
    flood = [session_id("10.0.0.1", serial) for serial in range(1, 9)]
    for session in (*kept, *flood):
        node.runner.run(session, rows(16, session % 1000), node.ops(0))
        node.runner.clear_session(session)  # Goodbye: its rows retired
    for session in kept:
        hits = figures(node.runner)[0]
        node.runner.run(session, rows(16, session % 1000), node.ops(0))
        assert figures(node.runner)[0] == hits + 1
    hits = figures(node.runner)[0]
    node.runner.run(flood[0], rows(16, flood[0] % 1000), node.ops(0))  # its first prompt: pushed out
    assert figures(node.runner)[0] == hits


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_the_bytes_kept_for_reuse_are_counted_as_prefixes_are_retired_taken_back_and_given_up(family, request):
    """What the budget asks of prefix reuse (`nbytes`, counted as prefixes change, come and go) is,
    after every prompt, decode and Goodbye, the sum over every prefix kept of its output rows, state
    points and pending rows: chats sharing their start (a prefix left whole, another switched to),
    prefixes taken back, closed sessions, and retired prefixes given up for a live session's room."""
    checkpoint = request.getfixturevalue(family)
    probe = Node(checkpoint, prefix_reuse=True)
    probe.prompt(1, rows(60, 0))
    node = Node(checkpoint, prefix_reuse=True, share_prefixes=True,
                kv_budget_bytes=3 * (probe.runner.kv_bytes() + probe.runner.prefixes.kept_bytes()))
    prefixes = node.runner.prefixes

    def turn(session: int, history: torch.Tensor, generated: int, seed: int) -> torch.Tensor:
        node.prompt(session, history)
        assert prefixes.nbytes() == recounted(prefixes)
        decoded = rows(generated, seed)
        node.decode(session, decoded, history.shape[1])
        assert prefixes.nbytes() == recounted(prefixes)
        node.runner.clear_session(session)
        assert prefixes.nbytes() == recounted(prefixes)
        return torch.cat([history, decoded], dim=1)

    system = rows(20, 0)
    chat_a = turn(1, torch.cat([system, rows(30, 1)], dim=1), 3, seed=2)
    assert prefixes.nbytes() > 0
    turn(1, torch.cat([system, rows(30, 3)], dim=1), 2, seed=4)  # leaves chat A's prefix whole
    turn(2, chat_a[:, :40], 2, seed=6)  # takes part of chat A's prefix, then leaves it
    turn(2, torch.cat([chat_a, rows(6, 5)], dim=1), 2, seed=6)  # takes chat A's prefix back, whole
    node.runner.free_session(1)
    assert prefixes.nbytes() == recounted(prefixes)
    for session in range(3, 7):  # more than the budget keeps: the oldest are given up
        turn(session, rows(60, session), 2, seed=session)
    assert figures(node.runner)[2] > 0 and figures(node.runner)[0] >= 3


def recounted(prefixes: PrefixCache) -> int:
    """The bytes every prefix kept holds besides KV blocks, summed afresh; and as the device reports them,
    retired (their KV blocks too) and live, checked against the same sums. Every block of the output
    rows' pool in use is one prefix's own (none shared, none lost: a write to one never reaches another's)."""
    retired = [prefixes._held_bytes(prefix) for prefix in prefixes._retired]
    live = [prefixes._held_bytes(prefix) for prefix in prefixes._live.values()]
    kv = sum(prefixes._kv_bytes(prefix) for prefix in prefixes._retired)
    assert (prefixes.retired_bytes(), prefixes.kept_bytes()) == (sum(retired) + kv, sum(live))
    blocks = [block for prefix in [*prefixes._retired, *prefixes._live.values()] for block in prefix.outputs.table]
    assert len(set(blocks)) == len(blocks) == prefixes._outputs.used
    return sum(retired) + sum(live)
