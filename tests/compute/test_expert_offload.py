"""MoE layers with their routed experts offloaded (model/weights/experts.py) compute what the same
layers compute with every expert loaded, for each MoE family in each format it comes in:

* Qwen3-MoE: plain (one tensor set per expert, as on the hub), GPTQ 4-bit (per expert, random codes),
  MLX 4-bit (stacked under switch_mlp), GGUF (stacked ffn_*_exps: Q8_0/Q4_0/TQ1_0, and all-4-bit
  Q4_0/Q4_1/Q4_K);
* Qwen3.5-MoE: plain (gate_up_proj and down_proj stacked [E, ...]), MLX 4-bit (switch_mlp).

Dequantized (keep_int4=False), an offloaded expert's values are exactly the resident one's, so the
outputs are equal, bit for bit: a 7-token prompt and 6 decode steps, a 12-token prompt in chunks of
3, and two sessions in one batch; with a cache of several layers' experts and with one smaller
than a single expert (each read, used and dropped). Kept 4-bit (the default on a CPU), the
offloaded experts are int4 (model/weights/int4.py) where the resident ones are dequantized at load
(stacked), so the outputs are within the kept path's bound (its bf16 roundings) of the resident
kept layers', and still equal whatever the cache's size. The cache's counts move as they should.
`--quantize` rounds the same matrices with experts offloaded or not (never the routed experts), so
the outputs are equal. On a GPU (marked `gpu`), the same comparisons in bf16 through the staged copies.
"""

from __future__ import annotations

import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute.loading import Rounding
from cakemp.compute.runner import BlockRunner, Request
from cakemp.model.weights.int4 import Int4Weight
from tests.support.checkpoints import make_checkpoint
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf
from tests.support.int4_checkpoints import random_gptq
from tests.support.quantized import mlx_checkpoint, needs_mlx
from tests.support.tolerance import INT4_KEPT_REL, rel_error

LAYERS = (1, 2, 3)
BIG = 1 << 30  # every expert of every layer


def _plain(tmp, family):
    return make_checkpoint(tmp, family)


def _gptq(tmp, family):
    return random_gptq(tmp / "gptq", make_checkpoint(tmp / "plain", family), 32)


def _mlx(tmp, family):
    return mlx_checkpoint(tmp, family, bits=4, group_size=32)[0]


def _gguf(types):
    def build(tmp, family):
        return write_gguf(tmp / "moe.gguf", GgufSpec("qwen3moe", ffn=0, experts=8, expert_ffn=256, types=types))
    return build


# name -> (family, how its checkpoint is built, whether its experts are 4-bit matrices torch's int4 matmul takes, marks)
CASES = {
    "qwen3_moe-plain": ("qwen3_moe", _plain, False, ()),
    "qwen3_moe-gptq": ("qwen3_moe", _gptq, True, ()),
    "qwen3_moe-mlx": ("qwen3_moe", _mlx, True, (needs_mlx,)),
    "qwen3_moe-gguf": ("qwen3_moe", _gguf({"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "TQ1_0"}),
                       False, (needs_gguf,)),
    "qwen3_moe-gguf-4bit": ("qwen3_moe", _gguf({"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1",
                                                 "ffn_down_exps": "Q4_K"}), True, (needs_gguf,)),
    "qwen3_5_moe-plain": ("qwen3_5_moe", _plain, False, ()),
    "qwen3_5_moe-mlx": ("qwen3_5_moe", _mlx, True, (needs_mlx,)),
}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=case[-1]) for name, case in CASES.items()])
def checkpoint(request, tmp_path_factory):
    family, build, four_bit, _ = CASES[request.param]
    return build(tmp_path_factory.mktemp(request.param), family), four_bit


def _runner(path, keep_int4: bool, cache: int | None) -> BlockRunner:
    config = ModelConfig.from_dir(path) if path.is_dir() else None
    prefix = config.layer_prefix if config is not None else "model.layers"
    return BlockRunner.load(path, [f"{prefix}.{i}" for i in LAYERS], "cpu", torch.float32, keep_int4=keep_int4,
                            expert_cache_bytes=cache)


def _outputs(runner: BlockRunner) -> list[torch.Tensor]:
    """A 7-token prompt and 6 decode steps (session 0), 12 tokens in chunks of 3 (session 1), then
    both sessions' next tokens in one batch."""
    H = runner.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    def at(position):
        return runner.ops([(layer, position, i) for i, layer in enumerate(runner.layers)])

    out = []
    for session, chunks in ((0, [7] + [1] * 6), (1, [3] * 4)):
        position = 0
        for T in chunks:
            out.append(runner.run(session, torch.randn(1, T, H, generator=generator), at(position)))
            position += T
    batch = [Request(0, torch.randn(1, 1, H, generator=generator), at(13)),
             Request(1, torch.randn(1, 2, H, generator=generator), at(12))]
    out += runner.run_batch(batch)
    return out


