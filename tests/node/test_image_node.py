"""A live `cpu:2` node serving tiny Stable Diffusion 1.5 components (--model-type image-model),
driven as Cake's image master drives a worker: one SingleOp per component call.

The components are diffusers and transformers modules with random weights in the HF cache
layout (tests/support/image.py). Each reply is compared with the same modules in-process with Cake's
deviations applied (candle's tanh GELU), in f32: the observed error is below 1e-6; the bound is
F32_ATOL. Malformed packings and mixed-up requests get their WorkerError, by name, while a
bystander session's UNet step stays exact and no device restarts.
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys

import pytest
import torch
from diffusers import DDIMScheduler

from cakemp.errors import RemoteWorkerError
from cakemp.master.client import WorkerClient
from cakemp.wire import DType, RawTensor, WorkerInfo
from tests.support.image import LATENT, VAE_SCALE, f32, oracle, pack, token_ids, write_cache
from tests.support.node import RunningNode, scrape, wait_until, write_topology

F32_ATOL = 1e-5
# The loop's bound: a UNet step's f32 rounding (the node's threads sum in another order, ~1e-6) is
# multiplied by the guidance (7.5) and by DDIM's 1/sqrt(alpha) at the first timesteps (~15).
LOOP_ATOL = 2e-4
COMPONENTS = ["clip", "vae", "unet"]  # by topology order: clip and vae on cpu:0, unet on cpu:1
TEXT = (77, 32)
GUIDANCE = 7.5


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return root, write_cache(root)


@pytest.fixture(scope="module")
def node(snapshot, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", COMPONENTS)
    running = RunningNode(snapshot[0], topology, "--gpus", "cpu:2", "--dtype", "f32", "--model-type", "image-model",
                          "--sd-version", "v1-5", "--metrics-address", "127.0.0.1:0", timeout=120)
    yield running
    running.kill()


@pytest.fixture(scope="module")
def ref(snapshot):
    return oracle(snapshot[1])


def from_raw(raw: RawTensor) -> torch.Tensor:
    assert raw.dtype == DType.F32
    return torch.frombuffer(bytearray(raw.data), dtype=torch.float32).view(raw.shape)


async def connected(node: RunningNode) -> WorkerClient:
    client = await WorkerClient.connect("127.0.0.1", node.port)
    await client.hello()
    return client


async def call(client: WorkerClient, component: str, x: RawTensor) -> torch.Tensor:
    return from_raw(await client.single_op(component, x, 0, 0))


def unet_input(seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor, float]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, *LATENT, generator=generator), torch.randn(batch, *TEXT, generator=generator),
            float(100 + seed))


def unet_ref(ref, latents, text, timestep) -> torch.Tensor:
    with torch.no_grad():
        return ref["unet"](latents, torch.tensor(timestep), encoder_hidden_states=text).sample


def test_each_component_answers_as_diffusers_with_cakes_deviations(node, ref):
    """clip's last hidden state (after the final norm, tanh GELU), a UNet step and a VAE decode
    equal the in-process modules, in the node's dtype and the component's shape."""
    ids = [0, 17, 256, 999, 2]

    async def main():
        async with await connected(node) as client:
            hidden = await call(client, "clip", token_ids(ids))
            latents, text, timestep = unet_input(1)
            noise = await call(client, "unet", f32(pack(latents, text, torch.tensor([timestep]))))
            image = await call(client, "vae", f32(pack(torch.tensor([0.0]), latents[:1])))
            return hidden, noise, image, (latents, text, timestep)

    hidden, noise, image, (latents, text, timestep) = run(main())
    with torch.no_grad():
        padded = torch.tensor([ids + [ids[-1]] * (77 - len(ids))])
        torch.testing.assert_close(hidden, ref["clip"](input_ids=padded).last_hidden_state, atol=F32_ATOL, rtol=0)
        torch.testing.assert_close(image, ref["vae"].decode(latents[:1]).sample, atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(noise, unet_ref(ref, latents, text, timestep), atol=F32_ATOL, rtol=0)
    assert hidden.shape == (1, *TEXT) and image.shape == (1, 3, 16, 16)


def test_vae_encode_samples_latents_of_the_images_shape(node, ref):
    """direction 1 encodes an image [1, 3, 16, 16] to latents [1, 4, 8, 8] sampled around the
    posterior's mean (the worker's RNG draws the noise, as Cake's)."""
    image = torch.rand(1, 3, 16, 16) * 2 - 1

    async def main():
        async with await connected(node) as client:
            return await call(client, "vae", f32(pack(torch.tensor([1.0]), image)))

    latents = run(main())
    with torch.no_grad():
        posterior = ref["vae"].encode(image).latent_dist
    assert latents.shape == (1, *LATENT)
    assert ((latents - posterior.mean).abs() <= 6 * posterior.std).all()


