"""Block-wise FP8 (e4m3) weights, as DeepSeek-V3 / Qwen3-FP8 checkpoints store them."""

from __future__ import annotations

import torch


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight: [..., M, N] float8_e4m3fn, scale_inv: [..., ceil(M/bm), ceil(N/bn)] -> [..., M, N] f32.

    Element (i, j) is weight[i, j] * scale_inv[i // bm, j // bn], in f32 (leading dims, such as
    the expert axis of fused MoE weights, index matrices scaled on their own). Sides that are not
    multiples of the block size end in a partial block that uses its block's scale (Cake's
    reshape-based dequant refuses those matrices).
    """
    *lead, rows, cols = weight.shape
    bm, bn = block
    scale = scale_inv.float()
    if scale.shape != (*lead, -(-rows // bm), -(-cols // bn)):
        raise ValueError(f"scale_inv shape {tuple(scale.shape)} does not cover a {rows}x{cols} weight in {bm}x{bn} blocks")
    # Expand each scale over its block, then cut the partial last blocks to the weight's sides.
    scale = scale.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return weight.float() * scale
