"""The fields of ggml's quantized blocks read in torch: f16 scales, packed nibbles and bit planes,
on whatever device the bytes are on. Each ggml family's module (ggml_legacy.py, ggml_k.py,
ggml_iq4.py, ggml_ternary.py) reads its blocks' layout with these."""

from __future__ import annotations

import torch

QK_K = 256  # the values of one K-quant block (and of IQ4_XS's and the ternary types')


def f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's f16 at byte `at` -> f32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> the 32 4-bit codes [n, 32] of a 32-value block: low nibbles, then high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def bits(packed: torch.Tensor, shifts: range | list[int]) -> torch.Tensor:
    """uint8 [n, G, W] -> [n, G, len(shifts), W]: each byte shifted right by each shift (unmasked)."""
    return packed.unsqueeze(2) >> torch.tensor(list(shifts), dtype=torch.uint8, device=packed.device).view(1, 1, -1, 1)
