"""A live `cpu:2` node serving FLUX.2-klein's components (--image-model-arch flux), found where
Cake's worker looks (`dirs::cache_dir()/hub`, here XDG_CACHE_HOME/hub, under the repository id
given as --model), driven as Cake's master drives them. The text encoder takes U32 ids [1, 512]
with `index_pos` the real token count. Its reply is Cake's pack_tensors of the hidden states after layers 8, 17, 26,
compared with transformers' whole Qwen3Model (its hidden_states 9, 18, 27) in f32 within F32_ATOL;
the VAE's with Flux2KleinPipeline's own decode steps; the MMDiT's BF16 velocity with diffusers'.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cakemp.errors import RemoteWorkerError
from cakemp.master.client import WorkerClient
from cakemp.wire import DType, RawTensor
from cakemp.wire.packing import unpack_layout
from tests.support.image import (
    FLUX_REPOSITORY,
    QWEN3,
    f32,
    flux_ids,
    flux_text_oracle,
    flux_transformer_oracle,
    flux_vae_oracle,
    pack,
    write_flux_cache,
    write_flux_transformer,
    write_flux_vae,
)
from tests.support.node import RunningNode, write_topology

F32_ATOL = 1e-5
BF16_RTOL = 8 * 2**-8  # the transformer replies in BF16, as Cake's: 8 eps of it
COMPONENTS = ["flux_text_encoder", "flux_vae", "flux_transformer"]  # the transformer alone on cpu:1
LENGTH = 512  # Cake pads the prompt's chat template to 512 tokens with <|endoftext|>


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return root, write_flux_cache(root), write_flux_vae(root), write_flux_transformer(root)


@pytest.fixture(scope="module")
def node(cache, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", COMPONENTS)
    running = RunningNode(FLUX_REPOSITORY, topology, "--gpus", "cpu:2", "--dtype", "f32", "--model-type",
                          "image-model", "--image-model-arch", "flux", env={"XDG_CACHE_HOME": str(cache[0])},
                          timeout=120)
    yield running
    running.kill()


def prompt(real: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, QWEN3["vocab_size"], (1, real), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, torch.full((1, LENGTH - real), 7)], dim=1)  # 7: the tiny vocabulary's padding


def u32(ids: torch.Tensor) -> RawTensor:
    return RawTensor(ids.to(torch.int32).numpy().tobytes(), DType.U32, tuple(ids.shape))


def unpacked(raw: RawTensor) -> torch.Tensor:
    assert raw.dtype == DType.F32 and len(raw.shape) == 1
    (layout,) = unpack_layout(raw.data)
    vector = torch.frombuffer(bytearray(raw.data), dtype=torch.float32)
    return vector[layout.start:layout.start + layout.count].view(layout.shape)


@pytest.mark.parametrize("real", [40, 0, LENGTH])
def test_the_text_encoder_replies_the_packed_hidden_states_of_layers_8_17_26(node, cache, real):
    """index_pos 40 masks the keys past the 40 real tokens; 0 and 512 mask nothing (as Cake)."""
    ids = prompt(real or 60, seed=real)

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            return await client.single_op("flux_text_encoder", u32(ids), real, 0)

    hidden = unpacked(run(main()))
    assert hidden.shape == (1, LENGTH, 3 * QWEN3["hidden_size"])
    torch.testing.assert_close(hidden, flux_text_oracle(cache[1])(ids.long(), real), atol=F32_ATOL, rtol=0)


def test_the_log_says_the_encoder_came_from_cakes_cache(node, cache):
    files = [e for e in node.events() if e.get("event") == "component files"]
    assert [e["weights"] for e in files] == [str(cache[1]), str(cache[2]), str(cache[3])]


def test_the_vae_denormalises_unpatchifies_and_decodes_as_diffusers_pipeline(node, cache):
    """[dims (h, w), latents [1, h·w, 16]] decodes to the image Flux2KleinPipeline's own steps give,
    in F32; Cake's legacy [direction 0, latents [1, 4, H, W]] decodes those latents as they are."""
    h, w = 3, 5
    latents = torch.randn(1, h * w, 16)
    spatial = torch.randn(1, 4, 6, 6)

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            new = await client.single_op("flux_vae", f32(pack(torch.tensor([float(h), float(w)]), latents)), 0, 0)
            legacy = await client.single_op("flux_vae", f32(pack(torch.tensor([0.0]), spatial)), 0, 0)
            return new, legacy

    new, legacy = run(main())
    image = torch.frombuffer(bytearray(new.data), dtype=torch.float32).view(new.shape)
    assert new.dtype == DType.F32 and image.shape == (1, 3, 4 * h, 4 * w)
    torch.testing.assert_close(image, flux_vae_oracle(cache[2])(latents, h, w), atol=F32_ATOL, rtol=0)
    assert legacy.shape == (1, 3, 12, 12)


