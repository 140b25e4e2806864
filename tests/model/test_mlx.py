"""MLX affine dequantization against MLX's own mx.dequantize, and an mlx-lm-style Qwen3.5-MoE
checkpoint loaded as its HF reference: stacked switch_mlp experts, 8-bit routers, the (1 + w)
norms stored with their 1, the convolution as [C, K, 1], layers under language_model.model."""

from __future__ import annotations

import itertools

import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute.runner import BlockRunner
from cakemp.model.weights import mlx
from cakemp.model.weights.safetensors import Checkpoint
from tests.support.quantized import HAVE_MLX, mlx_checkpoint, needs_mlx

pytestmark = needs_mlx
if HAVE_MLX:
    import mlx.core as mx
    import numpy as np


@pytest.mark.parametrize("bits, group_size", itertools.product((2, 3, 4, 5, 6, 8), (32, 64, 128)))
def test_matrices_and_stacks_dequantize_as_mlx_does(bits, group_size):
    """2-D and stacked 3-D weights, bf16 and f16 scales: equal to mx.dequantize in f32, bit for bit."""
    generator = torch.Generator().manual_seed(bits * group_size)
    for shape, dtype in (((48, 256), mx.bfloat16), ((3, 40, 128), mx.float16)):
        w = mx.array(torch.randn(shape, generator=generator).numpy()).astype(dtype)
        q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        expected = np.array(mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32),
                                          group_size=group_size, bits=bits))
        as_torch = [torch.from_numpy(np.array(t.astype(mx.float32))).to(getattr(torch, str(dtype).split(".")[-1]))
                    for t in (scales, biases)]
        got = mlx.dequantize(torch.from_numpy(np.array(q)), *as_torch, bits, group_size)
        assert torch.equal(got, torch.from_numpy(expected)), shape


def test_scales_of_another_matrix_are_refused():
    q = torch.zeros(4, 8, dtype=torch.uint32)  # 4 rows of 64 4-bit codes
    with pytest.raises(ValueError, match="scales has shape"):
        mlx.dequantize(q, torch.ones(4, 1), torch.zeros(4, 2), 4, 32)
    with pytest.raises(ValueError, match="no whole number"):
        mlx.dequantize(q, torch.ones(4, 1), torch.zeros(4, 1), 4, 48)


def test_an_mlx_lm_qwen3_5_moe_conversion_loads_as_its_hf_reference(tmp_path):
    """Every weight of a linear-attention and a full-attention layer equals the reference's
    (HF layout, the oracle's dequantization); the norms get no second 1; bytes counted plain."""
    path, reference = mlx_checkpoint(tmp_path, "qwen3_5_moe", bits=4, group_size=32)
    config = ModelConfig.from_dir(path)
    assert config.layer_prefix == "language_model.model.layers"
    assert not Checkpoint(path, config).norms_need_one and Checkpoint(reference, ModelConfig.from_dir(reference)).norms_need_one
    for index in (2, 3):  # linear attention, full attention
        ours = BlockRunner.load(path, [f"language_model.model.layers.{index}"], "cpu", torch.float32, pack_weights=False,
                                keep_int4=False)
        theirs = BlockRunner.load(reference, [f"model.language_model.layers.{index}"], "cpu", torch.float32,
                                  pack_weights=False)
        ours, theirs = weights_of(ours.blocks[0]), weights_of(theirs.blocks[0])
        assert ours.keys() == theirs.keys() and len(ours) > 10
        for name, value in theirs.items():
            assert torch.equal(ours[name], value), (index, name)
    gate = {"gate": ["language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"]}  # [8, 32, 64] 4-bit
    assert Checkpoint(path, config).nbytes(gate, torch.float32) == 8 * 32 * 64 * 4


def weights_of(part, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor a block holds, by attribute path ("mlp.gate_up", "mixer.conv", ...)."""
    out = {}
    for name, value in vars(part).items():
        if isinstance(value, torch.Tensor):
            out[prefix + name] = value
        elif type(value).__module__.startswith("cakemp.model"):
            out |= weights_of(value, f"{prefix}{name}.")
    return out


def test_the_norm_layout_is_told_from_whichever_shard_a_node_holds(tmp_path):
    """A zero-config cache holds only its layers' shards: with layers 0-1's shard gone, layer 2's
    convolution still tells that the norms carry their 1, and layer 3 (full attention) loads so."""
    path, reference = mlx_checkpoint(tmp_path, "qwen3_5_moe", bits=4, group_size=32, shards=2)
    (path / "model-00001-of-00002.safetensors").unlink()  # layers 0 and 1, the embeddings
    assert not Checkpoint(path, ModelConfig.from_dir(path)).norms_need_one
    ours = BlockRunner.load(path, ["language_model.model.layers.3"], "cpu", torch.float32, pack_weights=False)
    theirs = BlockRunner.load(reference, ["model.language_model.layers.3"], "cpu", torch.float32, pack_weights=False)
    assert torch.equal(ours.blocks[0].input_norm, theirs.blocks[0].input_norm)
