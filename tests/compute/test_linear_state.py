"""A Qwen3.5 session's linear-attention state: continued, restarted, never rewound, budgeted, freed."""

import pytest
import torch

from cakemp.compute.runner import BlockRunner
from cakemp.errors import CacheBudgetExceeded, PositionGap, RecurrentRewind
from tests.support.checkpoints import make_checkpoint
from tests.support.tolerance import assert_close

PREFIX = "model.language_model.layers"
LAYERS = [1, 2, 3]  # linear, linear, full attention


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3_5", shards=2)


def load(path, **kwargs):
    return BlockRunner.load(path, [f"{PREFIX}.{i}" for i in LAYERS], "cpu", torch.float32, **kwargs)


def ops(position):
    return [(f"{PREFIX}.{i}", position, i) for i in LAYERS]


def tokens(T, seed):
    return torch.randn(1, T, 64, generator=torch.Generator().manual_seed(seed))


def test_a_prompt_in_chunks_equals_the_prompt_at_once(path):
    """Nine tokens sent as 3 + 3 + 3 give the same hidden states as one chunk of 9, within two f32
    evaluations of the same layers (a GEMM of 3 rows sums in another order than one of 9)."""
    runner = load(path)
    x = tokens(9, 0)
    whole = runner.run(1, x, runner.ops(ops(0)))
    parts = torch.cat([runner.run(2, x[:, i : i + 3], runner.ops(ops(i))) for i in (0, 3, 6)], dim=1)
    assert_close(parts, whole)


def test_rewind_to_a_middle_position_is_refused_by_name_and_changes_nothing(path):
    """index_pos between 0 and the consumed length is a RecurrentRewind; the session continues unharmed."""
    runner, fresh = load(path), load(path)
    for r in (runner, fresh):
        r.run(1, tokens(5, 0), r.ops(ops(0)))
    with pytest.raises(RecurrentRewind, match="cannot be rewound.*consumed 5 positions"):
        runner.run(1, tokens(1, 1), runner.ops(ops(3)))
    assert runner.cache.linear_length(1, 1) == 5
    torch.testing.assert_close(runner.run(1, tokens(1, 2), runner.ops(ops(5))), fresh.run(1, tokens(1, 2), fresh.ops(ops(5))),
                               rtol=0, atol=0)


def test_index_pos_past_the_consumed_length_is_a_gap(path):
    runner = load(path)
    runner.run(1, tokens(2, 0), runner.ops(ops(0)))
    with pytest.raises(PositionGap, match="does not follow"):
        runner.run(1, tokens(1, 1), runner.ops(ops(3)))


def test_restart_at_zero_starts_afresh(path):
    """A new prompt at index_pos 0 without Goodbye ignores the old state, as a new session would."""
    runner, fresh = load(path), load(path)
    runner.run(1, tokens(6, 0), runner.ops(ops(0)))
    torch.testing.assert_close(runner.run(1, tokens(4, 1), runner.ops(ops(0))), fresh.run(9, tokens(4, 1), fresh.ops(ops(0))),
                               rtol=0, atol=0)


def test_a_request_failing_part_way_leaves_the_linear_state_as_it_was(path):
    """A failure in the last (attention) layer installs none of the linear layers' new states."""
    runner, fresh = load(path), load(path)
    for r in (runner, fresh):
        r.run(1, tokens(4, 0), r.ops(ops(0)))
    block = runner.block(f"{PREFIX}.3")
    good = block.mlp.w_down
    block.mlp.w_down = torch.zeros(3, 7)  # the attention layer's MLP now fails with a shape error
    with pytest.raises(RuntimeError):
        runner.run(1, tokens(1, 1), runner.ops(ops(4)))
    block.mlp.w_down = good
    assert [runner.cache.linear_length(1, i) for i in (1, 2)] == [4, 4]
    torch.testing.assert_close(runner.run(1, tokens(1, 2), runner.ops(ops(4))), fresh.run(1, tokens(1, 2), fresh.ops(ops(4))),
                               rtol=0, atol=0)


def test_linear_state_is_counted_in_the_budget_and_freed_with_the_session(path):
    """Two linear slots of f32 conv + recurrent state count in kv_bytes, refuse past the budget, and go on clear."""
    runner = load(path)
    la = runner.config.linear_attention
    per_slot = 4 * (la.conv_channels * (la.conv_kernel - 1) + la.value_heads * la.key_head_dim * la.value_head_dim)
    runner.run(1, tokens(3, 0), runner.ops(ops(0)[:2]))  # the two linear layers only
    assert runner.kv_bytes() == 2 * per_slot
    runner.free_session(1)
    assert runner.kv_bytes() == 0 and len(runner.sessions()) == 0

    tight = load(path, kv_budget_bytes=2 * per_slot)
    tight.run(1, tokens(3, 0), tight.ops(ops(0)[:2]))
    with pytest.raises(CacheBudgetExceeded):
        tight.run(2, tokens(3, 0), tight.ops(ops(0)[:1]))
    assert tight.kv_bytes() == 2 * per_slot and len(tight.sessions()) == 1
    tight.free_session(1)
    tight.run(2, tokens(3, 0), tight.ops(ops(0)[:1]))
    assert tight.kv_bytes() == per_slot