def test_concurrent_transformer_steps_reply_bf16_velocities_as_diffusers(node, cache):
    """Two masters' steps (same image size, their own timesteps and latents) through the MMDiT:
    each velocity [1, S, 16] in BF16 is diffusers' (f32, rounded to BF16) within 8 BF16 eps."""
    h, w, text = 2, 3, 8
    img_ids, txt_ids = flux_ids(h, w, text)
    calls = [(torch.randn(1, h * w, 16), torch.randn(1, text, 48), t) for t in (0.9, 0.3)]

    async def step(img, txt, t):
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            return await client.single_op("flux_transformer", f32(pack(img, img_ids, txt, txt_ids,
                                                                             torch.tensor([t]))), 0, 0)

    async def main():
        return await asyncio.gather(*(step(*call) for call in calls))

    oracle = flux_transformer_oracle(cache[3])
    for reply, (img, txt, t) in zip(run(main()), calls):
        assert reply.dtype == DType.BF16 and reply.shape == (1, h * w, 16)
        got = torch.frombuffer(bytearray(reply.data), dtype=torch.bfloat16).view(reply.shape).float()
        expected = oracle(img, img_ids, txt, txt_ids, t).to(torch.bfloat16).float()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=BF16_RTOL)


MALFORMED = {
    "a token past the vocabulary": ("flux_text_encoder", u32(torch.tensor([[1, QWEN3["vocab_size"]]])),
                                    "outside the vocabulary of 500"),
    "latents that are not the dims' grid": ("flux_vae", f32(pack(torch.tensor([2.0, 2.0]), torch.zeros(1, 5, 16))),
                                            "are not [b, h·w = 4, 16]"),
    "the vae's encode direction": ("flux_vae", f32(pack(torch.tensor([1.0]), torch.zeros(1, 3, 8, 8))),
                                   "only decode (direction 0) is served"),
    "text of the wrong width": ("flux_transformer", f32(pack(torch.zeros(1, 6, 16), *flux_ids(2, 3, 8)[:1],
                                                             torch.zeros(1, 8, 40), flux_ids(2, 3, 8)[1],
                                                             torch.tensor([0.5]))), "txt [b, L, 48]"),
    "a pack of four for the transformer": ("flux_transformer", f32(pack(*(torch.zeros(1, 2, 2) for _ in range(4)))),
                                           "the pack holds tensors of ranks [3, 3, 3, 3]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_flux_calls_are_refused_by_name_and_the_connection_goes_on(node, case):
    component, x, words = MALFORMED[case]

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            with pytest.raises(RemoteWorkerError) as error:
                await client.single_op(component, x, 0, 0)
            after = await client.single_op("flux_vae", f32(pack(torch.tensor([1.0, 1.0]), torch.zeros(1, 1, 16))), 0, 0)
            return str(error.value), after

    message, after = run(main())
    assert words in message
    assert after.shape == (1, 3, 4, 4)
