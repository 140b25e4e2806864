"""The router: which device runs which ops of a Batch, and how a long prompt is cut (pure functions)."""

from __future__ import annotations

import pytest

from cakemp.front.router import Route, Router, chunk_bounds
from cakemp.ipc import Op, Stage
from cakemp.wire import LayerOp, LayerOps

PLACEMENT = [("model.layers.0", "model.layers.1"), ("model.layers.2",), ("model.layers.3",)]
GENERATIONS = {0: 4, 1: 1, 2: 7}  # each device's current process


def op(layer: int, pos: int = 0) -> LayerOp:
    return LayerOp(f"model.layers.{layer}", pos, layer)


def test_a_run_over_three_devices_is_one_stage_per_device_in_order():
    """Consecutive ops on one device form one stage, expecting that device's current generation; each
    op names the layer by its index on that device."""
    route = Router(PLACEMENT).plan(LayerOps.of([op(0, 5), op(1, 5), op(2, 5), op(3, 5)]), GENERATIONS.get)
    assert route == Route.through((Stage.of(0, 4, (Op(0, 5, 0), Op(1, 5, 1))), Stage.of(1, 1, (Op(0, 5, 2),)),
                                   Stage.of(2, 7, (Op(0, 5, 3),))))
    assert route.devices == (0, 1, 2)


def test_a_run_that_comes_back_to_a_device_gets_a_stage_for_each_visit():
    """Layers 3, 0, 2 visit devices 2, 0, 1: three stages in the Batch's order."""
    assert Router(PLACEMENT).plan(LayerOps.of([op(3), op(0), op(2)]), GENERATIONS.get).devices == (2, 0, 1)


def test_a_chunk_later_in_the_prompt_runs_every_op_shifted_by_its_start():
    """The chunk starting 16 tokens in runs each stage's ops 16 positions later, in the same slots."""
    route = Router(PLACEMENT).plan(LayerOps.of([op(1, 3), op(2, 3)]), GENERATIONS.get)
    assert route.shifted(16) == (Stage.of(0, 4, (Op(1, 19, 1),)), Stage.of(1, 1, (Op(0, 19, 2),)))
    assert route.shifted(0) == route.stages


@pytest.mark.parametrize("tokens, chunk, bounds", [
    (1, 64, ((0, 1),)),
    (64, 64, ((0, 64),)),  # fits one chunk: not cut
    (65, 64, ((0, 33), (33, 65))),  # two chunks of near-equal size, no 1-token tail
    (512, 64, tuple((i, i + 64) for i in range(0, 512, 64))),
    (3, 2, ((0, 2), (2, 3))),
    (10, 3, ((0, 3), (3, 6), (6, 8), (8, 10))),
])
def test_a_prompt_is_cut_into_the_fewest_even_chunks(tokens, chunk, bounds):
    """Chunks cover the prompt in order, none longer than `chunk`, as few as that allows, sizes within one token."""
    assert chunk_bounds(tokens, chunk) == bounds


@pytest.mark.parametrize("chunk", [1, 2, 3, 16, 100, 128])
def test_every_prompt_length_is_covered_in_order_by_the_fewest_chunks_within_one_token(chunk):
    """For each length up to 600: the chunks tile [0, tokens) in order, none over `chunk`, as few as
    ceil(tokens / chunk), their sizes within one token; a prompt of at most `chunk` is one chunk."""
    for tokens in range(1, 601):
        bounds = chunk_bounds(tokens, chunk)
        sizes = [end - start for start, end in bounds]
        assert [start for start, _ in bounds] == [0, *(end for _, end in bounds[:-1])]
        assert bounds[-1][1] == tokens and sum(sizes) == tokens
        assert max(sizes) <= chunk and max(sizes) - min(sizes) <= 1
        assert len(bounds) == -(-tokens // chunk)
        assert (len(bounds) == 1) == (tokens <= chunk)


def test_a_run_planned_again_takes_its_new_positions_and_each_devices_generation_now():
    """A run's stages are worked out once, but each plan carries the request's own positions and slots and
    expects each device's process of the moment (one restarted meanwhile: its new generation)."""
    router, generations = Router(PLACEMENT), dict(GENERATIONS)
    first = router.plan(LayerOps.of([op(1, 5), op(2, 5)]), generations.get)
    generations[1] = 2
    again = router.plan(LayerOps.of([LayerOp("model.layers.1", 9, 0), LayerOp("model.layers.2", 9, 3)]), generations.get)
    assert first.stages == (Stage.of(0, 4, (Op(1, 5, 1),)), Stage.of(1, 1, (Op(0, 5, 2),)))
    assert again.stages == (Stage.of(0, 4, (Op(1, 9, 0),)), Stage.of(1, 2, (Op(0, 9, 3),)))
    assert type(again.stages[0].ops[0]) is Op
