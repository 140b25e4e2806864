"""Block-wise FP8 dequantization against element-by-element reference arithmetic."""

import pytest
import torch

from cakemp.model.linear import linear
from cakemp.model.weights import fp8


def reference(weight, scale_inv, block):
    """out[i, j] = f32(weight[i, j]) * f32(scale_inv[i // bm, j // bn]), one element at a time."""
    bm, bn = block
    w, s = weight.float().tolist(), scale_inv.float().tolist()
    return torch.tensor([[w[i][j] * s[i // bm][j // bn] for j in range(len(w[0]))] for i in range(len(w))])


@pytest.mark.parametrize(
    "shape, block",
    [((64, 96), (32, 32)), ((70, 45), (32, 16)), ((5, 130), (128, 128)), ((129, 3), (128, 128))],
    ids=["exact", "ragged-both", "ragged-rows-single-block", "ragged-rows-beyond-one-block"],
)
def test_dequantize_matches_reference_arithmetic(shape, block):
    """Every element is its e4m3 value times its block's scale, partial edge blocks included."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=generator) * 100).to(torch.float8_e4m3fn)
    blocks = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.rand(blocks, generator=generator) + 0.01
    out = fp8.dequantize(weight, scale_inv, block)
    assert out.dtype == torch.float32
    assert torch.equal(out, reference(weight, scale_inv, block))


def test_scale_of_the_wrong_shape_is_refused():
    """A scale grid that does not cover the weight in blocks is a ValueError, not a broadcast."""
    weight = torch.zeros(70, 45).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv shape"):
        fp8.dequantize(weight, torch.ones(2, 2), (32, 16))


def fp8_weight(rows=256, cols=384, seed=1):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(rows // 128, cols // 128, generator=generator) / 64 + 1e-3
    return fp8.Fp8Weight.create(weight, scale_inv)


def test_activation_quantization_keeps_each_value_within_half_an_e4m3_step():
    """Per token and 128 columns, the largest magnitude maps to 448 and every value rounds to
    within 2^-4 of itself (3 mantissa bits), or 2^-10 scales where it falls among e4m3's subnormals."""
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 384)
    x_q, scale = fp8.quantize_activation(x)
    assert x_q.dtype == torch.float8_e4m3fn and scale.shape == (5, 3)
    groups = x_q.float().view(5, 3, 128)
    assert torch.equal(groups.abs().amax(dim=-1), torch.full((5, 3), 448.0))
    back = (groups * scale[..., None]).view(5, 384)
    bound = torch.maximum(2**-4 * x.abs(), 2**-10 * scale.repeat_interleave(128, dim=1))
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_emulated_scaled_matmul_is_the_block_formula():
    """The emulation sums, per 128-column block, the e4m3 products times both blocks' scales."""
    weight = fp8_weight(rows=256, cols=256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    x_q, x_scale = fp8.quantize_activation(x)
    xq, xs = x_q.double().tolist(), x_scale.double().tolist()
    w, ws = weight.weight.double().tolist(), weight.scale_inv.double().tolist()
    expected = torch.tensor([[sum(
        sum(xq[m][k] * w[n][k] for k in range(b * 128, (b + 1) * 128)) * xs[m][b] * ws[n // 128][b]
        for b in range(2)) for n in range(256)] for m in range(3)], dtype=torch.float64)
    got = fp8.emulated_matmul(x, weight).double()
    assert ((got - expected).abs() <= 1e-5 * expected.abs().max()).all()


def test_emulated_scaled_matmul_stays_within_the_activation_rounding_of_the_dequantized_product():
    """Against x @ dequantize(W)^T, the FP8 path errs by no more than its activation rounding:
    sum_k |x_k - q(x_k)| |w_k|, bounded elementwise as in the quantization test."""
    weight = fp8_weight()
    x = torch.randn(7, 384, generator=torch.Generator().manual_seed(4))
    reference = x.double() @ fp8.dequantize(weight.weight, weight.scale_inv, (128, 128)).double().t()
    got = fp8.emulated_matmul(x, weight).double()
    _, scale = fp8.quantize_activation(x)
    rounding = torch.maximum(2**-4 * x.abs(), 2**-10 * scale.repeat_interleave(128, dim=1)).double()
    dequantized = fp8.dequantize(weight.weight, weight.scale_inv, (128, 128)).double()
    bound = rounding @ dequantized.abs().t()
    assert ((got - reference).abs() <= bound + 1e-6 * reference.abs().max()).all()
    assert (got - reference).abs().max() > 0  # the activations really went through e4m3


def test_scale_layout_for_the_scaled_matmul():
    """scale_b is the stored [N/128, K/128] grid transposed, its K side padded to a multiple of 4."""
    weight = fp8_weight(rows=256, cols=640)  # K/128 = 5 -> padded to 8
    assert weight.scale_b.shape == (8, 2) and weight.scale_b.stride() == (1, 8)
    assert torch.equal(weight.scale_b[:5], weight.scale_inv.t()) and not weight.scale_b[5:].any()
    with pytest.raises(ValueError, match="128x128 blocks"):
        fp8.Fp8Weight.create(torch.zeros(130, 256).to(torch.float8_e4m3fn), torch.ones(2, 2))


def test_a_cpu_never_keeps_fp8_weights():
    """The block-scaled matmul is a GPU kernel: on a CPU the loader dequantizes."""
    assert not fp8.scaled_mm_works(torch.device("cpu"), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_cuda_scaled_matmul_matches_its_emulation(rows, dtype):
    """Where the GPU takes it, the scaled matmul gives the emulation's f32 result to its output rounding."""
    if not fp8.scaled_mm_works(torch.device("cuda", 0), dtype):
        pytest.skip("this GPU or torch build has no block-scaled FP8 matmul")
    weight = fp8_weight(rows=1024, cols=2048)
    weight = fp8.Fp8Weight.create(weight.weight.cuda(), weight.scale_inv.cuda())
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    expected = fp8.emulated_matmul(x, weight)
    got = linear(x, weight).float()
    assert ((got - expected).abs() <= 4 * torch.finfo(dtype).eps * expected.abs() + 1e-4 * expected.abs().max()).all()
