"""--quantize: plain matrices rounded to nearest at load into kept int8 and int4 weights
(model/weights/rtn.py), against torchao's own quantization of the same matrices (the oracle: its
Int8WeightOnly and Int4WeightOnly schemes' functions, bit for bit), then through a CPU runner:
every plain matrix kept, each layer's error against the unquantized layer reported, and a
checkpoint quantized already refused."""

from __future__ import annotations

import pytest
import torch

from cakemp.compute.loading import Rounding
from cakemp.compute.runner import BlockRunner
from cakemp.errors import ConfigError
from cakemp.model.weights import int4, int8, rtn
from tests.support.int4_checkpoints import random_gptq
from tests.support.tolerance import rel_error

LAYERS = ["model.layers.0", "model.layers.1"]


def matrix(rows: int = 256, cols: int = 512) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_rounding_is_torchao_s_int4_weight_only_bit_for_bit(group_size):
    utils = pytest.importorskip("torchao.quantization.utils")
    w = matrix()
    codes, scales_and_zeros = utils.groupwise_affine_quantize_tensor(w, 4, group_size, torch.bfloat16)
    parts = rtn.int4_parts(w, group_size)
    assert torch.equal(parts.codes, codes.to(torch.uint8))
    assert torch.equal(parts.scales, scales_and_zeros[..., 0].t().float())
    assert torch.equal(parts.zeros, scales_and_zeros[..., 1].t().float())


def test_int8_rounding_is_torchao_s_symmetric_per_channel_bit_for_bit():
    primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    w = matrix()
    block = (1, w.shape[1])
    scale, zero = primitives.choose_qparams_affine(w, primitives.MappingType.SYMMETRIC, block, torch.int8,
                                                   quant_min=-128, quant_max=127, eps=torch.finfo(torch.float32).eps)
    parts = rtn.int8_parts(w)
    assert torch.equal(parts.codes, primitives.quantize_affine(w, block, scale, zero, torch.int8, -128, 127))
    assert torch.equal(parts.scales, scale.view(-1)) and not parts.corrections.any()


@pytest.mark.parametrize("quantize", [Rounding("int8", 128), Rounding("int4", 32), Rounding("int4", 64)], ids=str)
def test_a_cpu_runner_rounds_every_plain_matrix_into_a_kept_weight(plain, quantize):
    """Each layer's output against the unquantized layer's, over a 7-token prompt (printed: the
    figures docs/benchmarks.md reports); the matrices are kept weights, not tensors."""
    exact = BlockRunner.load(plain, LAYERS, "cpu", torch.float32, pack_weights=False)
    rounded = BlockRunner.load(plain, LAYERS, "cpu", torch.float32, pack_weights=False, quantize=quantize)
    kind = int8.Int8Weight if quantize.kernel == "int8" else int4.Int4Weight
    for block in rounded.blocks:
        assert all(isinstance(w, kind) for w in (block.w_qkv, block.w_o, block.mlp.w_gate_up, block.mlp.w_down))
    assert rounded.weight_bytes < exact.weight_bytes / 2
    x = torch.randn(1, 7, exact.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(LAYERS):
        error = rel_error(rounded.run(i, x, rounded.ops([(layer, 0, 0)])), exact.run(i, x, exact.ops([(layer, 0, 0)])))
        print(f"{quantize.kernel} g={quantize.group_size} {layer}: relative error {error:.4f}")
        assert 0 < error < 1


def test_a_checkpoint_quantized_already_is_refused(plain, tmp_path):
    path = random_gptq(tmp_path / "gptq", plain, 32)
    with pytest.raises(ConfigError, match="quantized already"):
        BlockRunner.load(path, LAYERS, "cpu", torch.float32, quantize=Rounding("int8", 128))