async def denoise(clip, unet, vae) -> tuple[torch.Tensor, torch.Tensor]:
    """Cake's master's loop over three async component calls: clip(ids), unet(latents, text,
    timestep), vae(latents) (decode); the final latents and image."""
    scheduler = DDIMScheduler()
    scheduler.set_timesteps(3)
    text = torch.cat([await clip(token_ids([0, 2])), await clip(token_ids([0, 5, 6, 7, 2]))])  # uncond, cond
    latents = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(7))
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(torch.cat([latents, latents]), t)
        noise_uncond, noise_cond = (await unet(model_input, text, float(t))).chunk(2)
        latents = scheduler.step(noise_uncond + GUIDANCE * (noise_cond - noise_uncond), t, latents).prev_sample
    return latents, await vae(latents / VAE_SCALE)


def test_a_denoising_loop_through_the_node_gives_the_in_process_latents(node, ref):
    """Cake's master's sequence (clip for the prompt and for the empty prompt, as two calls; per
    step one unet call on [uncond, cond], classifier-free guidance and a DDIM step at the master;
    a vae decode of latents / scale at the end) gives the latents and image of the same loop in-process."""

    async def local():
        with torch.no_grad():
            return await denoise(
                lambda raw: _now(ref["clip"](input_ids=from_ids(raw)).last_hidden_state),
                lambda x, text, t: _now(unet_ref(ref, x, text, t)), lambda z: _now(ref["vae"].decode(z).sample))

    async def remote():
        async with await connected(node) as client:
            return await denoise(lambda raw: call(client, "clip", raw),
                                 lambda x, text, t: call(client, "unet", f32(pack(x, text, torch.tensor([t])))),
                                 lambda z: call(client, "vae", f32(pack(torch.tensor([0.0]), z))))

    expected, got = run(local()), run(remote())
    torch.testing.assert_close(got[0], expected[0], atol=LOOP_ATOL, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=LOOP_ATOL, rtol=0)


async def _now(value):
    return value


def from_ids(raw: RawTensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw.data), dtype=torch.int32).view(raw.shape).long()


def test_concurrent_masters_unet_steps_each_get_their_own_answer(node, ref):
    """Four masters' UNet steps at once (batched on the UNet's device when they meet there; each
    with its own timestep) are each answered as if computed alone."""
    inputs = [unet_input(seed) for seed in range(4)]

    async def main():
        clients = [await connected(node) for _ in inputs]
        try:
            return await asyncio.gather(*(call(client, "unet", f32(pack(l, t, torch.tensor([s]))))
                                          for client, (l, t, s) in zip(clients, inputs)))
        finally:
            await asyncio.gather(*(client.close() for client in clients))

    for noise, (latents, text, timestep) in zip(run(main()), inputs):
        torch.testing.assert_close(noise, unet_ref(ref, latents, text, timestep), atol=F32_ATOL, rtol=0)


def test_goodbye_answers_worker_info(node):
    """Goodbye on a component connection answers WorkerInfo (Cake's worker panics there), and the
    connection goes on serving."""

    async def main():
        async with await connected(node) as client:
            await call(client, "clip", token_ids([0, 2]))
            info = await client.goodbye()
            hidden = await call(client, "clip", token_ids([0, 2]))
            return info, hidden

    info, hidden = run(main())
    assert isinstance(info, WorkerInfo) and info.dtype == "F32"
    assert hidden.shape == (1, *TEXT)


