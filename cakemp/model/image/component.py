"""What every image component is (sd.py, flux.py, flux1.py): built from its files, then called in
two halves, so that calls of equal shapes from several masters compute as one batch
(compute/components.py): `prepare` checks one call's tensors and puts them on the device, `group`
says which prepared calls may be computed together, `cost` estimates one call's activation
memory (for the device's budget, and so that calls of very different costs are not grouped), `run`
computes a group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch

# Activations of one module's width live at once (its input, output and intermediates): a bound,
# not a measurement, so that `cost` errs on the high side.
LIVE_ACTIVATIONS = 4


def activation_bytes(dtype: torch.dtype, batch: int, positions: int, width: int, heads: int = 0,
                     attended: int = 0) -> int:
    """An upper estimate of the bytes a module computing `batch` items of `positions` positions
    (pixels or tokens) holds at once: LIVE_ACTIVATIONS activations [batch, positions, width], and the
    attention scores [batch, heads, positions, attended] that torch's math kernel materialises."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize * batch * positions * (LIVE_ACTIVATIONS * width + heads * attended)


def vae_bytes(dtype: torch.dtype, channels: Sequence[int], batch: int, pixels: int) -> int:
    """activation_bytes of a VAE's encoder or decoder over images of `pixels` pixels: each stage's
    activations [b, pixels / 4^i, channels[i]] (the full-resolution one's first), and the mid
    block's one-head self-attention over the latent positions, pixels / 4^(stages - 1)."""
    stages = sum(activation_bytes(dtype, batch, pixels >> (2 * i), width) for i, width in enumerate(channels))
    latent = pixels >> (2 * (len(channels) - 1))
    return stages + activation_bytes(dtype, batch, latent, 0, heads=1, attended=latent)


class Files(Protocol):
    """Where a component's weights are, and its config.json (None: its version's standard one)."""

    weights: str
    config: str | None


class Component(Protocol):
    """One image component, as a Cake worker computes it."""

    # The call carries the prompt's real token count (Cake's master sends it as the op's index_pos),
    # passed to `prepare` as `token_count`: FLUX.2's text encoder masks the padding past it.
    uses_token_count: ClassVar[bool] = False

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype) -> None:
        """Build the component `name` (as topology entries spell it) of `version` (--sd-version) and load
        it from `files` onto `device` in `dtype` (or the dtype Cake computes it in). Raises CheckpointError."""

    def prepare(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One call's tensors (token ids, or the tensors of Cake's pack, on the CPU), checked against
        the architecture (BadTensor: the master's mistake) and on the device."""

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        """What prepared calls computed together share: their shapes but the batch size, and whatever
        else one batched pass must have in common."""

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """An upper estimate of the activation bytes computing the prepared `call` alone holds at once,
        from its shapes and the config (activation_bytes)."""

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """The reply to each call of one group, computed as one batch."""
