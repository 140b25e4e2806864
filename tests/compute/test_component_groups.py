"""Image component calls are grouped within the device's activation budget: calls that each fit it but
not all together run as more than one batch, each batch's estimated cost within the budget."""

from __future__ import annotations

import torch

from cakemp.compute.components import Call
from tests.compute.test_components import runner, snapshot  # noqa: F401  (the module's SD components)
from tests.support.image import LATENT, f32, pack


def unet_call(session: int) -> Call:
    generator = torch.Generator().manual_seed(session)
    latents, text = torch.randn(2, *LATENT, generator=generator), torch.randn(2, 77, 32, generator=generator)
    return Call(session, f32(pack(latents, text, torch.tensor([10.0]))), 1)


def test_calls_that_fit_the_budget_alone_but_not_together_run_as_batches_within_it(runner):  # noqa: F811
    calls = [unet_call(i) for i in range(3)]
    cost = runner._prepared(calls[0])[1]  # equal shapes: each call's estimate is the same
    groups: list[list[int]] = []
    alone = runner.run_batch(calls, together=groups.append)
    assert groups == [[0, 1, 2]]  # no budget: one batch
    runner.budget_bytes = 2 * cost + cost // 2  # two calls fit, three do not
    try:
        groups.clear()
        within = runner.run_batch(calls, together=groups.append)
    finally:
        runner.budget_bytes = None
    assert groups == [[0, 1], [2]]
    for a, b in zip(alone, within, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
