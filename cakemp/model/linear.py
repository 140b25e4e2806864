"""The one matrix product of every layer: x @ W^T (+ b), whatever form W is kept in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cakemp.model.weights.kept import KeptWeight
from cakemp.model.weights.packed import PackedWeight


def linear(x: torch.Tensor, weight: torch.Tensor | KeptWeight | PackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a plain weight, its kernel's matmul for one kept quantized (int4, int8, fp8:
    model/weights/kept.py), or MKL's packed GEMM for one packed at load."""
    if isinstance(weight, PackedWeight):
        return weight.matmul(x, bias)
    if isinstance(weight, KeptWeight):
        out = weight.matmul(x)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
