"""The torch side of the stored weight forms (FP8 beside its block scales, GPTQ, MLX affine), declared
once: `QuantizedParts`, what the safetensors reader asks of one such weight, each implemented in a
file of its own (fp8.py, gptq.py, mlx.py) that its checkpoint/quantization.METHODS row names, so
that the readers never ask which form a weight is.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from cakemp.checkpoint import quantization
from cakemp.checkpoint.stored import Parts, Quantization, Shape
from cakemp.model.weights import kept


class QuantizedParts(Protocol):
    """One quantized weight as its stored tensors (`parts.stored`, each read by name into `stored`)."""

    parts: Parts  # the torch-free side: the stored names and the shape rule

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The stored tensors -> the weight, f32 [..., rows, cols]; ValueError if they do not fit together."""

    def kept_shape(self, shape: Callable[[str], Shape],
                   tensor: Callable[[str], torch.Tensor]) -> kept.KeptShape | str:
        """Its kept.KeptShape if one of the kept kernels (int4.py, int8.py, fp8.py) takes the weight with
        its codes unchanged, else why not, from the parts' stored shapes (`shape(part)`) and, where a
        format needs one, a small part's values (`tensor(part)`); ValueError naming a part that does not fit."""

    def kept_parts(self, stored: Mapping[str, torch.Tensor]) -> kept.KeptParts:
        """A weight `kept_shape` accepted, in its kernel's convention (model/weights/int4.py, int8.py, fp8.py)."""


def parts_of(config: Quantization | None, weight: str, stored: Callable[[str], bool]) -> QuantizedParts | None:
    """`weight` as its quantized parts where the checkpoint stores it so, else None (read as stored);
    ValueError where the config and the stored tensors disagree."""
    parts = None if config is None else config.parts(weight, stored)
    return None if parts is None else torch_side(config)(parts)


def stores_parts(config: Quantization | None) -> bool:
    """Whether a checkpoint so quantized may hold weights stored as parts (which may stay quantized)."""
    return config is not None


def torch_side(config: Quantization) -> Callable[[Parts], QuantizedParts]:
    """The torch side its METHODS row names (imported once)."""
    row = next(method for method in quantization.METHODS if isinstance(config, method.config))
    return _imported(row.weights)


@functools.cache
def _imported(path: str) -> Callable[[Parts], QuantizedParts]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
