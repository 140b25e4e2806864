"""The gated feed-forward of every family here: down(act(gate(h)) * up(h)), act SiLU or GELU-tanh
(Gemma 3). A MoE's experts (moe.py) are each one of these."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from cakemp.model.linear import linear

# ModelConfig.activation -> the function.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


class GatedMlp:
    """gate and up stored fused as one [2I, H] matrix (stacked at load, or so stored by Phi):
    one GEMM where HF does two."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "silu"):
        self.w_gate_up = w_gate_up  # [2I, H]: gate rows, then up rows
        self.w_down = w_down  # [H, I]
        self.activation = ACTIVATIONS[activation]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., H] -> [..., H]."""
        gate, up = linear(h, self.w_gate_up).chunk(2, dim=-1)  # [..., I] each
        return linear(self.activation(gate) * up, self.w_down)
