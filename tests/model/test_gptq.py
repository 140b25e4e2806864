"""GPTQ dequantization against GPTQModel's own: bit for bit, for every variant cakemp computes.

The oracle (tests/support/gptq_oracle.py, GPTQModel 7.6's TorchLinear in its own process) packs random
matrices for bits 2, 3, 4 and 8, group sizes 32, 64 and -1, act-order or not, symmetric or
not, checkpoint formats v1 and v2, and dequantizes them with f32 scales: the exact products,
which cakemp's f32 dequantization must equal exactly.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.quantization import Gptq
from cakemp.compute.runner import BlockRunner
from cakemp.model.weights import bitfields, gptq
from cakemp.model.weights.safetensors import Checkpoint
from tests.support.quantized import ORACLE, GptqSpec, gptq_checkpoints, needs_gptqmodel

pytestmark = needs_gptqmodel

# [out, in]: GPTQModel packs 3-bit codes 32 at a time along both sides; 2/4/8 bits also take a
# side that leaves the last word part empty (40 outputs in 4-bit words of 8: 5; of 16: 2.5).
SHAPES = {"a.weight": (32, 64), "b.weight": (64, 128), "c.weight": (40, 96)}
VARIANTS = [
    dict(bits=bits, group_size=size, desc_act=act, sym=sym, v1=v1)
    for bits, (size, act), sym, v1 in itertools.product(
        (2, 3, 4, 8), ((32, False), (64, True), (-1, False), (32, True)), (True, False), (True, False))
]


def spec(variant: dict) -> Gptq:
    return Gptq(variant["bits"], variant["group_size"], variant["desc_act"], variant["sym"], variant["v1"])


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """[(variant, GPTQModel's packed tensors, its dequantized weights)], one oracle run for all."""
    tmp = tmp_path_factory.mktemp("gptq")
    generator = torch.Generator().manual_seed(0)
    jobs = []
    for i, variant in enumerate(VARIANTS):
        shapes = {n: s for n, s in SHAPES.items() if variant["bits"] != 3 or n != "c.weight"}
        save_file({n: torch.randn(s, generator=generator) for n, s in shapes.items()}, tmp / f"w{i}.safetensors")
        jobs.append({"weights": str(tmp / f"w{i}.safetensors"), "packed": str(tmp / f"p{i}.safetensors"),
                     "dequantized": str(tmp / f"d{i}.safetensors"), "seed": i, **variant})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    result = subprocess.run([sys.executable, str(ORACLE), str(tmp / "jobs.json")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return [(v, load_file(job["packed"]), load_file(job["dequantized"])) for v, job in zip(VARIANTS, jobs)]


def test_every_variant_dequantizes_as_gptqmodel_does(packed):
    """Bit for bit, from the stored g_idx and (without act-order) from group_size alone."""
    for variant, stored, expected in packed:
        for name, reference in expected.items():
            module = name.removesuffix(".weight")
            parts = [stored[f"{module}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")]
            assert torch.equal(gptq.dequantize(*parts, spec(variant)), reference), (variant, name)
            if not variant["desc_act"]:
                assert torch.equal(gptq.dequantize(*parts[:3], None, spec(variant)), reference), (variant, name)


def test_v1_zero_points_of_zero_are_restored_as_gptqmodel_restores_them(packed):
    """The asymmetric v1 checkpoints hold zero points of 0, stored as all-ones fields after the
    writer's word-wide subtraction borrowed: adding 1 per field (Cake's way) gets them wrong,
    cakemp's word-wide addition (GPTQModel's) gets them right (the test above)."""
    naive_wrong = 0
    for variant, stored, _ in packed:
        if not variant["v1"] or variant["sym"] or 32 % variant["bits"]:
            continue
        qzeros, scales = stored["b.qzeros"], stored["b.scales"]
        zeros = bitfields.unpack(qzeros, variant["bits"], scales.shape[1]) + 1  # per field, Cake's
        naive_wrong += int((zeros > 2 ** variant["bits"] - 1).any() or (zeros != bitfields.unpack(
            bitfields.add_to_each(qzeros, variant["bits"], 1), variant["bits"], scales.shape[1])).any())
    assert naive_wrong >= 6


def test_parts_that_do_not_fit_together_are_refused():
    """qzeros or scales of another matrix, or a g_idx naming a group that has no scales: ValueError."""
    qweight = torch.zeros(8, 32, dtype=torch.int32)  # 64 inputs x 32 outputs, 4 bits
    qzeros, scales = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 32, dtype=torch.float16)
    four = Gptq(4, 32, False, True, True)
    assert gptq.dequantize(qweight, qzeros, scales, None, four).shape == (32, 64)
    with pytest.raises(ValueError, match="qzeros has shape"):
        gptq.dequantize(qweight, torch.zeros(2, 3, dtype=torch.int32), scales, None, four)
    with pytest.raises(ValueError, match="2 groups of scales for 64 inputs in groups of 16"):
        gptq.dequantize(qweight, qzeros, scales, None, Gptq(4, 16, False, True, True))
    with pytest.raises(ValueError, match="g_idx names groups outside 0..1"):
        gptq.dequantize(qweight, qzeros, scales, torch.full((64,), 2, dtype=torch.int32), four)


def test_a_layer_counts_and_loads_as_its_dequantized_matrices(tmp_path):
    """Quantized experts load as the oracle's dequantization, attention and the router kept in
    16 bits (Qwen's MoE releases) as stored; Checkpoint.nbytes counts a GPTQ weight as the plain
    matrix it becomes."""
    (path, reference), = gptq_checkpoints(tmp_path, {"moe": GptqSpec("qwen3_moe", experts_only=True)}).values()
    layer = "model.layers.1"
    ours, expected = (BlockRunner.load(p, [layer], "cpu", torch.float32, pack_weights=False).block(layer)
                      for p in (path, reference))
    pairs = {"experts' gate/up": (ours.mlp.gate_up, expected.mlp.gate_up), "experts' down": (ours.mlp.down, expected.mlp.down),
             "q/k/v": (ours.w_qkv, expected.w_qkv), "router": (ours.mlp.router, expected.mlp.router)}
    for what, (got, want) in pairs.items():
        assert torch.equal(got, want), what
    downs = {"experts": [f"{layer}.mlp.experts.{j}.down_proj.weight" for j in range(8)]}  # 8 x [64, 32]
    assert Checkpoint(path, ModelConfig.from_dir(path)).nbytes(downs, torch.bfloat16) == 8 * 64 * 32 * 2
