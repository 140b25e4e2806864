"""A stored weight form that no checkpoint uses, written as a new form is: this one file (its
torch-free config and parts, its torch side) and one row (`ROW`, for checkpoint/quantization.METHODS).

config.json: quantization_config {"quant_method": "rowwise_int8"}; a weight P.weight is stored as
int8 codes [out, in] beside P.weight_row_scale, f32 [out]: W[o, i] = q[o, i] * s[o]. Kept, it is
torch's int8 matmul's own convention (one scale a row, no correction: model/weights/int8.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cakemp.checkpoint.resident import INT8, KeptForm
from cakemp.checkpoint.stored import Method, Shape, named_by
from cakemp.model.weights import int8


@dataclass(frozen=True)
class RowwiseInt8:
    def parts(self, weight: str, stored: Callable[[str], bool]) -> RowwiseParts | None:
        scale = f"{weight}_row_scale"
        return RowwiseParts(weight, scale) if stored(scale) else None


class RowwiseParts(NamedTuple):
    weight: str  # int8 [out, in]
    scale: str  # f32 [out]

    @property
    def stored(self) -> tuple[str, ...]:
        return self.weight, self.scale

    def matrix_shape(self, shape: Callable[[str], Shape]) -> Shape:
        rows, cols = shape(self.weight)
        if tuple(shape(self.scale)) != (rows,):
            raise ValueError(f"{self.scale} has shape {tuple(shape(self.scale))}, expected {(rows,)}")
        return rows, cols

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm:
        rows, cols = self.matrix_shape(shape)
        return KeptForm(INT8, rows, cols, cols)


@dataclass(frozen=True)
class RowwiseWeight:
    """The torch side (a model/weights/quantized.QuantizedParts)."""

    parts: RowwiseParts

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return stored[self.parts.weight].float() * stored[self.parts.scale].float()[:, None]

    def kept_shape(self, shape: Callable[[str], Shape], tensor: Callable[[str], torch.Tensor]) -> int8.Int8Shape:
        return int8.Int8Shape(*self.parts.matrix_shape(shape))

    def kept_parts(self, stored: Mapping[str, torch.Tensor]) -> int8.Int8Parts:
        scale = stored[self.parts.scale].float()
        return int8.Int8Parts(stored[self.parts.weight], scale, torch.zeros_like(scale))


ROW = Method("rowwise int8", named_by("rowwise_int8"), lambda settings: RowwiseInt8(), RowwiseInt8,
             "tests.support.rowwise_int8:RowwiseWeight")
