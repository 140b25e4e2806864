"""MLX affine-quantized weights (mx.quantize, mlx-lm's conversions) dequantized into plain matrices.

    W[..., r, c] = q[..., r, c] * scales[..., r, c // group_size] + biases[..., r, c // group_size]

q: the `bits`-wide code of column c, packed along each row (weight [..., rows, cols * bits /
32] u32). The leading dimensions are those of a stacked tensor (mlx-lm's switch_mlp experts,
[E, rows, cols]), each matrix quantized on its own.
"""

from __future__ import annotations

import torch

from cakemp.model import bitfields

_VALUES_PER_STEP = 1 << 20


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """The stored tensors (MlxParts' shapes) -> W: [..., rows, cols] f32; ValueError if they do not fit together."""
    *lead, words = weight.shape
    cols = words * 32 // bits
    if words * 32 % bits or cols % group_size:
        raise ValueError(f"a row of {words} words is no whole number of {group_size}-column groups of {bits}-bit codes")
    groups = (*lead, cols // group_size)
    for name, tensor in (("scales", scales), ("biases", biases)):
        if tuple(tensor.shape) != groups:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {groups} for a weight of {tuple(weight.shape)}")
    words = weight.reshape(-1, words)  # [R, cols * bits / 32]
    scales, biases = scales.reshape(-1, groups[-1]).float(), biases.reshape(-1, groups[-1]).float()
    out = torch.empty(words.shape[0], cols, dtype=torch.float32, device=weight.device)
    # A few rows at a time: the temporaries stay small (in cache, no fresh pages to fault in).
    step = max(1, _VALUES_PER_STEP // max(cols, 1))
    for rows in (slice(start, start + step) for start in range(0, words.shape[0], step)):
        codes = bitfields.unpack(words[rows], bits, cols).float().view(-1, groups[-1], group_size)
        # q * scale + bias in f32, each rounded once, as mx.dequantize computes in f32.
        out[rows] = torch.addcmul(biases[rows, :, None], codes, scales[rows, :, None]).view(-1, cols)
    return out.view(*lead, cols)
