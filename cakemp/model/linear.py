"""The one matrix product of every layer: x @ W^T (+ b), whatever form W is kept in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cakemp.model.weights.fp8 import Fp8Weight
from cakemp.model.weights.int4 import Int4Weight
from cakemp.model.weights.int8 import Int8Weight
from cakemp.model.weights.packed import PackedWeight


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight | Int4Weight | Int8Weight | PackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a plain weight, the block-scaled FP8 matmul for one kept as FP8, torch's int4
    or int8 matmul for one kept 4- or 8-bit, or MKL's packed GEMM for one packed at load."""
    if isinstance(weight, PackedWeight):
        return weight.matmul(x, bias)
    if isinstance(weight, Fp8Weight | Int4Weight | Int8Weight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
