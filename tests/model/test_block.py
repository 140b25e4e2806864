"""DecoderBlock details the HF parity tests cannot see on their own."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cakemp.checkpoint.config import ModelConfig
from cakemp.model.attention import attend_rows
from cakemp.model.rotary import Rotary
from tests.support.checkpoints import make_config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("pattern", ["decode", "causal-lower-right", "window-mask"])
def test_attention_softmax_accumulates_in_f32(dtype, pattern):
    """Uniform attention over up to 4096 keys averages V to within 2 eps, as only an f32 softmax sum can.

    The block calls SDPA in these three ways with low-precision q/k/v (no upcast), relying on
    its kernels accumulating the softmax in f32; summed in bf16, 4096 equal weights would
    stall at 256 and the average would be off by far more than 2 eps. (A step's decode rows come
    padded to the longest request's keys: here the last 512 are padding, masked.)
    """
    S, T, D, H_kv, n_rep = 4096, 3, 16, 2, 2
    k = torch.ones(1, H_kv, S, D, dtype=dtype)  # every key scores the same: weights 1/visible
    v = (1 + torch.rand(1, H_kv, S, D) / 8).to(dtype)
    visible = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # [T, S]: query t sees S - T + t + 1 keys
    if pattern == "decode":
        q = torch.randn(1, H_kv * n_rep, D).to(dtype)
        seen = torch.arange(S) < S - 512  # [S]
        out = attend_rows(q, k, v, seen[None], scale=D**-0.5).view(1, H_kv, n_rep, D)
        visible = seen.expand(n_rep, S)
    else:
        q = torch.randn(1, H_kv * n_rep, T, D).to(dtype)
        mask = causal_lower_right(T, S) if pattern == "causal-lower-right" else visible
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
        out = out.view(1, H_kv, n_rep, T, D)
        v = v[:, :, None]  # [1, H_kv, 1, S, D]
    expected = (visible.double() @ v.double()) / visible.sum(dim=1, keepdim=True)
    eps = torch.finfo(dtype).eps
    assert (out.double() - expected).abs().max() <= 2 * eps * expected.abs().max()


def test_rotary_positions_are_absolute():
    """cos/sin for positions 5..7 are rows 5..7 of a table from 0, so decode offsets line up."""
    rotary = Rotary(ModelConfig.from_dict(make_config("llama").to_dict()).layer_ropes[0], torch.device("cpu"))
    cos_all, sin_all = rotary.cos_sin(torch.arange(8), torch.float32)
    cos, sin = rotary.cos_sin(torch.tensor([5, 6, 7]), torch.float32)
    assert torch.equal(cos, cos_all[5:]) and torch.equal(sin, sin_all[5:])
