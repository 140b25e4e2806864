"""ggml's first block types, of 32 values each, dequantized in torch in f32 on whatever device the
bytes are on (one ggml family: its row in checkpoint/gguf_model.GGML_FAMILIES). The layouts, as
ggml's ggml-common.h declares them (bytes in order):

| type | block                                                   | value                        |
|------|---------------------------------------------------------|------------------------------|
| Q8_0 | d f16, q i8[32]                                         | d * q                        |
| Q4_0 | d, qs[16]: value i < 16 the low nibble of qs[i], i >= 16 the high nibble of qs[i - 16] | d * (q - 8) |
| Q4_1 | d, m f16, qs[16] as Q4_0                                | d * q + m                    |
| Q5_0 | d, qh[4] (bit i: the 5th bit of value i), qs[16]        | d * (q - 16)                 |
| Q5_1 | d, m, qh[4], qs[16]                                     | d * q + m                    |

Kept int4 (model/weights/int4.py: groups of 32, one block each): Q4_0's d * (q - 8) is torch's
convention with zero 0; Q4_1's d * q + m = (q - 8) * d + (m + 8 d). Q8_0's blocks of 32 have no
exact form for torch's int8 matmul (one scale a row: int8.py): dequantized. Resident, kept: 0.27
of bf16; dequantized, the compute dtype's. Each value is the f32 ggml computes (exact: one product).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cakemp.model.weights import int4
from cakemp.model.weights.ggml_blocks import bits, f16, nibbles

GROUP = 32  # the values of one block: a group of torch's int4 matmul


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's qh uint8 [n, 4], a little-endian u32 -> bit i of it for each value i, [n, 32]."""
    return (bits(qh.unsqueeze(2), range(8)) & 1).view(-1, 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return f16(blocks, 0) * (nibbles(blocks[:, 2:]).float() - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return f16(blocks, 0) * nibbles(blocks[:, 4:]).float() + f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
    return f16(blocks, 0) * (q.float() - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
    return f16(blocks, 0) * q.float() + f16(blocks, 2)


def _int4_q4_0(blocks: torch.Tensor, rows: int, cols: int) -> int4.Int4Parts:
    d = f16(blocks, 0).view(rows, cols // GROUP)
    return int4.Int4Parts(nibbles(blocks[:, 2:]).view(rows, cols), d, torch.zeros_like(d), GROUP)


def _int4_q4_1(blocks: torch.Tensor, rows: int, cols: int) -> int4.Int4Parts:
    d = f16(blocks, 0).view(rows, cols // GROUP)
    return int4.Int4Parts(nibbles(blocks[:, 4:]).view(rows, cols), d, f16(blocks, 2).view(rows, cols // GROUP) + 8 * d,
                          GROUP)


# type -> its dequantizer: uint8 [n, block bytes] -> f32 [n, values].
DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
}
# type -> its blocks [rows * cols / 32, block bytes] as int4.Int4Parts of an [rows, cols] matrix, in groups of GROUP.
INT4: dict[str, Callable[[torch.Tensor, int, int], int4.Int4Parts]] = {"Q4_0": _int4_q4_0, "Q4_1": _int4_q4_1}
