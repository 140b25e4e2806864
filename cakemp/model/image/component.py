"""What every image component is (sd.py, flux.py, flux1.py): built from its files, then called in
two halves, so that calls of equal shapes from several masters compute as one batch
(compute/components.py): `prepare` checks one call's tensors and puts them on the device, `group`
says which prepared calls may be computed together, `run` computes a group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch


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

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """The reply to each call of one group, computed as one batch."""
