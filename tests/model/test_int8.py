"""8-bit weights kept int8 (model/weights/int8.py): GPTQ-8 of one group and MLX-8 of one group a row
rewritten into torch's int8 convention, checked with torch's own CPU int8 kernel against x @ W^T with
W the project's dequantization of the same stored tensors (itself checked against GPTQModel and MLX:
tests/model/test_gptq.py, test_mlx.py). x is rounded to bf16 and the kernel's sum returned in bf16, so
the bound is bf16's eps times the largest output; grouped 8-bit is dequantized, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.quantization import Gptq, GptqParts, MlxParts
from cakemp.compute.runner import BlockRunner
from cakemp.model.linear import linear
from cakemp.model.weights import gptq, int4, int8, mlx
from cakemp.model.weights.safetensors import Checkpoint
from tests.support.int4_checkpoints import GROUPS, LAYER, random_gptq

OUT, IN = 96, 512
BF16_EPS = torch.finfo(torch.bfloat16).eps
KERNELS = frozenset({int4.KERNEL, int8.KERNEL})


def _words(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64).to(torch.int32)


def assert_product_matches(kept: int8.Int8Weight, weight: torch.Tensor) -> None:
    """The kept weight on bf16 x, through the kernel (1, 7 rows) and the tiles (20, 300), against x @ weight^T in f64."""
    for rows in (1, 7, 20, 300):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        expected = x.double() @ weight.double().t()
        got = linear(x.float(), kept)
        assert got.dtype == torch.float32
        assert (got - expected).abs().max() <= BF16_EPS * expected.abs().max(), rows


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
def test_gptq_8_bit_codes_of_one_group_through_the_int8_kernel_give_the_dequantized_product(v1, sym):
    """Asymmetric zero points are random (0 included, which v1 stores borrowed across words); a
    symmetric checkpoint's are all 128, its correction 0."""
    generator = torch.Generator().manual_seed(0)
    spec = Gptq(8, -1, False, sym, v1)
    qweight = _words(generator, IN // 4, OUT)
    qzeros = torch.full((1, OUT // 4), 0x7F7F7F7F if v1 else -0x7F7F7F80, dtype=torch.int32) if sym \
        else _words(generator, 1, OUT // 4)
    scales = (torch.rand(1, OUT, generator=generator) / 64 + 1e-3).half()
    parts = gptq.int8_parts(qweight, qzeros, scales, spec)
    if sym:
        assert torch.equal(parts.corrections, torch.zeros(OUT))
    assert_product_matches(parts.kept(), gptq.dequantize(qweight, qzeros, scales, None, spec))


def test_mlx_8_bit_codes_of_one_group_a_row_through_the_int8_kernel_give_the_dequantized_product():
    generator = torch.Generator().manual_seed(1)
    weight = _words(generator, OUT, IN // 4).view(torch.uint32)
    scales = (torch.rand(OUT, 1, generator=generator) / 256).bfloat16()
    biases = (torch.randn(OUT, 1, generator=generator) / 8).bfloat16()
    assert_product_matches(mlx.int8_parts(weight, scales, biases).kept(), mlx.dequantize(weight, scales, biases, 8, IN))


def test_the_kernel_check_passes_on_the_cpu_s_own_kernel_and_a_gpu_is_not_tried():
    assert int8.kernel_works(torch.device("cpu"))
    assert not int8.kernel_works(torch.device("cuda", 0))


def test_a_gptq_8_bit_checkpoint_of_one_group_keeps_its_fused_matrices_int8_and_counts_them(tmp_path, plain):
    path = random_gptq(tmp_path / "gptq8", plain, -1, bits=8)
    checkpoint = Checkpoint(path, ModelConfig.from_dir(path))
    kept = checkpoint.load(GROUPS, torch.device("cpu"), torch.bfloat16, kernels=KERNELS)
    dequantized = checkpoint.load(GROUPS, torch.device("cpu"), torch.float32)
    for key in ("w_qkv", "w_gate_up", "w_down"):
        assert isinstance(kept[key], int8.Int8Weight), key
        x = torch.randn(3, dequantized[key].shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        expected = x.double() @ dequantized[key].double().t()
        assert (linear(x.float(), kept[key]) - expected).abs().max() <= BF16_EPS * expected.abs().max(), key
    held = sum(w.nbytes for w in kept.values())
    assert checkpoint.nbytes(GROUPS, torch.bfloat16, kernels=KERNELS) == held
    plain_bf16 = sum(w.numel() * 2 for w in dequantized.values())
    assert checkpoint.nbytes(GROUPS, torch.bfloat16) == plain_bf16
    # Without the int8 kernel (a GPU's kernels), the same matrices are dequantized.
    on_gpu = checkpoint.load(GROUPS, torch.device("cpu"), torch.bfloat16, kernels=frozenset({int4.KERNEL}))
    assert all(isinstance(w, torch.Tensor) for w in on_gpu.values())


def test_a_cpu_runner_keeps_gptq_8_bit_int8_unless_told_to_dequantize(tmp_path, plain):
    path = random_gptq(tmp_path / "gptq8", plain, -1, bits=8)
    block = BlockRunner.load(path, [LAYER], "cpu", torch.float32).blocks[0]
    assert all(isinstance(w, int8.Int8Weight) for w in (block.w_qkv, block.w_o, block.mlp.w_gate_up, block.mlp.w_down))
    dequantized = BlockRunner.load(path, [LAYER], "cpu", torch.float32, keep_int4=False).blocks[0]
    assert not isinstance(dequantized.w_qkv, int8.Int8Weight)


def test_grouped_8_bit_weights_are_dequantized_with_the_reason(tmp_path, plain):
    """One scale per row and group changes along the inputs: no exact int8 form (int8.py says what it would cost)."""
    path = random_gptq(tmp_path / "gptq8g", plain, 32, bits=8)
    stored = {"qweight": (IN // 4, OUT), "qzeros": (IN // 32, OUT // 4), "scales": (IN // 32, OUT)}
    weight = gptq.GptqWeight(GptqParts("qweight", "qzeros", "scales", None, Gptq(8, 32, False, False, True)))
    assert weight.kept_shape(stored.__getitem__, None) == \
        "GPTQ 8-bit weights in 16 groups a row (torch's int8 matmul takes one scale a row)"
    mlx_weight = mlx.MlxWeight(MlxParts("weight", "scales", "biases", 8, 64))
    assert "MLX 8-bit" in mlx_weight.kept_shape({"weight": (OUT, IN // 4)}.__getitem__, None)
    checkpoint = Checkpoint(path, ModelConfig.from_dir(path))
    loaded = checkpoint.load(GROUPS, torch.device("cpu"), torch.bfloat16, kernels=KERNELS)
    assert all(isinstance(w, torch.Tensor) for w in loaded.values())
