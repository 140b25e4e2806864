"""8-bit weights kept 8-bit on a CPU: torch's int8 weight-only matmul, one scale per output.

torch's CPU kernel `_weight_int8pack_mm(x [M, K] bf16, w [N, K] int8, scales [N] bf16)` computes
x @ (w * scales[:, None])^T: symmetric int8 codes and one scale per output row. The formats whose
8-bit matrices have one group per row map onto it with their codes unchanged but for a shift by
128 into int8, the zero point folded into a per-row correction times the row sum of x:

    W[n, k] = s[n] * c[n, k] + correction[n]
    y[m, n] = s[n] * sum_k c[n, k] x[m, k] + correction[n] * sum_k x[m, k]

| format                            | stored value | c       | s | correction  |
|-----------------------------------|--------------|---------|---|-------------|
| GPTQ 8-bit, group_size -1         | s (q - z)    | q - 128 | s | s (128 - z) |
| MLX affine 8-bit, one group a row | s q + b      | q - 128 | s | b + 128 s   |

(GPTQ's symmetric zero point is 128: its correction is 0.) The kernel is given scales of 1 and s
is applied after, in f32, with the correction: the kernel's sum is integer codes times bf16 x,
accumulated in f32 and rounded once to bf16, and neither s nor the correction is ever rounded.

8-bit matrices in groups along a row (GPTQ-8 with a group size, MLX-8 in groups of 32..128, GGUF
Q8_0's blocks of 32) do not map: their scale changes along k, so x @ W^T would be one kernel call
per group over its g inputs, each [M, N] output scaled and summed in f32. On the 2-core Xeon, one
thread, [5632, 2048] in groups of 128, one row: 16 such calls take 1.5 ms, against 0.8 for one call
over all of K and 2.0 for the f32 matrix; Q8_0's 64 groups a row would take 4 times the calls.
Short of the per-channel gain, and slower than f32 from a few rows on (each call's f32 pass over
[M, N]): they stay dequantized.

The CPU kernel is fast only for a few rows (0.8 ms at 1 row, 2.3 at 8, 34 at 128, where the bf16
GEMM over the same codes widened to bf16, exact since |c| <= 128, takes 3.8): from
`_DEQUANTIZED_ROWS` rows on, the codes are widened to bf16 a tile of outputs at a time, in cache,
and multiplied by that GEMM, which also rounds its output once. Resident: N K bytes of codes and
10 N of scales, corrections and the kernel's unit scales (0.50 of bf16).
`kernel_works` tries the kernel (and the tiles) against the formula before any weight uses it;
on a GPU 8-bit matrices are dequantized (torch's int8 kernel not tried there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cakemp.checkpoint import resident

KERNEL = resident.INT8
OFFSET = 128  # int8 codes are the stored unsigned 8-bit codes less 128
# Activation rows from which a product widens tiles of codes to bf16 instead of calling the int8
# kernel. Measured on the 2-core Xeon, one thread, [5632, 2048]: the kernel 4.4 ms at 16 rows, 8.6
# at 32, 34 at 128; the tiles 4.7, 5.5, 9.1 (f32 through MKL: 6.4, 8.1, 21).
_DEQUANTIZED_ROWS = 20
_TILE_ROWS = 256  # outputs widened at once: 1 MiB of bf16 at K = 2048, in L2


class Int8Shape(NamedTuple):
    """What a matrix kept int8 is, known from a checkpoint's headers: its [rows, cols]."""

    rows: int
    cols: int

    kernel = KERNEL
    order = None  # its columns are in input order

    @property
    def nbytes(self) -> int:
        """What its `Int8Weight` holds: the codes, and f32 scales and corrections and bf16 unit scales per
        row (checkpoint/resident.py's rule)."""
        return resident.int8_bytes(self.rows, self.cols)

    @staticmethod
    def fuse_reason(shapes: list[Int8Shape]) -> str | None:
        """Why these matrices cannot be one weight (never: each row holds its own scale)."""
        return None


