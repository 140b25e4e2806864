"""4-bit weights kept 4-bit: torch's int4 weight-only matmul (tinygemm), on a GPU or a CPU.

torch's kernels (CUDA: `_weight_int4pack_mm`; CPU: `_weight_int4pack_mm_for_cpu`) take one
convention for an [N, K] weight in groups of g consecutive inputs (g in 32, 64, 128, 256):

    W[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n]

q: unsigned 4-bit codes 0..15; scales_and_zeros [K/g, N, 2] bf16 ([..., 0] the scale, [..., 1]
the zero, a value, not a code). Each format's 4-bit codes map onto it unchanged; only the
scales and zeros are rewritten (in f32, then rounded once to bf16):

| format      | stored value     | scale | zero       |
|-------------|------------------|-------|------------|
| GPTQ        | s * (q - z)      | s     | s * (8 - z) |
| MLX affine  | q * s + b        | s     | b + 8 s    |
| GGUF Q4_0   | d * (q - 8)      | d     | 0          |
| GGUF Q4_1   | d * q + m        | d     | m + 8 d    |
| GGUF Q4_K   | d sc * q - dmin m | d sc | 8 d sc - dmin m |

GPTQ act-order (g_idx puts the inputs in groups out of order) maps onto it by one permutation of
the inputs: the stored columns sorted by group (`order`, [K] int64: the input each column holds),
so each group is g consecutive columns, and each product gathers x's inputs in that order first.

The format modules (gptq.py, mlx.py, ggml.py) make `Int4Parts`; `Int4Weight.create` packs them
for the device's kernel. Only the packing differs between devices: CUDA's takes [N, K/2] uint8
(two codes a byte, the even input in the high nibble) and lays them out for its tensor cores
(int32 [N/8, K/(16 t), 32, t/2], t the inner K tiles); the CPU's takes the int32 [N, K] codes
and holds them as uint8 [N/B, K, B/2]: block b, input k, byte j holds output B b + j in its low
nibble and B b + B/2 + j in its high one. B is the CPU kernel's own: 64 where torch runs it with
AVX-512, 32 with AVX2 (`cpu_block` reads it off a packing).
Resident: N K / 2 bytes of codes and 4 N K / g of scales and zeros (0.27 of bf16 at g = 128),
and 8 K of `order` for an act-order weight.

The kernels take bf16 activations: `matmul` rounds x to bf16 and returns x's dtype, so a node
computing in f32 keeps its f32 activations between the matmuls. On a CPU the int4 kernel's time
grows with the rows (a decode step: 3x faster than f32; 128 rows: 1.9x slower, bench/int4_crossover.py),
while the bf16 GEMM's barely does; from `_DEQUANTIZED_ROWS` rows on, W^T is dequantized to bf16 a
tile of outputs at a time (each value the formula's, rounded once to bf16) and multiplied by that
GEMM: a 128-token prompt chunk then takes about the dequantized f32 path's time.
`kernel_works` tries the kernel (and that tiling) on the device against this formula before any
weight uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cakemp.checkpoint import resident

KERNEL = resident.INT4
GROUP_SIZES = resident.INT4_GROUP_SIZES  # the group sizes torch's kernels take
_OFFSET = 8  # the kernel's codes are q - 8
# Activation rows from which a CPU product dequantizes tiles to bf16 instead of calling the int4
# kernel (bench/int4_crossover.py measures both per shape; docs/benchmarks.md has the figures).
_DEQUANTIZED_ROWS = 64
# Outputs dequantized at once: 1024 rows (4 MiB of bf16 at K = 2048). Fewer, larger ops beat a tile
# that fits L2 (256 rows) here: each op's fixed cost, not the cache, bounds the small ones.
_TILE_OUTPUTS = 1024


class Int4Shape(NamedTuple):
    """What a matrix kept int4 is, known from a checkpoint's headers (and GPTQ's g_idx): its
    [rows, cols], group size and, for act-order, the input order its columns are stored in."""

    rows: int
    cols: int
    group_size: int
    order: torch.Tensor | None = None  # [cols] int64, or None: in input order

    kernel = KERNEL

    @property
    def nbytes(self) -> int:
        """What its `Int4Weight` holds but the input order (model/weights/kept.py counts that once
        for matrices fused): the codes, and bf16 scales and zeros (checkpoint/resident.py's rule)."""
        return resident.int4_bytes(self.rows, self.cols, self.group_size)

    @staticmethod
    def fuse_reason(shapes: list[Int4Shape]) -> str | None:
        """Why these matrices cannot be one weight: groups of different sizes; else None."""
        return None if len({shape.group_size for shape in shapes}) == 1 else \
            "matrices fused together in different group sizes"


def same_order(orders: list[torch.Tensor | None]) -> bool:
    """Whether matrices fused into one weight take their inputs in one order (one gather serves them all)."""
    first = orders[0]
    return all(order is None if first is None else order is not None and torch.equal(order, first)
               for order in orders)


@dataclass(frozen=True)
class Int4Parts:
    """An [N, K] 4-bit weight in torch's convention, unpacked: W[:, order] = (codes - 8) * scales + zeros,
    scales and zeros broadcast over each group of `group_size` consecutive columns."""

    codes: torch.Tensor  # [N, K] uint8, 0..15; column j holds input order[j]
    scales: torch.Tensor  # [N, K/g] f32
    zeros: torch.Tensor  # [N, K/g] f32
    group_size: int
    order: torch.Tensor | None = None  # [K] int64, or None: column j holds input j

    @staticmethod
    def cat(parts: list[Int4Parts]) -> Int4Parts:
        """Matrices of one K, group size and input order stacked along the outputs (fused q/k/v, gate/up)."""
        if len({(p.codes.shape[1], p.group_size) for p in parts}) != 1 or \
                not same_order([p.order for p in parts]):
            raise ValueError("int4 matrices stacked together need one input size, group size and input order")
        return Int4Parts(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                         torch.cat([p.zeros for p in parts]), parts[0].group_size, parts[0].order)

    def rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> Int4Parts:
        """The same weight with its rows reordered by `reorder` ([N, ...] -> [N, ...], e.g. GGUF's unpermute)."""
        return Int4Parts(reorder(self.codes), reorder(self.scales), reorder(self.zeros), self.group_size, self.order)

    def kept(self) -> Int4Weight:
        return Int4Weight.create(self)


@dataclass(frozen=True)
class Int4Weight:
    """An [N, K] weight packed for torch's int4 matmul on its device; `linear` multiplies by it."""

    packed: torch.Tensor  # CUDA: int32 [N/8, K/(16 t), 32, t/2]; CPU: uint8 [N, K/2]
    scales_and_zeros: torch.Tensor  # [K/g, N, 2] bf16
    group_size: int
    shape: torch.Size  # (N, K)
    order: torch.Tensor | None = None  # [K] int64: the inputs gathered before the kernel (act-order), or None

    @classmethod
    def create(cls, parts: Int4Parts) -> Int4Weight:
        rows, cols = parts.codes.shape
        reason = resident.int4_unfit_reason(rows, cols, parts.group_size)
        if reason is not None:
            raise ValueError(reason)
        codes = parts.codes
        if codes.device.type == "cuda":
            pairs = (codes[:, ::2] << 4) | codes[:, 1::2]  # [N, K/2] uint8
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), _inner_k_tiles(cols))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _inner_k_tiles(cols))
        scales_and_zeros = torch.stack([parts.scales, parts.zeros], dim=-1).transpose(0, 1)  # [K/g, N, 2]
        return cls(packed, scales_and_zeros.to(torch.bfloat16).contiguous(), parts.group_size, torch.Size((rows, cols)),
                   parts.order)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> x @ W^T: [..., N] in x's dtype, x rounded to bf16 (what the kernels take)
        and, for an act-order weight, its inputs gathered into the columns' order (one index_select)."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        flat = (flat if self.order is None else flat.index_select(1, self.order)).contiguous()
        if flat.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        elif flat.shape[0] >= _DEQUANTIZED_ROWS and (block := cpu_block()) and self.shape[0] % block == 0:
            out = self._tiled(flat, block)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        return out.view(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def _tiled(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """x: [T, K] bf16 -> x @ W^T: [T, N] bf16 on a CPU, W^T dequantized to bf16 `_TILE_OUTPUTS` outputs
        (blocks of `block` in the CPU layout) at a time into one [K, outputs] buffer (each value bf16 of
        the formula's f32 value: `reference_weight` rounded once) and multiplied by one bf16 GEMM."""
        rows, cols = self.shape
        blocks, groups, half = rows // block, cols // self.group_size, block // 2
        codes = self.packed.view(blocks, cols, half)  # block b, input k, byte j: outputs B b + j, B b + B/2 + j
        scales_and_zeros = self.scales_and_zeros.view(groups, rows, 2)
        per_tile = _TILE_OUTPUTS // block
        most = min(blocks, per_tile)
        # Reused by every tile (fresh pages per tile cost more than the arithmetic); ops write whole
        # contiguous tensors where they can, as strided outputs and broadcasts run several times slower.
        low, high = (torch.empty(most, cols, half, dtype=torch.uint8) for _ in range(2))
        buffer = torch.empty(cols, most * block, dtype=torch.bfloat16)
        out = torch.empty(x.shape[0], rows, dtype=torch.bfloat16)
        for first in range(0, blocks, per_tile):
            count = min(per_tile, blocks - first)
            outputs = slice(first * block, (first + count) * block)
            tile = codes[first:first + count]  # [count, K, B/2] uint8
            # q - 8 as int8, exactly: (q + 248) mod 256.
            low_codes = torch.bitwise_and(tile, 15, out=low[:count]).add_(256 - _OFFSET).view(torch.int8)
            high_codes = torch.bitwise_right_shift(tile, 4, out=high[:count]).add_(256 - _OFFSET).view(torch.int8)
            weight = buffer[:, :count * block]  # [K, count * B]: W^T's columns of these outputs
            by_block = weight.view(cols, count, block)
            by_block[..., :half].copy_(low_codes.permute(1, 0, 2))
            by_block[..., half:].copy_(high_codes.permute(1, 0, 2))
            held = scales_and_zeros[:, outputs]  # [K/g, count * B, 2]
            grouped = weight.view(groups, self.group_size, -1)
            # (q - 8) s + z in place: bf16 addcmul computes in f32 (q s exact) and rounds the sum once.
            torch.addcmul(held[..., 1].contiguous().unsqueeze(1), grouped, held[..., 0].contiguous().unsqueeze(1),
                          out=grouped)
            out[:, outputs] = torch.mm(x, weight)
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes + (0 if self.order is None else self.order.nbytes)


def _inner_k_tiles(cols: int) -> int:
    """The most inner K tiles (of 16 inputs) that divide K: 8, 4 or 2 (K is a multiple of 32)."""
    return next(tiles for tiles in (8, 4, 2) if cols % (16 * tiles) == 0)


@functools.cache
def cpu_block() -> int | None:
    """The outputs a block of the CPU kernel's packed layout holds (64 where torch runs it with AVX-512,
    32 with AVX2): the block whose layout a sample packing matches, None if none does (the kernel is
    then called for every product, and `kernel_works` judges it)."""
    rows, cols = 128, 64
    codes = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _inner_k_tiles(cols)).flatten()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    for block in (64, 32, 16):
        by_block = codes.to(torch.uint8).view(rows // block, 2, block // 2, cols)  # [N/B, low|high, B/2, K]
        expected = (by_block[:, 0] | (by_block[:, 1] << 4)).transpose(1, 2)  # [N/B, K, B/2]
        if torch.equal(packed, expected.flatten()):
            return block
    return None


@functools.cache
def kernel_works(device: torch.device) -> bool:
    """Whether torch's int4 matmul runs on `device` with bf16 activations and computes the formula
    above (tried, not inferred: torch builds differ; a CPU answers for its own kernel)."""
    generator = torch.Generator().manual_seed(0)
    rows, cols, group = _TILE_OUTPUTS + 64, 256, 128  # a tile and a part of one
    parts = Int4Parts(torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8),
                      torch.rand(rows, cols // group, generator=generator) / 16 + 1e-3,
                      torch.randn(rows, cols // group, generator=generator) / 16, group)
    try:
        weight = Int4Weight.create(Int4Parts(parts.codes.to(device), parts.scales.to(device),
                                             parts.zeros.to(device), group))
        for count in (1, 5, _DEQUANTIZED_ROWS):  # a decode step, a ragged prefill, a CPU's tiled one
            x = torch.randn(count, cols, generator=generator).to(torch.bfloat16)
            got = weight.matmul(x.to(device)).float().cpu()
            expected = x.float() @ reference_weight(parts).t()
            if not torch.allclose(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item()):
                return False
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError):
        return False
    return True


def reference_weight(parts: Int4Parts) -> torch.Tensor:
    """The [N, K] f32 weight `parts` stands for, with the scales and zeros rounded to bf16 as the
    kernel holds them: the convention written out, to check that a kernel follows it."""
    scales = parts.scales.to(torch.bfloat16).float().repeat_interleave(parts.group_size, dim=1)
    zeros = parts.zeros.to(torch.bfloat16).float().repeat_interleave(parts.group_size, dim=1)
    return (parts.codes.float() - _OFFSET) * scales + zeros
