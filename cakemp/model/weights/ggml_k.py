"""ggml's K-quants, blocks of 256 values in sub-blocks of one scale each, dequantized in torch in f32
on whatever device the bytes are on (one ggml family: its row in checkpoint/gguf_model.GGML_FAMILIES).
The layouts, as ggml's ggml-common.h declares them (bytes in order):

| type | block                                                          | value                        |
|------|----------------------------------------------------------------|------------------------------|
| Q2_K | scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin | d*sc * q - dmin*m     |
| Q3_K | hmask[32], qs[64] 2-bit, scales[12] (16 6-bit, less 32), d     | d*sc * (q - 4 unless the hmask bit) |
| Q4_K | d, dmin, scales[12] (8 6-bit scales and mins), qs[128] 4-bit   | d*sc * q - dmin*m            |
| Q5_K | d, dmin, scales[12], qh[32], qs[128]                           | d*sc * q - dmin*m            |
| Q6_K | ql[128], qh[64], scales i8[16], d                              | d*sc * (q - 32)              |

Q2_K, Q3_K and Q6_K have 16 sub-blocks, Q4_K and Q5_K 8. The products are formed in the order
ggml's own dequantizers form them (the scale times the sub-block scale first), so each value is
the f32 ggml computes. Kept int4 (model/weights/int4.py, groups of 32: Q4_K's sub-blocks): its
sub-block scale * q - min = (q - 8) * scale + (8 scale - min). Resident, kept: 0.27 of bf16;
dequantized, the compute dtype's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cakemp.model.weights import int4
from cakemp.model.weights.ggml_blocks import QK_K, bits, f16, nibbles

GROUP = 32  # Q4_K's sub-block: a group of torch's int4 matmul


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]  # sub-block s: scale in the low nibble, min in the high one
    d, dmin = f16(blocks, 80), f16(blocks, 82)
    # Two halves of 128 values, each 32 bytes read at shifts 0, 2, 4, 6: sub-blocks of 16 in that order.
    q = (bits(blocks[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 16, 16).float()
    scale = (d * (scales & 0x0F).float()).unsqueeze(2)
    low = (dmin * (scales >> 4).float()).unsqueeze(2)
    return (scale * q - low).reshape(n, QK_K)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes -> its 16 signed 6-bit sub-block scales (stored plus 32), f32 [n, 16]:
    the low 4 bits are the nibbles of bytes 0-7 (low nibbles first), the high 2 bits come from
    bytes 8-11 at shifts 0, 2, 4, 6."""
    n = packed.shape[0]
    low = nibbles(packed[:, :8])  # [s]: byte s's low nibble (s < 8), byte s - 8's high one
    high = (bits(packed[:, 8:12].reshape(n, 1, 4), [0, 2, 4, 6]) & 3).reshape(n, 16)
    return ((low | (high << 4)).to(torch.int16) - 32).float()


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale = (f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])).unsqueeze(2)  # [n, 16, 1]
    low = (bits(blocks[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 16, 16)
    # hmask: value 32 j + l has its high bit in bit j of byte l; a clear bit means minus 4.
    high = (bits(blocks[:, :32].reshape(n, 1, 32), range(8)) & 1).reshape(n, 16, 16)
    q = low.to(torch.int16) - ((high ^ 1).to(torch.int16) << 2)
    return (scale * q.float()).reshape(n, QK_K)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 6-bit scales and 8 6-bit mins, f32 [n, 8] each: for
    sub-blocks 0-3 the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); for 4-7 the nibbles of
    bytes 8-11 with the top 2 bits of bytes 0-3 (scales) and 4-7 (mins) above them."""
    d, m, both = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (both & 0x0F) | ((d >> 6) << 4)], dim=1)
    mins = torch.cat([m & 0x3F, (both >> 4) | ((m >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, low, q = _q4_k_fields(blocks)
    return (scale.unsqueeze(2) * q.float() - low.unsqueeze(2)).reshape(-1, QK_K)


def _q4_k_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, 144] -> each sub-block's scale d * sc and min dmin * m (f32 [n, 8]) and its
    32 codes (uint8 [n, 8, 32]): value = scale * q - min."""
    n = blocks.shape[0]
    sc, m = _k4_scales(blocks[:, 4:16])
    # Four chunks of 32 bytes: each gives sub-block 2c (low nibbles) and 2c + 1 (high nibbles).
    q = (bits(blocks[:, 16:].reshape(n, 4, 32), [0, 4]) & 0x0F).reshape(n, 8, 32)
    return f16(blocks, 0) * sc, f16(blocks, 2) * m, q


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc, m = _k4_scales(blocks[:, 4:16])
    scale, low = (f16(blocks, 0) * sc).unsqueeze(2), (f16(blocks, 2) * m).unsqueeze(2)
    ql = (bits(blocks[:, 48:].reshape(n, 4, 32), [0, 4]) & 0x0F).reshape(n, 8, 32)
    qh = (bits(blocks[:, 16:48].reshape(n, 1, 32), range(8)) & 1).reshape(n, 8, 32)  # sub-block s: bit s
    return (scale * (ql | (qh << 4)).float() - low).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale = (f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(2)  # [n, 16, 1]
    # Two halves of 128 values: 64 ql bytes give 4 runs of 32 (low nibbles of bytes 0-31, of
    # 32-63, then their high nibbles), 32 qh bytes their top 2 bits at shifts 0, 2, 4, 6.
    ql = (bits(blocks[:, :128].reshape(n, 2, 64), [0, 4]) & 0x0F).reshape(n, 8, 32)
    qh = (bits(blocks[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return (scale * q).reshape(n, QK_K)


def _int4_q4_k(blocks: torch.Tensor, rows: int, cols: int) -> int4.Int4Parts:
    scale, low, q = _q4_k_fields(blocks)
    scale, low = scale.reshape(rows, cols // GROUP), low.reshape(rows, cols // GROUP)
    return int4.Int4Parts(q.reshape(rows, cols), scale, 8 * scale - low, GROUP)


# type -> its dequantizer: uint8 [n, block bytes] -> f32 [n, 256].
DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
# type -> its blocks [rows * cols / 256, block bytes] as int4.Int4Parts of an [rows, cols] matrix, in groups of GROUP.
INT4: dict[str, Callable[[torch.Tensor, int, int], int4.Int4Parts]] = {"Q4_K": _int4_q4_k}
