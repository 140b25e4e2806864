"""BlockRunner: sessions, chunked prefill, and the errors a request can get."""

import pytest
import torch

from cakemp.compute.kv_cache import BLOCK
from cakemp.compute.runner import BlockRunner
from cakemp.errors import CacheBudgetExceeded, ContextLimitExceeded, InternalError, PositionGap, UnknownLayer
from tests.support.checkpoints import make_checkpoint
from tests.support.tolerance import assert_close

LAYERS = ["model.layers.1", "model.layers.2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", shards=2)


def load(checkpoint, **kwargs):
    return BlockRunner.load(checkpoint, LAYERS, "cpu", torch.float32, **kwargs)


def ops(index_pos):
    return [(name, index_pos, int(name.rsplit(".", 1)[1])) for name in LAYERS]


def tokens(T, seed):
    return torch.randn(1, T, 64, generator=torch.Generator().manual_seed(seed))


def test_prefill_in_chunks_equals_prefill_at_once(checkpoint):
    """12 tokens sent as chunks of 5, 4 and 3 give the same hidden states as one prefill of 12."""
    runner = load(checkpoint)
    x = tokens(12, 0)
    whole = runner.run(1, x, runner.ops(ops(0)))
    parts = [runner.run(2, x[:, a:b], runner.ops(ops(a))) for a, b in ((0, 5), (5, 9), (9, 12))]
    assert_close(torch.cat(parts, dim=1), whole)


def test_interleaved_sessions_stay_independent(checkpoint):
    """Two sessions stepped alternately give what each gives alone on a fresh runner."""
    inputs = {s: [tokens(6, s)] + [tokens(1, 10 * s + i) for i in range(4)] for s in (1, 2)}

    def alone(session):
        runner, pos, out = load(checkpoint), 0, []
        for x in inputs[session]:
            out.append(runner.run(session, x, runner.ops(ops(pos))))
            pos += x.shape[1]
        return out

    expected = {s: alone(s) for s in (1, 2)}
    runner, pos = load(checkpoint), {1: 0, 2: 0}
    for step in range(5):
        for s in (2, 1):
            x = inputs[s][step]
            assert torch.equal(runner.run(s, x, runner.ops(ops(pos[s]))), expected[s][step])
            pos[s] += x.shape[1]
    assert len(runner.sessions()) == 2


def test_restart_at_zero_without_goodbye_is_a_fresh_prompt(checkpoint):
    """A prefill at index_pos 0 into a used session equals the same prefill in a new session."""
    runner = load(checkpoint)
    runner.run(1, tokens(9, 0), runner.ops(ops(0)))
    runner.run(1, tokens(1, 1), runner.ops(ops(9)))
    x = tokens(4, 2)
    assert torch.equal(runner.run(1, x, runner.ops(ops(0))), runner.run(2, x, runner.ops(ops(0))))


def test_clear_and_end_session_free_the_cache(checkpoint):
    """Goodbye and a closed connection both release the session's KV bytes; unknown ids are no-ops."""
    runner = load(checkpoint)
    runner.run(1, tokens(3, 0), runner.ops(ops(0)))
    runner.run(2, tokens(3, 0), runner.ops(ops(0)))
    one_session = runner.kv_bytes() // 2
    runner.free_session(1)
    assert runner.kv_bytes() == one_session and len(runner.sessions()) == 1
    runner.free_session(2)
    runner.free_session(99)
    runner.free_session(99)
    assert runner.kv_bytes() == 0 and len(runner.sessions()) == 0


