"""Qwen3.5's linear-attention decoder layer: the pre-norm shell around a Gated DeltaNet.

    x = x + GatedDeltaNet(rms_norm(x, 1 + w_in))
    x = x + mlp(rms_norm(x, 1 + w_post))         # dense, or SparseMoe (Qwen3.5-MoE)

Its session state is a LinearState (conv inputs and the recurrence), not KV rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.model.block import feed_forward, feed_forward_groups, feed_forward_shapes, rms_norm
from cakemp.model.deltanet import GatedDeltaNet, LinearState


class LinearAttentionBlock:
    recurrent = True  # its state is a recurrence: it can continue or restart, never rewind

    def __init__(self, config: ModelConfig, index: int, weights: dict[str, torch.Tensor]):
        self.eps = config.rms_norm_eps
        self.input_norm = weights["input_norm"]  # [H], 1 + w folded in
        self.post_norm = weights["post_norm"]  # [H], 1 + w folded in
        self.mixer = GatedDeltaNet(config, weights)
        self.mlp = feed_forward(config, index, weights)

    @staticmethod
    def weight_groups(config: ModelConfig, index: int, stored: Callable[[str], bool]) -> dict[str, list[str]]:
        return {
            "input_norm": ["input_layernorm.weight"],
            "post_norm": ["post_attention_layernorm.weight"],
            **GatedDeltaNet.weight_groups(),
            **feed_forward_groups(config, index, stored),
        }

    @staticmethod
    def weight_shapes(config: ModelConfig, index: int, stored: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
        H = config.hidden_size
        return {
            "input_norm": (H,),
            "post_norm": (H,),
            **GatedDeltaNet.weight_shapes(config),
            **feed_forward_shapes(config, stored),
        }

    def forward(
        self, x: torch.Tensor, segments: Sequence[tuple[int, LinearState | None]]
    ) -> tuple[torch.Tensor, list[LinearState]]:
        """x: [1, N, H], the tokens of len(segments) requests one after another, each
        (token count, the state it continues; None: a fresh start) -> ([1, N, H], their new states).

        The states given are not modified; the caller installs the returned ones once the requests succeed.
        """
        mixed, states = self.mixer(rms_norm(x, self.input_norm, self.eps), segments)
        x = x + mixed
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps)), states
