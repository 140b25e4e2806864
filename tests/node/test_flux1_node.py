"""A live `cpu:2` node serving FLUX.1's `flux1_transformer` (--image-model-arch flux1) from a
single-file checkpoint as Cake's worker takes it (--model flux1-dev-fp8.safetensors: BFL's names
under model.diffusion_model., FP8 matrices without scales, other components' tensors beside),
driven as Cake's master drives it. The oracle is diffusers' own: its single-file BFL -> diffusers
converter (with the tiny width in place of its hard-coded 3072) and FluxTransformer2DModel in f32,
called as FluxPipeline calls it; the node computes in f32 (--dtype f32) and replies in BF16 as
Cake's worker, so the reply must be the oracle's velocity rounded to BF16 within 8 BF16 eps.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cakemp.errors import RemoteWorkerError
from cakemp.master.client import WorkerClient
from cakemp.wire import DType
from tests.support.image import FLUX1, f32, flux1_ids, flux1_transformer_oracle, pack, write_flux1_checkpoint
from tests.support.node import RunningNode, write_topology

BF16_RTOL = 8 * 2**-8
H, W, TEXT = 2, 3, 5  # a 2x3 latent grid, 5 T5 tokens (Cake does not pad them)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_flux1_checkpoint(tmp_path_factory.mktemp("flux1") / "flux1-dev-fp8.safetensors")


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return flux1_transformer_oracle(checkpoint)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["flux1_transformer"])
    running = RunningNode(str(checkpoint), topology, "--gpus", "cpu:2", "--dtype", "f32", "--model-type",
                          "image-model", "--image-model-arch", "flux1", timeout=120)
    yield running
    running.kill()


def step(timestep: float, guidance: float | None, seed: int) -> tuple[torch.Tensor, ...]:
    """One denoising step's tensors as Cake's master packs them: img, img_ids, txt, txt_ids, t, y[, guidance]."""
    generator = torch.Generator().manual_seed(seed)
    img_ids, txt_ids = flux1_ids(H, W, TEXT)
    tensors = (torch.randn(1, H * W, FLUX1["channels"], generator=generator), img_ids,
               torch.randn(1, TEXT, FLUX1["text"], generator=generator), txt_ids, torch.tensor([timestep]),
               torch.randn(1, FLUX1["pooled"], generator=generator))
    return tensors if guidance is None else (*tensors, torch.tensor([guidance]))


async def call(node, tensors) -> torch.Tensor:
    async with await WorkerClient.connect("127.0.0.1", node.port) as client:
        await client.hello()
        reply = await client.single_op("flux1_transformer", f32(pack(*tensors)), 0, 0)
    assert reply.dtype == DType.BF16 and reply.shape == (1, H * W, FLUX1["channels"])
    return torch.frombuffer(bytearray(reply.data), dtype=torch.bfloat16).view(reply.shape).float()


def test_the_log_says_the_architecture_came_from_the_checkpoint(node, checkpoint):
    (files,) = [e for e in node.events() if e.get("event") == "component files"]
    assert (files["weights"], files["config_from"]) == (str(checkpoint), "tensor shapes")


def test_concurrent_steps_reply_bf16_velocities_as_diffusers(node, oracle):
    """Two masters' steps (their own latents, text, timestep and guidance), batched by the node."""
    steps = [step(0.9, 3.5, seed=1), step(0.3, 1.0, seed=2)]

    async def main():
        return await asyncio.gather(*(call(node, tensors) for tensors in steps))

    for got, (img, img_ids, txt, txt_ids, t, y, guidance) in zip(run(main()), steps):
        expected = oracle(img, img_ids, txt, txt_ids, float(t), y, float(guidance)).to(torch.bfloat16).float()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=BF16_RTOL)


MALFORMED = {
    "no guidance for a checkpoint that embeds it": (step(0.5, None, seed=3), "needs the guidance [1] as its 7th"),
    "a pooled vector of the wrong width": ((*step(0.5, 3.5, seed=3)[:5], torch.zeros(1, 7), torch.tensor([3.5])),
                                           "y [1, 24], got"),
    "image ids of two coordinates": ((*step(0.5, 3.5, seed=3)[:1], torch.zeros(1, H * W, 2),
                                      *step(0.5, 3.5, seed=3)[2:]), "its ids [1, S, 3]"),
    "an infinite timestep": ((*step(0.5, 3.5, seed=3)[:4], torch.tensor([float("inf")]), *step(0.5, 3.5, seed=3)[5:]),
                             "the timestep and guidance are one finite number each"),
    "a pack of four": (tuple(torch.zeros(1, 2, 2) for _ in range(4)), "the pack holds tensors of ranks [3, 3, 3, 3]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_step_is_refused_by_name_and_a_bystander_is_unharmed(node, oracle, case):
    """The refused connection goes on, and another master's step at the same time is answered right."""
    tensors, words = MALFORMED[case]
    good = step(0.6, 3.5, seed=4)

    async def refused():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            with pytest.raises(RemoteWorkerError) as error:
                await client.single_op("flux1_transformer", f32(pack(*tensors)), 0, 0)
            await client.single_op("flux1_transformer", f32(pack(*good)), 0, 0)
            return str(error.value)

    async def main():
        return await asyncio.gather(refused(), call(node, good))

    message, bystander = run(main())
    assert words in message
    img, img_ids, txt, txt_ids, t, y, guidance = good
    expected = oracle(img, img_ids, txt, txt_ids, 0.6, y, 3.5).to(torch.bfloat16)
    torch.testing.assert_close(bystander, expected.float(), atol=1e-5, rtol=BF16_RTOL)