@pytest.mark.parametrize(
    "bad_ops, error, message",
    [
        ([("model.layers.0", 0, 0)], UnknownLayer, "model.layers.0"),
        ([("model.layers.1", 0, 1), ("model.layers.7", 0, 7)], UnknownLayer, "model.layers.7"),
        ([("model.layers.1", 0, 4)], InternalError, "4 KV slots"),  # admission refuses it first
        ([("model.layers.1", 3, 1)], PositionGap, "index_pos 3"),
    ],
    ids=["unserved-layer", "unserved-second-layer", "block-idx-out-of-range", "position-gap"],
)
def test_bad_ops_are_refused_without_touching_the_cache(checkpoint, bad_ops, error, message):
    """A request naming an unknown layer, slot or position fails as a whole, leaving no KV behind
    (an unknown layer already when named, a slot past the model's as a broken contract)."""
    runner = load(checkpoint)
    with pytest.raises(error, match=message):
        runner.run(1, tokens(2, 0), runner.ops(bad_ops))
    assert runner.kv_bytes() == 0 and len(runner.sessions()) == 0


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.zeros(1, 2, 32), r"\(1, 2, 32\)"),
        (torch.zeros(2, 2, 64), r"\(2, 2, 64\)"),
        (torch.zeros(2, 64), r"\(2, 64\)"),
        (torch.zeros(1, 0, 64), r"\(1, 0, 64\)"),
        (torch.zeros(1, 2, 64, dtype=torch.float16), "torch.float16"),
    ],
    ids=["hidden-size", "batch", "rank", "empty", "dtype"],
)
def test_bad_activations_are_refused(checkpoint, x, message):
    """Wrong hidden size, batch, rank, length or dtype breaks the contract admission enforces at the
    front: InternalError saying what was received."""
    with pytest.raises(InternalError, match=message):
        load(checkpoint).run(1, x, load(checkpoint).ops(ops(0)))


def test_context_limit_is_enforced_and_leaves_the_session_usable(checkpoint):
    """Passing max_context is ContextLimitExceeded; the session then continues where it was."""
    runner, fresh = load(checkpoint, max_context=16), load(checkpoint, max_context=16)
    prefix = tokens(10, 0)
    runner.run(1, prefix, runner.ops(ops(0)))
    with pytest.raises(ContextLimitExceeded, match="context limit of 16"):
        runner.run(1, tokens(7, 1), runner.ops(ops(10)))
    fresh.run(1, prefix, fresh.ops(ops(0)))
    x = tokens(6, 2)  # exactly reaches the limit
    assert torch.equal(runner.run(1, x, runner.ops(ops(10))), fresh.run(1, x, fresh.ops(ops(10))))


def test_a_decode_past_the_context_limit_is_refused_where_its_last_block_has_room(checkpoint):
    """A limit inside a block: the row past it would fit the session's last block (nothing to reserve),
    and is refused all the same; the session then decodes its last allowed row."""
    runner = load(checkpoint, max_context=BLOCK + 4)
    runner.run(1, tokens(BLOCK + 3, 0), runner.ops(ops(0)))
    runner.run(1, tokens(1, 1), runner.ops(ops(BLOCK + 3)))  # the last row the limit allows
    with pytest.raises(ContextLimitExceeded, match=f"context limit of {BLOCK + 4}"):
        runner.run(1, tokens(1, 2), runner.ops(ops(BLOCK + 4)))
    assert [runner.cache.length(1, i) for i in (1, 2)] == [BLOCK + 4, BLOCK + 4]


@pytest.mark.parametrize("positions", [(5, 3), (3, 5)], ids=["second-earlier", "second-later"])
def test_a_one_row_request_whose_layers_are_at_different_positions_computes_each_at_its_own(checkpoint, positions):
    """A token whose second layer rewrites an earlier (or a later) row than its first (each within what
    is cached) equals the same ops sent one layer at a time."""
    runner, apart = load(checkpoint), load(checkpoint)
    for r in (runner, apart):
        r.run(1, tokens(6, 0), r.ops(ops(0)))
    x = tokens(1, 1)
    at = [("model.layers.1", positions[0], 1), ("model.layers.2", positions[1], 2)]
    both = runner.run(1, x, runner.ops(at))
    first = apart.run(1, x, apart.ops(at[:1]))
    assert torch.equal(both, apart.run(1, first, apart.ops(at[1:])))
    assert [runner.cache.length(1, i) for i in (1, 2)] == [p + 1 for p in positions]


