"""Block-wise FP8 dequantization against element-by-element reference arithmetic."""

import pytest
import torch

from cakemp.model import fp8


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
