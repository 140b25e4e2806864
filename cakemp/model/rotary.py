"""Rotary position embedding tables (rotate-half / NeoX layout, as in HF and Cake)."""

from __future__ import annotations

import math

import torch

from cakemp.model.config import Llama3RopeScaling, ModelConfig


class Rotary:
    """cos/sin for absolute positions, shared by every layer of a model (they share head_dim)."""

    def __init__(self, config: ModelConfig, device: torch.device):
        # inv_freq: [R/2] f32 for the rotated width R (= D unless the rotary is partial);
        # frequencies are computed in f32 as HF and Cake do, so positions round the same way.
        width = config.rotary_dim
        exponents = torch.arange(0, width, 2, dtype=torch.int64).float() / width
        inv_freq = 1.0 / (config.rope_theta**exponents)
        if config.rope_scaling is not None:
            inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, index_pos: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [length, R] in `dtype` for positions index_pos .. index_pos+length-1.

        Computed per request rather than tabled up to the context limit: a table for 128k
        positions would cost tens of MiB per device, and this is D/2 * length products.
        """
        positions = torch.arange(index_pos, index_pos + length, device=self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)  # [T, R/2] f32
        angles = torch.cat((angles, angles), dim=-1)  # [T, R]: both halves rotate by the same angle
        return angles.cos().to(dtype), angles.sin().to(dtype)


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
    """x: [..., T, D] rotated by cos/sin: [T, R]; pairs are (i, i + R/2), computed in x's dtype.

    With a partial rotary (R < D, as Qwen3.5's 0.25 of head_dim) only the first R dims turn
    and the other D - R pass through unchanged.
    """
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
