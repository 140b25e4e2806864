"""Choosing the next token from the master's logits, with Cake's sampling options.

Cake's master (`create_logits_processor`) picks argmax when the temperature is not positive,
otherwise samples from softmax(logits / temperature), restricted to the top-k tokens, then to
the smallest set whose probability reaches top-p, when those are given. The repeat penalty
divides positive logits and multiplies negative ones of the tokens generated within the last
`repeat_last_n` steps (Cake applies it to generated tokens only, not the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cakemp.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options; the defaults are Cake's."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repeat_penalty: float = 1.1
    repeat_last_n: int = 128
    seed: int = 299792458

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top-k must be at least 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.repeat_penalty <= 0.0:
            raise ConfigError(f"repeat penalty must be positive, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ConfigError(f"repeat-last-n must not be negative, got {self.repeat_last_n}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Draws tokens for one generation; the same params and logits give the same tokens."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator = torch.Generator().manual_seed(params.seed)

    def sample(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        """The next token id from `logits` [V] given the tokens generated so far."""
        p = self.params
        logits = logits.detach().to(device="cpu", dtype=torch.float32).flatten()
        if p.repeat_penalty != 1.0 and p.repeat_last_n > 0 and generated:
            logits = penalize_repeats(logits, generated[-p.repeat_last_n:], p.repeat_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        # Keep candidates sorted by probability, most likely first: [V'] each.
        probs, ids = torch.sort(probs, descending=True)
        if p.top_k is not None:
            probs, ids = probs[:p.top_k], ids[:p.top_k]
        if p.top_p is not None:
            probs = probs / probs.sum()
            # Keep a token while the mass before it is still short of top_p; the first always stays.
            before = torch.cumsum(probs, dim=-1) - probs
            keep = before < p.top_p
            probs, ids = probs[keep], ids[keep]
        choice = torch.multinomial(probs, 1, generator=self._generator)
        return int(ids[choice])


def penalize_repeats(logits: torch.Tensor, tokens: Sequence[int], penalty: float) -> torch.Tensor:
    """A copy of `logits` [V] with each distinct token in `tokens` made less likely by `penalty`."""
    out = logits.clone()
    ids = torch.tensor(sorted(set(tokens)), dtype=torch.long)
    seen = out[ids]
    out[ids] = torch.where(seen >= 0, seen / penalty, seen * penalty)
    return out
