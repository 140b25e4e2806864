"""The torch side of the quantized formats whose weights are stored as several tensors (FP8 beside
its block scales, GPTQ, MLX affine), declared once: `QuantizedParts`, what the safetensors reader
asks of one such weight, and FORMATS, one row per format keyed by its torch-free config class
(checkpoint/quantization.py), each implemented in a file of its own (fp8.py, gptq.py, mlx.py).

A format adds its config (and its METHODS row) in checkpoint/quantization.py, a file here
with its QuantizedParts, and one row in FORMATS; the readers never ask which format a weight is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from cakemp.checkpoint.quantization import Fp8, Gptq, MlxAffine, Parts, Quantization, Shape
from cakemp.model.weights import fp8, gptq, kept, mlx


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


FORMATS: dict[type, Callable[[Any], QuantizedParts]] = {
    Fp8: fp8.StoredFp8,
    Gptq: gptq.GptqWeight,
    MlxAffine: mlx.MlxWeight,
}


def parts_of(quantization: Quantization | None, weight: str, stored: Callable[[str], bool]) -> QuantizedParts | None:
    """`weight` as its quantized parts where the checkpoint stores it so, else None (read as stored);
    ValueError where the config and the stored tensors disagree."""
    parts = None if quantization is None else quantization.parts(weight, stored)
    return None if parts is None else FORMATS[type(quantization)](parts)


def stores_parts(quantization: Quantization | None) -> bool:
    """Whether a checkpoint so quantized may hold weights stored as parts (which may stay quantized)."""
    return type(quantization) in FORMATS