@dataclass(frozen=True)
class Int8Parts:
    """An [N, K] 8-bit weight in the convention above, unpacked: W = scales[:, None] * codes + corrections[:, None]."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] f32
    corrections: torch.Tensor  # [N] f32

    @staticmethod
    def cat(parts: list[Int8Parts]) -> Int8Parts:
        """Matrices of one K stacked along the outputs (fused q/k/v, gate/up)."""
        if len({p.codes.shape[1] for p in parts}) != 1:
            raise ValueError("int8 matrices stacked together need one input size")
        return Int8Parts(*(torch.cat([getattr(p, field) for p in parts]) for field in ("codes", "scales", "corrections")))

    def kept(self) -> Int8Weight:
        return Int8Weight(self.codes.contiguous(), torch.ones_like(self.scales, dtype=torch.bfloat16),
                          self.scales.float().contiguous(), self.corrections.float().contiguous())


@dataclass(frozen=True)
class Int8Weight:
    """An [N, K] weight kept int8 for torch's CPU int8 matmul; `matmul` multiplies by it."""

    codes: torch.Tensor  # [N, K] int8
    unit_scales: torch.Tensor  # [N] bf16 ones: the kernel's scales (s is applied after, in f32)
    scales: torch.Tensor  # [N] f32
    corrections: torch.Tensor  # [N] f32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> x @ W^T: [..., N] in x's dtype, x rounded to bf16 (what the kernel takes)."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K]
        if flat.shape[0] >= _DEQUANTIZED_ROWS:
            sums = self._tiled(flat)
        else:
            sums = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.unit_scales)  # [M, N] bf16
        row_sums = flat.float().sum(dim=1, keepdim=True)  # [M, 1]: sum_k x[m, k], of the rounded x
        out = torch.addcmul(row_sums * self.corrections, sums.float(), self.scales)  # [M, N] f32
        return out.reshape(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] bf16 -> x @ codes^T: [M, N] bf16 (a transposed view), the codes widened to bf16
        `_TILE_ROWS` outputs at a time into one buffer, each tile's product written as rows of [N, M]."""
        rows, cols = self.shape
        out = torch.empty(rows, x.shape[0], dtype=torch.bfloat16)  # [N, M]: each tile's rows contiguous
        buffer = torch.empty(min(rows, _TILE_ROWS), cols, dtype=torch.bfloat16)  # reused: no fresh pages per tile
        for first in range(0, rows, _TILE_ROWS):
            tile = buffer[:min(_TILE_ROWS, rows - first)].copy_(self.codes[first:first + _TILE_ROWS])  # exact
            torch.matmul(tile, x.t(), out=out[first:first + tile.shape[0]])
        return out.t()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.unit_scales.nbytes + self.scales.nbytes + self.corrections.nbytes


def reference_weight(parts: Int8Parts) -> torch.Tensor:
    """The [N, K] f32 weight `parts` stands for: the convention written out, to check a kernel against."""
    return parts.scales.float()[:, None] * parts.codes.float() + parts.corrections.float()[:, None]


@functools.cache
def kernel_works(device: torch.device) -> bool:
    """Whether torch's int8 matmul runs on `device` (a CPU: no other is tried) with bf16 activations
    and computes the formula above, through the kernel and the tiles alike."""
    if device.type != "cpu":
        return False
    generator = torch.Generator().manual_seed(0)
    rows, cols = _TILE_ROWS + 40, 96
    parts = Int8Parts(torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8),
                      torch.rand(rows, generator=generator) / 16 + 1e-3, torch.randn(rows, generator=generator))
    try:
        weight = parts.kept()
        for count in (1, 5, _DEQUANTIZED_ROWS):  # a decode step, a ragged prefill, a tiled one
            x = torch.randn(count, cols, generator=generator).to(torch.bfloat16)
            expected = x.float() @ reference_weight(parts).t()
            if not torch.allclose(weight.matmul(x).float(), expected, rtol=0.02, atol=0.02 * expected.abs().max().item()):
                return False
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError):
        return False
    return True
