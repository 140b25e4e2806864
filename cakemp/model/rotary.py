"""Rotary position embedding tables (rotate-half / NeoX layout, as in HF and Cake)."""

from __future__ import annotations

import math

import torch

from cakemp.checkpoint.config import LinearRopeScaling, Llama3RopeScaling, LongRopeScaling, Rope


class Rotary:
    """cos/sin for absolute positions of one rotary embedding, shared by the layers that use it."""

    def __init__(self, rope: Rope, device: torch.device):
        self.rope = rope
        # inv_freq: [dim/2] f32; frequencies are computed in f32 as HF and Cake do, so positions
        # round the same way they do.
        exponents = torch.arange(0, rope.dim, 2, dtype=torch.int64).float() / rope.dim
        scaling = rope.scaling
        self.long_inv_freq = None
        self.attention_factor = 1.0
        if isinstance(scaling, LongRopeScaling):
            # Divided by the factors before inverting, as transformers does (same rounding).
            powers = rope.theta**exponents
            inv_freq = 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * powers)
            self.long_inv_freq = (1.0 / (torch.tensor(scaling.long_factor, dtype=torch.float32) * powers)).to(device)
            self.attention_factor = scaling.attention_factor
        else:
            inv_freq = 1.0 / (rope.theta**exponents)
            if isinstance(scaling, Llama3RopeScaling):
                inv_freq = _llama3_scaled(inv_freq, scaling)
            elif isinstance(scaling, LinearRopeScaling):
                inv_freq = inv_freq / scaling.factor
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, long: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N, dim] in `dtype` for positions: [N] (int), the rows of a step's requests.

        Computed per step rather than tabled up to the context limit: a table for 128k positions
        would cost tens of MiB per device, and this is dim/2 * N products. Longrope switches to its
        long factors for a whole request once the request reaches past the original context, as
        transformers does per forward call (keys cached earlier keep the short factors): `long`
        [N] bool marks the rows of such requests (`reaches_long`).
        """
        at = positions.to(torch.float32)[:, None]  # [N, 1]
        angles = at * self.inv_freq  # [N, dim/2] f32, as torch.outer
        if long is not None:
            angles = torch.where(long[:, None], at * self.long_inv_freq, angles)
        angles = torch.cat((angles, angles), dim=-1)  # [N, dim]: both halves rotate by the same angle
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def reaches_long(self, end: int) -> bool:
        """Whether a request ending before position `end` takes longrope's long factors (never without longrope)."""
        return self.long_inv_freq is not None and end > self.rope.scaling.original_max_position_embeddings


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1 rescaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    old_context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    short_limit = old_context / scaling.high_freq_factor
    long_limit = old_context / scaling.low_freq_factor
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    ramp = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > long_limit, inv_freq / scaling.factor, ramp)
    return torch.where(wavelen < short_limit, inv_freq, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D] rotated by cos/sin: [T, R]; pairs are (i, i + R/2) within the first R dims
    (R < D: partial rotary, the rest pass through), computed in x's dtype."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
