"""DecoderBlock details the HF parity tests cannot see on their own."""

import pytest
import torch
import torch.nn.functional as F

from cakemp.model.config import ModelConfig
from cakemp.model.rotary import Rotary
from tests.checkpoints import make_config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("masked", [False, True], ids=["decode", "masked-prefill"])
def test_attention_softmax_accumulates_in_f32(dtype, masked):
    """Uniform attention over 4096 keys averages V to within 2 eps, as only an f32 softmax sum can.

    The block calls SDPA with low-precision q/k/v (no upcast) relying on its kernels
    accumulating the softmax in f32; summed in bf16, 4096 equal weights would stall at 256.
    """
    S, D = 4096, 16
    q = torch.randn(1, 2, 3, D).to(dtype)
    k = torch.ones(1, 2, S, D, dtype=dtype)  # every key scores the same: weights 1/S
    v = (1 + torch.rand(1, 2, S, D) / 8).to(dtype)
    mask = torch.ones(3, S, dtype=torch.bool).tril(S - 3) if masked else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5).double()
    if mask is None:
        expected = v.double().mean(dim=2, keepdim=True)
    else:
        counts = mask.sum(dim=1, keepdim=True).double()  # [3, 1]
        expected = (mask.double() @ v.double()) / counts
    eps = torch.finfo(dtype).eps
    assert (out - expected).abs().max() <= 2 * eps * expected.abs().max()


def test_rotary_positions_are_absolute():
    """cos/sin for positions 5..7 are rows 5..7 of a table from 0, so decode offsets line up."""
    rotary = Rotary(ModelConfig.from_dict(make_config("llama").to_dict()), torch.device("cpu"))
    cos_all, sin_all = rotary.cos_sin(0, 8, torch.float32)
    cos, sin = rotary.cos_sin(5, 3, torch.float32)
    assert torch.equal(cos, cos_all[5:]) and torch.equal(sin, sin_all[5:])
