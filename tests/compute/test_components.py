"""The component runner in-process: calls of one component with equal shapes are computed as one
batch and each answered as if alone; a bad call fails alone; replies are in the runner's dtype."""

from __future__ import annotations

import pytest
import torch

from cakemp.checkpoint.image.locator import ImageFlags
from cakemp.checkpoint.image.sd_files import locate
from cakemp.compute.components import Call, ComponentRunner
from cakemp.errors import BadTensor, CheckpointError
from tests.support.image import (
    FLUX1,
    LATENT,
    f32,
    flux1_ids,
    flux1_transformer_oracle,
    oracle,
    pack,
    token_ids,
    write_cache,
    write_flux1_checkpoint,
    write_xl_cache,
    xl_oracle,
)

F32_ATOL = 1e-5


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return root, write_cache(root)


@pytest.fixture(scope="module")
def runner(snapshot):
    files = [(name, locate(name, ImageFlags(str(snapshot[0]), "v1-5"))) for name in ("clip", "unet", "vae")]
    return ComponentRunner.load("sd", "v1-5", [(name, _Files(located)) for name, located in files], "cpu",
                                torch.float32)


class _Files:
    def __init__(self, located):
        self.weights, self.config = str(located.weights), str(located.config)


class _Counting:
    """Wraps a component to count its batched runs."""

    def __init__(self, component):
        self.component, self.runs = component, []

    def __getattr__(self, name):
        return getattr(self.component, name)

    def run(self, calls):
        self.runs.append(len(calls))
        return self.component.run(calls)


def test_unet_calls_of_equal_shapes_run_as_one_batch_each_with_its_timestep(runner, snapshot):
    ref = oracle(snapshot[1])
    inputs = [(torch.randn(2, *LATENT), torch.randn(2, 77, 32), float(t)) for t in (10, 500, 999)]
    counting = _Counting(runner.components[1])
    runner.components = (runner.components[0], counting, runner.components[2])
    try:
        outputs = runner.run_batch([Call(i, f32(pack(l, x, torch.tensor([t]))), 1) for i, (l, x, t) in
                                    enumerate(inputs)])
    finally:
        runner.components = (runner.components[0], counting.component, runner.components[2])
    assert counting.runs == [3]
    with torch.no_grad():
        for output, (latents, text, t) in zip(outputs, inputs):
            expected = ref["unet"](latents, torch.tensor(t), encoder_hidden_states=text).sample
            torch.testing.assert_close(output, expected, atol=F32_ATOL, rtol=0)


def test_a_bad_call_fails_alone_and_shapes_that_differ_run_apart(runner):
    good = Call(1, token_ids([0, 2]), 0)
    short = Call(2, token_ids([0, 2], length=10), 0)
    bad = Call(3, token_ids([0, 5000]), 0)
    results = runner.run_batch([good, short, bad])
    assert results[0].shape == (1, 77, 32) and results[1].shape == (1, 10, 32)
    assert isinstance(results[2], BadTensor) and "outside the vocabulary" in str(results[2])


def test_replies_are_in_the_runners_dtype(snapshot):
    files = [("vae", _Files(locate("vae", ImageFlags(str(snapshot[0]), "v1-5"))))]
    runner = ComponentRunner.load("sd", "v1-5", files, "cpu", torch.bfloat16)
    (image,) = runner.run_batch([Call(1, f32(pack(torch.tensor([0.0]), torch.randn(1, *LATENT))), 0)])
    assert image.dtype == torch.bfloat16 and image.shape == (1, 3, 16, 16)


def test_sdxl_components_drop_the_added_conditioning_and_the_projection(tmp_path):
    """An SDXL unet whose config and file hold the pooled-text and time-id conditioning computes
    without it (Cake's master never sends it), and clip2 (a CLIP with projection) answers its
    text model's last hidden state, as the oracle built without them."""
    snapshot = write_xl_cache(tmp_path)
    files = [(name, _Files(locate(name, ImageFlags(str(tmp_path), "xl")))) for name in ("clip2", "unet")]
    runner = ComponentRunner.load("sd", "xl", files, "cpu", torch.float32)
    ref = xl_oracle(snapshot)
    latents, text = torch.randn(2, *LATENT), torch.randn(2, 77, 32)
    hidden, noise = runner.run_batch([Call(1, token_ids([0, 9, 2]), 0),
                                      Call(2, f32(pack(latents, text, torch.tensor([300.0]))), 1)])
    with torch.no_grad():
        expected = ref["clip2"](input_ids=torch.tensor([[0, 9] + [2] * 75])).last_hidden_state
        torch.testing.assert_close(hidden, expected, atol=F32_ATOL, rtol=0)
        expected = ref["unet"](latents, torch.tensor(300.0), encoder_hidden_states=text).sample
        torch.testing.assert_close(noise, expected, atol=F32_ATOL, rtol=0)


def test_a_flux1_schnell_checkpoint_embeds_no_guidance_and_ignores_one(tmp_path):
    """A FLUX.1 file without guidance_in (schnell) computes diffusers' guidance-free velocity, with or
    without a guidance tensor in the pack (Cake's master may send one)."""
    path = write_flux1_checkpoint(tmp_path / "flux1-schnell.safetensors", guidance=False)
    runner = ComponentRunner.load("flux1", "", [("flux1_transformer", _Flux1File(path))], "cpu", torch.float32)
    img_ids, txt_ids = flux1_ids(2, 2, 3)
    img, txt, y = torch.randn(1, 4, FLUX1["channels"]), torch.randn(1, 3, FLUX1["text"]), torch.randn(1, FLUX1["pooled"])
    steps = [pack(img, img_ids, txt, txt_ids, torch.tensor([0.5]), y),
             pack(img, img_ids, txt, txt_ids, torch.tensor([0.5]), y, torch.tensor([3.5]))]
    replies = runner.run_batch([Call(session, f32(x), 0) for session, x in enumerate(steps)])
    expected = flux1_transformer_oracle(path, guidance=False)(img, img_ids, txt, txt_ids, 0.5, y, None)
    for reply in replies:
        torch.testing.assert_close(reply.float(), expected.to(torch.bfloat16).float(), atol=1e-5, rtol=8 * 2**-8)


def test_a_file_that_is_no_flux1_transformer_is_refused_at_load(snapshot):
    """The SD UNet's file has no FLUX.1 tensors: a CheckpointError naming the file, not a crash."""
    unet = snapshot[1] / "unet" / "diffusion_pytorch_model.fp16.safetensors"
    with pytest.raises(CheckpointError, match="holds no FLUX.1 transformer"):
        ComponentRunner.load("flux1", "", [("flux1_transformer", _Flux1File(unet))], "cpu", torch.float32)


class _Flux1File:
    def __init__(self, path):
        self.weights, self.config = str(path), None
