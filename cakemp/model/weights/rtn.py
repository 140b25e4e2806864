"""Plain matrices quantized at load (`--quantize int8|int4`), round to nearest, into the kept forms
torch's CPU kernels multiply by (int8.py, int4.py): a bigger model in the same memory, at a cost
in accuracy (the results change; docs/benchmarks.md has the error and perplexity figures).

The schemes are torchao's simplest weight-only ones, so that its functions are the oracle
(tests/model/test_rtn.py):

* int8, symmetric, one scale per output row (torchao's Int8WeightOnlyConfig):
  s = max |w[n, :]| / 127.5, c = clamp(round(w / s), -128, 127), W' = s c. Into `Int8Parts` with a
  correction of 0.
* int4, asymmetric, one scale and zero per group of g consecutive inputs (torchao's
  Int4WeightOnlyQuantizer, tinygemm's float zero point): s = (max - min) / 15 (at least 1e-6),
  z = min + 8 s, both then rounded to bf16 (the kernel holds them so), and
  q = clamp(round((w - (z - 8 s)) / s), 0, 15) with those, W' = (q - 8) s + z. Into `Int4Parts` as they are.

Each matrix is quantized alone, in f32, a few rows at a time (no copy of the whole matrix in f32
beyond the one loaded); a matrix the int4 kernel cannot take (int4.py's rules) stays plain, and why
is logged once.
"""

from __future__ import annotations

import torch

from cakemp.checkpoint import resident
from cakemp.model.weights import int4, int8, kept

INT8_LEVELS = 127.5  # torchao's symmetric int8: the scale maps max |w| onto half of 255 levels
_INT4_LEVELS = 15
_INT4_MIDDLE = 8
_INT4_EPS = 1e-6  # torchao's floor on an int4 scale (a group of equal values)
_ROWS_PER_STEP = 256


def quantized(weight: torch.Tensor, scheme: str, group_size: int) -> kept.KeptWeight | torch.Tensor:
    """An [N, K] plain matrix (any float dtype) quantized by `scheme` ("int8", or "int4" in groups of
    `group_size`) into its kept weight; `weight` itself where the int4 kernel cannot take its shape."""
    if scheme == resident.INT8:
        return kept.weight([int8_parts(weight)])
    reason = resident.int4_unfit_reason(*weight.shape, group_size)
    if reason is not None:
        kept.dequantized(f"--quantize int4: {reason}")
        return weight
    return kept.weight([int4_parts(weight, group_size)])


def int8_parts(weight: torch.Tensor) -> int8.Int8Parts:
    """W [N, K] -> its codes [N, K] int8 and per-row scales [N] f32 (corrections 0)."""
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for first in range(0, weight.shape[0], _ROWS_PER_STEP):
        rows = weight[first:first + _ROWS_PER_STEP].float()
        scale = rows.abs().amax(dim=1) / INT8_LEVELS
        scale = scale.clamp(min=torch.finfo(torch.float32).eps)
        # x (1 / s), not x / s: torchao's rounding, tie for tie.
        codes[first:first + _ROWS_PER_STEP] = torch.round(rows * (1.0 / scale[:, None])).clamp(-128, 127).to(torch.int8)
        scales[first:first + _ROWS_PER_STEP] = scale
    return int8.Int8Parts(codes, scales, torch.zeros_like(scales))


def int4_parts(weight: torch.Tensor, group_size: int) -> int4.Int4Parts:
    """W [N, K] -> codes [N, K] uint8 0..15, scales and zeros [N, K/g] f32 (their bf16 values)."""
    rows, cols = weight.shape
    groups = cols // group_size
    codes = torch.empty(rows, cols, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=weight.device)
    zeros = torch.empty_like(scales)
    for first in range(0, rows, _ROWS_PER_STEP):
        block = weight[first:first + _ROWS_PER_STEP].float().view(-1, groups, group_size)  # [r, K/g, g]
        low, high = block.amin(dim=2), block.amax(dim=2)  # [r, K/g]
        exact = ((high - low) / _INT4_LEVELS).clamp(min=_INT4_EPS)
        zero = (low + _INT4_MIDDLE * exact).to(torch.bfloat16)  # from the f32 scale, then rounded, as torchao
        scale = exact.to(torch.bfloat16)
        # The value code 0 stands for, z - 8 s, in bf16 from the rounded scale and zero (as torchao computes it).
        floor = (zero - _INT4_MIDDLE * scale).float()[..., None]
        q = torch.round((block - floor) / scale.float()[..., None]).clamp(0, _INT4_LEVELS)
        codes[first:first + _ROWS_PER_STEP] = q.view(-1, cols).to(torch.uint8)
        scales[first:first + _ROWS_PER_STEP], zeros[first:first + _ROWS_PER_STEP] = scale.float(), zero.float()
    return int4.Int4Parts(codes, scales, zeros, group_size)
