"""Block-wise FP8 weights, torch-free: config.json's quantization_config {quant_method "fp8",
weight_block_size [rows, cols] (default 128x128)}; a weight P.weight stored e4m3 [..., rows, cols]
beside P.weight_scale_inv, f32 [..., ceil(rows / bm), ceil(cols / bn)]: w = e4m3 * its block's scale.
Kept "fp8" (checkpoint/resident.py: N K bytes and the block scales, 0.5 of bf16) where a GPU
multiplies e4m3, for matrices in 128x128 blocks; else dequantized. Its torch side:
model/weights/fp8.py (dequantization, the kept weight, the matmuls and their error bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from cakemp.checkpoint.resident import FP8, FP8_BLOCK, KeptForm, fp8_unfit_reason
from cakemp.checkpoint.stored import Method, Shape, expect, named_by, ranked
from cakemp.checkpoint.values import as_list, shown, whole

_DEFAULT_BLOCK = (128, 128)
_MAX_BLOCK = 1 << 16


@dataclass(frozen=True)
class Fp8:
    """Block-wise e4m3 weights: one scale per (rows, cols) block."""

    block: tuple[int, int]

    def parts(self, weight: str, stored: Callable[[str], bool]) -> Fp8Parts | None:
        """The weight and its scales (P.weight_scale_inv, stored beside it) if it is stored so, else None."""
        scale_inv = f"{weight}_scale_inv"
        return Fp8Parts(weight, scale_inv, self.block) if stored(scale_inv) else None


class Fp8Parts(NamedTuple):
    weight: str  # e4m3 [..., rows, cols]
    scale_inv: str  # f32 [..., ceil(rows / block[0]), ceil(cols / block[1])]: w = e4m3 * its block's scale
    block: tuple[int, int]

    @property
    def stored(self) -> tuple[str, ...]:
        return self.weight, self.scale_inv

    def matrix_shape(self, shape: Callable[[str], Shape]) -> Shape:
        """The weight's own stored shape, its scales checked to cover it in blocks (ValueError naming them)."""
        *lead, rows, cols = ranked(self.weight, shape(self.weight), 2, at_least=True)
        bm, bn = self.block
        expect(self.scale_inv, shape(self.scale_inv), (*lead, -(-rows // bm), -(-cols // bn)))
        return (*lead, rows, cols)

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm | str:
        """fp8 for one matrix in 128x128 blocks, each side a whole number of them, else why not."""
        stored = self.matrix_shape(shape)
        if len(stored) != 2:
            return f"FP8 stacked weights of shape {stored}"
        return fp8_unfit_reason(*stored, self.block) or KeptForm(FP8, *stored, FP8_BLOCK)


def _fp8(quant: dict[str, Any]) -> Fp8:
    block = as_list("weight_block_size", quant.get("weight_block_size") or list(_DEFAULT_BLOCK))
    if len(block) != 2:
        raise ValueError(f"weight_block_size {shown(block)} is not [rows, cols]")
    return Fp8(tuple(whole("weight_block_size", n, 1, _MAX_BLOCK) for n in block))


METHOD = Method("fp8", named_by("fp8"), _fp8, Fp8, "cakemp.model.weights.fp8:StoredFp8")