GOOD_UNET = pack(*unet_input(0, 1)[:2], torch.tensor([10.0]))
MALFORMED = {
    "no tensors": ("unet", f32([0.0]), "the tensor count is 0.0"),
    "a count that is no number": ("unet", f32([float("nan"), 1, 1, 0]), "the tensor count is nan"),
    "a fractional dim": ("unet", f32([1, 1, 2.5, 0, 0]), "tensor 0's dim 0 is 2.5"),
    "more dims than any tensor has": ("unet", f32([1, 9] + [1] * 10), "tensor 0's ndim is 9.0"),
    "a header that ends early": ("unet", f32([3, 4, 2]), "the vector ends before tensor 0's dim 1"),
    "data shorter than its shape": ("unet", f32([1, 2, 1000, 1000, 0.5]), "needs 1000000 elements, 1 are left"),
    "elements after the last tensor": ("vae", f32([1, 1, 1, 0.0, 7.0]), "1 elements follow the 1 tensors"),
    "the wrong tensors for the unet": ("unet", f32(pack(torch.zeros(1), torch.zeros(1))), "the pack holds tensors "
                                       "of ranks [1, 1]"),
    "token ids to the unet": ("unet", token_ids([1, 2]), "takes one packed F32 vector"),
    "floats to clip": ("clip", f32([1.0, 2.0]), "clip takes U32 token ids"),
    "a token past the vocabulary": ("clip", token_ids([1, 1000]), "outside the vocabulary of 1000"),
    "an id past 2^31": ("clip", RawTensor(struct.pack("<2I", 1, 1 << 31), DType.U32, (1, 2)), "outside the vocabulary"),
    "too many tokens": ("clip", token_ids([1], 78), "78 tokens, at most 77"),
    # Past the front's own bounds (component_admission.py), its words, not the device's: the device
    # would run 9 prompts of 2 ids, and refuse 1025 ids only as past its 77.
    "more prompts than a master sends": ("clip", RawTensor(struct.pack("<18I", *[1] * 18), DType.U32, (9, 2)),
                                         "clip takes token ids [b, L] with 1 <= b <= 8 and 1 <= L <= 1024, got shape [9, 2]"),
    "more ids than the front takes": ("clip", token_ids([1], 1025), "1 <= L <= 1024, got shape [1, 1025]"),
    "latents of the wrong channels": ("unet", f32(pack(torch.zeros(1, 3, 8, 8), torch.zeros(1, *TEXT), torch.ones(1))),
                                      "latents have 3 channels"),
    "text of the wrong width": ("unet", f32(pack(torch.zeros(1, *LATENT), torch.zeros(1, 77, 8), torch.ones(1))),
                                "text embeddings are 8 wide"),
    "an odd latent side": ("unet", f32(pack(torch.zeros(1, 4, 7, 8), torch.zeros(1, *TEXT), torch.ones(1))),
                           "latents of 7x8"),
    "a batch past the limit": ("unet", f32(pack(torch.zeros(9, *LATENT), torch.zeros(9, *TEXT), torch.ones(1))),
                               "latents [2b,4,h,w] has shape [9, 4, 8, 8], past its limits [8, '-', 512, 512]"),
    "text past 1024 tokens": ("unet", f32(pack(torch.zeros(1, *LATENT), torch.zeros(1, 1025, 32), torch.ones(1))),
                              "text embeddings [2b,L,D] has shape [1, 1025, 32], past its limits [8, 1024, '-']"),
    "an image side past 4096": ("vae", f32(pack(torch.tensor([1.0]), torch.zeros(1, 3, 4098, 2))),
                                "has shape [1, 3, 4098, 2], past its limits [8, '-', 4096, 4096]"),
    # Within every limit, but a 512x512 latent's attention scores alone are ~1 TiB: refused by the
    # device's budget before any of it is allocated, on the bystander's own device.
    "a call past the device's budget": ("unet", f32(pack(torch.zeros(1, 4, 512, 512), torch.zeros(1, *TEXT),
                                                         torch.ones(1))), "past this device's budget"),
    "a vae direction of 2": ("vae", f32(pack(torch.tensor([2.0]), torch.zeros(1, *LATENT))), "the direction is 1"),
    "a component not served": ("clip2", token_ids([1]), "could not find component clip2 (this node serves clip, vae, unet)"),
    "a text layer": ("model.layers.0", f32([1.0]), "could not find component model.layers.0"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_requests_are_refused_by_name_and_touch_no_other_session(node, ref, case):
    """Each malformed call gets a WorkerError saying what is wrong; its connection then serves a good
    call, a bystander's UNet step around it stays exact, and no device restarts."""
    component, x, words = MALFORMED[case]
    latents, text, timestep = unet_input(3)

    async def main():
        bystander = await connected(node)
        async with bystander, await connected(node) as client:
            step = asyncio.create_task(call(bystander, "unet", f32(pack(latents, text, torch.tensor([timestep])))))
            with pytest.raises(RemoteWorkerError) as error:
                await client.single_op(component, x, 0, 0)
            after = await call(client, "unet", f32(GOOD_UNET))
            return str(error.value), await step, after

    message, noise, after = run(main())
    assert words in message
    torch.testing.assert_close(noise, unet_ref(ref, latents, text, timestep), atol=F32_ATOL, rtol=0)
    assert after.shape == (1, *LATENT)
    assert sum(v for (name, _), v in scrape(node.metrics_port()).items() if name == "cakemp_device_restarts_total") == 0


def batches_run(node: RunningNode, device: str) -> tuple[float, float]:
    """How many batches `device` reported computing, and how many calls they held in all."""
    metrics = scrape(node.metrics_port())
    return tuple(metrics.get((name, (("device", device),)), 0.0)
                 for name in ("cakemp_device_batch_size_count", "cakemp_device_batch_size_sum"))


def test_a_call_far_costlier_than_a_bystanders_is_not_computed_with_it(node, ref):
    """Two calls waiting at the UNet's device together (behind a slow one) are computed as one batch
    when they cost about the same, and apart when one costs 8 times the other (a batch of 8): the
    device's batch-size histogram shows which. The bystander's answer is exact either way."""
    blocker = f32(pack(torch.zeros(4, 4, 64, 64), torch.zeros(4, *TEXT), torch.ones(1)))  # ~1 s on one core
    small = unet_input(5, 1)
    large = unet_input(6, 8)

    async def behind_blocker(other):
        clients = [await connected(node) for _ in range(3)]
        try:
            idle = await asyncio.to_thread(batches_run, node, "cpu:1")
            first = asyncio.create_task(call(clients[0], "unet", blocker))
            # The blocker's batch is reported as it starts computing: from then on the others queue behind it.
            def computing():
                counted = batches_run(node, "cpu:1")
                return counted if counted[0] > idle[0] else None

            before = await asyncio.to_thread(wait_until, computing, what="the blocker computing")
            calls = [call(client, "unet", f32(pack(l, t, torch.tensor([s]))))
                     for client, (l, t, s) in zip(clients[1:], (small, other))]
            replies = await asyncio.gather(first, *calls)
            after = await asyncio.to_thread(batches_run, node, "cpu:1")
            return replies[1], (after[0] - before[0], after[1] - before[1])
        finally:
            await asyncio.gather(*(client.close() for client in clients))

    alike, alike_batches = run(behind_blocker(unet_input(7, 1)))
    apart, apart_batches = run(behind_blocker(large))
    assert alike_batches == (1, 2)  # the two small calls, as one batch (the blocker was counted before)
    assert apart_batches == (2, 2)  # the small call and the large one, each alone
    for noise in (alike, apart):
        torch.testing.assert_close(noise, unet_ref(ref, *small), atol=F32_ATOL, rtol=0)


def test_a_text_batch_to_a_component_node_is_refused(node):
    """A text master's Batch reaching an image node is a WorkerError naming the mix-up; the connection stays."""

    async def main():
        async with await connected(node) as client:
            with pytest.raises(RemoteWorkerError) as error:
                await client.batch(f32([1.0]), [("unet", 0, 0)])
            return str(error.value), await call(client, "clip", token_ids([0, 2]))

    message, hidden = run(main())
    assert "this node serves image components" in message and "SingleOp" in message
    assert hidden.shape == (1, *TEXT)


def test_the_log_says_where_each_components_architecture_came_from(node, snapshot):
    """Each component's weights come from the HF cache under --model (refs/main's snapshot), and its
    architecture from the snapshot's config.json; clip and vae run on cpu:0, the unet on cpu:1."""
    files = {e["component"]: e for e in node.events() if e.get("event") == "component files"}
    assert set(files) == set(COMPONENTS)
    assert files["unet"]["weights"] == str(snapshot[1] / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    assert {e["config_from"] for e in files.values()} == {"snapshot"}
    placed = {e["device"]: e["layers"] for e in node.events() if e.get("event") == "device layers"}
    assert placed == {0: ["clip", "vae"], 1: ["unet"]}


def test_without_the_image_extra_the_node_exits_78_naming_it(snapshot, tmp_path):
    """A node serving image components where diffusers cannot be imported exits 78 (EX_CONFIG) and
    names the extra to install."""
    hidden = tmp_path / "no-diffusers" / "diffusers"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named diffusers')\n")
    topology = write_topology(tmp_path / "topology.yml", ["unet"])
    env = {**os.environ, "PYTHONPATH": f"{hidden.parent}:{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "cakemp", "run", "--name", "worker", "--model", str(snapshot[0]),
                             "--topology", str(topology), "--model-type", "image-model", "--gpus", "cpu",
                             "--address", "127.0.0.1:0", "--log-format", "json"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 78
    assert "cakemp[image]" in result.stdout + result.stderr
