"""The router: which device runs which ops of a Batch, and how a long prompt is cut (pure functions)."""

from __future__ import annotations

import pytest

from cakemp.errors import UnknownLayer
from cakemp.front.router import Leg, Router, chunk_bounds
from cakemp.ipc import Op
from cakemp.wire import LayerOp

PLACEMENT = [("model.layers.0", "model.layers.1"), ("model.layers.2",), ("model.layers.3",)]


def op(layer: int, pos: int = 0) -> LayerOp:
    return LayerOp(f"model.layers.{layer}", pos, layer)


def test_a_run_over_three_devices_is_one_leg_per_device_in_order():
    """Consecutive ops on one device form one leg; each op names the layer by its index on that device."""
    legs = Router(PLACEMENT).plan([op(0, 5), op(1, 5), op(2, 5), op(3, 5)])
    assert legs == (Leg(0, (Op(0, 5, 0), Op(1, 5, 1))), Leg(1, (Op(0, 5, 2),)), Leg(2, (Op(0, 5, 3),)))


def test_a_run_that_comes_back_to_a_device_gets_a_leg_for_each_visit():
    """Layers 3, 0, 2 visit devices 2, 0, 1: three legs in the Batch's order."""
    assert [leg.device for leg in Router(PLACEMENT).plan([op(3), op(0), op(2)])] == [2, 0, 1]


def test_an_unknown_layer_is_refused_by_name():
    with pytest.raises(UnknownLayer, match="could not find layer model.layers.9"):
        Router(PLACEMENT).plan([op(0), op(9)])


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
