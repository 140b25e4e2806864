"""A chat as a Cake master serving its API sends it, for the prefix reuse tests of live nodes.

Each turn: the whole history (every earlier prompt and generated token) and the new prompt as
one prefill from position 0, one decode step per generated token, then Goodbye. The rows
stand for token embeddings: random, and the same bytes whenever the history repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from tests.support.checkpoints import HFLayers
from tests.support.master import CakeMaster
from tests.support.node import Samples, scrape
from tests.support.tolerance import rel_error


def rows(count: int, seed: int, hidden: int = 64) -> torch.Tensor:
    return torch.randn(1, count, hidden, generator=torch.Generator().manual_seed(seed))


@dataclass
class Conversation:
    """A master's chat on one set of connections, and HF's layers computing each prompt afresh."""

    master: CakeMaster
    reference: HFLayers
    history: torch.Tensor = field(default_factory=lambda: torch.empty(1, 0, 64))

    async def turn(self, prompt: torch.Tensor, generated: int, seed: int) -> float:
        """Send the history and `prompt` from 0, decode `generated` rows, Goodbye: the prefill's
        error relative to HF's layers computing the same rows from an empty cache."""
        x = torch.cat([self.history, prompt], dim=1)
        ours = await self.master.forward(x, 0)
        self.reference.cache = DynamicCache(config=self.reference.config)
        error = rel_error(ours, self.reference(x, 0))
        decoded = rows(generated, seed, x.shape[2])
        for i in range(generated):
            await self.master.forward(decoded[:, i:i + 1], x.shape[1] + i)
        await self.master.goodbye()
        self.history = torch.cat([x, decoded], dim=1)
        return error


def reused(metrics: Samples, device: str) -> float:
    """Positions `device` has answered from kept rows."""
    return metrics.get(("cakemp_prefix_reused_tokens_total", (("device", device),)), 0.0)


def hits(metrics: Samples, device: str) -> float:
    return metrics.get(("cakemp_prefix_hits_total", (("device", device),)), 0.0)


def evictions(metrics: Samples, device: str) -> float:
    return metrics.get(("cakemp_prefix_evictions_total", (("device", device),)), 0.0)


def retired_bytes(metrics: Samples, device: str) -> float:
    return metrics.get(("cakemp_prefix_retired_bytes", (("device", device),)), 0.0)


def reuse(port: int, devices: int = 2) -> list[float]:
    """Each device's reused positions so far."""
    seen = scrape(port)
    return [reused(seen, f"cpu:{d}") for d in range(devices)]