def test_budget_refuses_a_second_session_until_the_first_ends(checkpoint):
    """With room for one session's cache, a second gets CacheBudgetExceeded, then fits after end_session."""
    # 2 layers x one block x (K+V) x 2 kv heads x 16 dims x 4 bytes = one session's first blocks.
    one_session = 2 * BLOCK * 2 * 2 * 16 * 4
    runner = load(checkpoint, kv_budget_bytes=one_session)
    first = runner.run(1, tokens(4, 0), runner.ops(ops(0)))
    with pytest.raises(CacheBudgetExceeded, match=r"would need 8\.0 KiB more but only 0 B of this device's 8\.0 KiB"):
        runner.run(2, tokens(4, 0), runner.ops(ops(0)))
    assert runner.kv_bytes() == one_session and len(runner.sessions()) == 1
    runner.free_session(1)
    assert torch.equal(runner.run(2, tokens(4, 0), runner.ops(ops(0))), first)


def test_budget_refusal_mid_span_allocates_nothing(checkpoint):
    """When the second layer's block would not fit, the first layer's is not taken either."""
    exact_one_layer = BLOCK * 2 * 2 * 16 * 4  # one block, one layer
    runner = load(checkpoint, kv_budget_bytes=exact_one_layer)
    with pytest.raises(CacheBudgetExceeded):
        runner.run(1, tokens(3, 0), runner.ops(ops(0)))
    assert runner.kv_bytes() == 0
    assert runner.run(1, tokens(3, 0), runner.ops(ops(0)[:1])).shape == (1, 3, 64)


def test_failed_compute_keeps_earlier_positions(checkpoint):
    """A request that fails inside a block leaves every slot at its previous length."""
    runner = load(checkpoint)
    runner.run(1, tokens(5, 0), runner.ops(ops(0)))
    block = runner.block("model.layers.2")
    good = block.mlp.w_down
    block.mlp.w_down = torch.zeros(3, 7)  # the second layer's MLP now fails with a shape error
    with pytest.raises(RuntimeError):
        runner.run(1, tokens(1, 1), runner.ops(ops(5)))
    block.mlp.w_down = good
    assert [runner.cache.length(1, i) for i in (1, 2)] == [5, 5]
    fresh = load(checkpoint)
    fresh.run(1, tokens(5, 0), fresh.ops(ops(0)))
    assert torch.equal(runner.run(1, tokens(1, 2), runner.ops(ops(5))), fresh.run(1, tokens(1, 2), fresh.ops(ops(5))))


@pytest.mark.parametrize("T", [1, 2], ids=["decode", "chunk"])
def test_a_failed_rewind_leaves_each_slot_at_its_first_rewritten_position(checkpoint, T):
    """A request at 3 over 5 cached positions writes rows 3.. before it fails: every slot falls back
    to 3 (rows past it may be overwritten), so a request at 5 is refused and one at 3 computes afresh.
    One row (its slots hold it: nothing reserved) or two."""
    runner = load(checkpoint)
    runner.run(1, tokens(5, 0), runner.ops(ops(0)))
    block = runner.block("model.layers.2")
    good = block.mlp.w_down
    block.mlp.w_down = torch.zeros(3, 7)  # the second layer's MLP now fails, after the first wrote its rows
    with pytest.raises(RuntimeError):
        runner.run(1, tokens(T, 1), runner.ops(ops(3)))
    block.mlp.w_down = good
    assert [runner.cache.length(1, i) for i in (1, 2)] == [3, 3]
    with pytest.raises(PositionGap):
        runner.run(1, tokens(1, 2), runner.ops(ops(5)))
    fresh = load(checkpoint)  # the same rewind, with no failure before it
    fresh.run(1, tokens(5, 0), fresh.ops(ops(0)))
    assert torch.equal(runner.run(1, tokens(2, 3), runner.ops(ops(3))), fresh.run(1, tokens(2, 3), fresh.ops(ops(3))))


def test_empty_op_list_returns_the_input_and_creates_no_session(checkpoint):
    """A Batch with no layers hands x back unchanged and allocates nothing."""
    runner = load(checkpoint)
    x = tokens(3, 0)
    assert runner.run(1, x, runner.ops([])) is x
    assert len(runner.sessions()) == 0 and runner.kv_bytes() == 0