def test_offloaded_experts_compute_exactly_what_resident_ones_do(checkpoint):
    checkpoint, _ = checkpoint
    resident = _outputs(_runner(checkpoint, keep_int4=False, cache=None))
    big = _runner(checkpoint, keep_int4=False, cache=BIG)
    tiny = _runner(checkpoint, keep_int4=False, cache=1024)  # less than one expert
    for offloaded in (big, tiny):
        got = _outputs(offloaded)
        assert all(torch.equal(a, b) for a, b in zip(got, resident, strict=True))
    # Every expert read once into the big cache, then found there; the tiny one holds none and reads each time.
    assert big.expert_cache.misses <= len(LAYERS) * big.config.moe.experts < big.expert_cache.hits
    assert big.expert_cache.resident_bytes > 0 and tiny.expert_cache.resident_bytes == 0
    assert tiny.expert_cache.hits == 0 and tiny.expert_cache.misses == big.expert_cache.hits + big.expert_cache.misses
    assert tiny.expert_cache.read_bytes > big.expert_cache.read_bytes > 0


def test_kept_4_bit_experts_stay_int4_and_match_within_the_kept_bound(checkpoint):
    checkpoint, four_bit = checkpoint
    big = _runner(checkpoint, keep_int4=True, cache=BIG)
    got = _outputs(big)
    held = [weight for pair, _ in big.expert_cache._held.values() for weight in pair]
    kept = any(isinstance(weight, Int4Weight) for weight in held)
    resident = _outputs(_runner(checkpoint, keep_int4=True, cache=None))  # its stacked experts dequantized
    errors = [rel_error(a, b) for a, b in zip(got, resident, strict=True)]
    assert max(errors) <= INT4_KEPT_REL, max(errors)
    tiny = _outputs(_runner(checkpoint, keep_int4=True, cache=1024))
    assert all(torch.equal(a, b) for a, b in zip(tiny, got, strict=True))
    assert kept == four_bit


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_rounds_the_same_matrices_with_experts_offloaded(tmp_path_factory, scheme):
    """--quantize rounds attention's and the shared expert's matrices, not the routed experts (stacked
    [E, ...], resident or offloaded): offloaded, a quantized layer computes exactly what it does resident."""
    path = make_checkpoint(tmp_path_factory.mktemp("quantize"), "qwen3_5_moe")
    layers = [f"model.language_model.layers.{i}" for i in LAYERS]

    def load(cache):
        return BlockRunner.load(path, layers, "cpu", torch.float32, quantize=Rounding(scheme, 32),
                                expert_cache_bytes=cache)

    offloaded = load(1024)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(offloaded), _outputs(load(None)), strict=True))
    moe = offloaded.block(layers[-1]).mlp
    assert not isinstance(moe.shared.w_gate_up, torch.Tensor)  # rounded: a kept weight
    assert all(isinstance(weight, torch.Tensor) for _, pair in moe.experts.fetch(range(2)) for weight in pair)


GPU_CASES = {"qwen3_5_moe-plain": ("qwen3_5_moe", _plain), "qwen3_moe-gptq": ("qwen3_moe", _gptq)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_on_a_gpu_offloaded_experts_are_staged_and_compute_what_resident_ones_do(tmp_path_factory, name):
    """bf16 on a GPU: the experts staged through pinned memory and copied on a side stream compute what
    the resident layers do (bit for bit where both dequantize; kept int4, within the kept bound) with a
    cache of every expert and one smaller than one expert; a 4-bit expert stays int4 in the GPU's cache."""
    family, build = GPU_CASES[name]
    path = build(tmp_path_factory.mktemp(name), family)
    prefix = ModelConfig.from_dir(path).layer_prefix
    layers = [f"{prefix}.{i}" for i in LAYERS]
    generator = torch.Generator().manual_seed(0)
    inputs = [(position, torch.randn(1, T, 64, generator=generator).to("cuda", torch.bfloat16))
              for position, T in ((0, 7), (7, 1), (8, 1), (9, 1))]
    for keep_int4 in (False, True):
        runners = [BlockRunner.load(path, layers, "cuda", torch.bfloat16, keep_int4=keep_int4, expert_cache_bytes=cache)
                   for cache in (None, BIG, 1024)]
        outputs = [[runner.run(0, x, runner.ops([(layer, position, i) for i, layer in enumerate(layers)])).float()
                    for position, x in inputs] for runner in runners]
        resident, big, tiny = outputs
        assert all(torch.equal(a, b) for a, b in zip(tiny, big, strict=True))
        if keep_int4 and name.endswith("gptq"):
            assert max(rel_error(a, b) for a, b in zip(big, resident, strict=True)) <= INT4_KEPT_REL
            held = [weight for pair, _ in runners[1].expert_cache._held.values() for weight in pair]
            assert held and all(isinstance(weight, Int4Weight) and weight.packed.is_cuda for weight in held)
        else:
            assert all(torch.equal(a, b) for a, b in zip(big, resident, strict=True))
        assert runners[1].expert_cache.hits > 0 and runners[2].expert_cache.resident_bytes == 0
