"""The SiLU-gated feed-forward of every family here: down(silu(gate(h)) * up(h))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cakemp.model.fp8 import linear


class GatedMlp:
    """gate and up stored fused as one [2I, H] matrix: one GEMM where HF does two."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        self.w_gate_up = w_gate_up  # [2I, H]: gate rows, then up rows
        self.w_down = w_down  # [H, I]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., H] -> [..., H]."""
        gate, up = linear(h, self.w_gate_up).chunk(2, dim=-1)  # [..., I] each
        return linear(F.silu(gate) * up, self.w_down)
