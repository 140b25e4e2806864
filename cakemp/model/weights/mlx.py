"""MLX affine-quantized weights (mx.quantize, mlx-lm's conversions) dequantized into plain matrices.

    W[..., r, c] = q[..., r, c] * scales[..., r, c // group_size] + biases[..., r, c // group_size]

q: the `bits`-wide code of column c, packed along each row (weight [..., rows, cols * bits /
32] u32). The leading dimensions are those of a stacked tensor (mlx-lm's switch_mlp experts,
[E, rows, cols]), each matrix quantized on its own. Kept for torch's kernels: 4-bit matrices in
groups of 32..256 int4 (model/weights/int4.py), on a CPU 8-bit ones of one group a row int8 (int8.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from cakemp.checkpoint.mlx import MlxParts
from cakemp.checkpoint.stored import Shape
from cakemp.model.weights import bitfields, int4, int8, kept

_VALUES_PER_STEP = 1 << 20


@dataclass(frozen=True)
class MlxWeight:
    """One MLX affine weight read from its stored parts (a model/weights/quantized.QuantizedParts)."""

    parts: MlxParts

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        p = self.parts
        return dequantize(stored[p.weight], stored[p.scales], stored[p.biases], p.bits, p.group_size)

    def kept_shape(self, shape: Callable[[str], Shape],
                   tensor: Callable[[str], torch.Tensor]) -> kept.KeptShape | str:
        """Its int8.Int8Shape (8 bits, one group a row) or int4.Int4Shape from the packed weight's header
        alone (the parts' kept_form: checkpoint/resident.py)."""
        form = self.parts.kept_form(shape)
        if isinstance(form, str):
            return form
        if form.kernel == int8.KERNEL:
            return int8.Int8Shape(form.rows, form.cols)
        return int4.Int4Shape(form.rows, form.cols, form.group_size)

    def kept_parts(self, stored: Mapping[str, torch.Tensor]) -> kept.KeptParts:
        p = self.parts
        if p.bits == 8:
            return int8_parts(stored[p.weight], stored[p.scales], stored[p.biases])
        return int4_parts(stored[p.weight], stored[p.scales], stored[p.biases], p.group_size)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """The stored tensors (MlxParts' shapes) -> W: [..., rows, cols] f32; ValueError if they do not fit together."""
    stored = {"weight": weight, "scales": scales, "biases": biases}
    *lead, cols = MlxParts("weight", "scales", "biases", bits, group_size).matrix_shape(
        lambda part: tuple(stored[part].shape))
    groups = (*lead, cols // group_size)
    words = weight.reshape(-1, weight.shape[-1])  # [R, cols * bits / 32]
    scales, biases = scales.reshape(-1, groups[-1]).float(), biases.reshape(-1, groups[-1]).float()
    out = torch.empty(words.shape[0], cols, dtype=torch.float32, device=weight.device)
    # A few rows at a time: the temporaries stay small (in cache, no fresh pages to fault in).
    step = max(1, _VALUES_PER_STEP // max(cols, 1))
    for rows in (slice(start, start + step) for start in range(0, words.shape[0], step)):
        codes = bitfields.unpack(words[rows], bits, cols).float().view(-1, groups[-1], group_size)
        # q * scale + bias in f32, each rounded once, as mx.dequantize computes in f32.
        out[rows] = torch.addcmul(biases[rows, :, None], codes, scales[rows, :, None]).view(-1, cols)
    return out.view(*lead, cols)


def int4_parts(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int) -> int4.Int4Parts:
    """A 4-bit MLX matrix `kept_form` accepted, in torch's int4 convention: q * s + b = (q - 8) * s + (b + 8 s)."""
    rows, words = weight.shape
    cols = words * 8
    groups = (rows, cols // group_size)
    for name, tensor in (("scales", scales), ("biases", biases)):
        if tuple(tensor.shape) != groups:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {groups} for a weight of {tuple(weight.shape)}")
    scales = scales.float()
    return int4.Int4Parts(bitfields.unpack(weight, 4, cols).to(torch.uint8), scales, biases.float() + 8 * scales,
                          group_size)


def int8_parts(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> int8.Int8Parts:
    """An 8-bit MLX matrix of one group a row, in torch's int8 convention: q * s + b = (q - 128) * s + (b + 128 s)."""
    rows, words = weight.shape
    for name, tensor in (("scales", scales), ("biases", biases)):
        if tuple(tensor.shape) != (rows, 1):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {(rows, 1)} for a weight of "
                             f"{tuple(weight.shape)}")
    codes = bitfields.unpack(weight, 8, words * 4) - int8.OFFSET  # [rows, cols], -128..127
    scale = scales[:, 0].float()
    return int8.Int8Parts(codes.to(torch.int8), scale, biases[:, 0].float() + int8.OFFSET * scale)
