"""ggml's ternary types, codes of -1, 0 and 1 in blocks of 256 values, dequantized in torch in f32 on
whatever device the bytes are on (one ggml family: its row in checkpoint/gguf_model.GGML_FAMILIES).
The layouts, as ggml's ggml-common.h declares them (bytes in order):

| type  | block                                                   | value              |
|-------|---------------------------------------------------------|--------------------|
| TQ2_0 | qs[64] 2-bit as Q2_K's, d                               | d * (q - 1)        |
| TQ1_0 | qs[48] (5 base-3 digits a byte), qh[4] (4 a byte), d     | d * (digit - 1)    |

TQ1_0 stores base-3 digits scaled to a byte: digit k of byte b is the top bits of 3 * (3^k b mod
256). Never kept quantized: dequantized, the compute dtype's bytes; each value the f32 ggml computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cakemp.model.weights import int4
from cakemp.model.weights.ggml_blocks import QK_K, bits, f16


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    q = (bits(blocks[:, :64].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, QK_K)
    return f16(blocks, 64) * (q.to(torch.int16) - 1).float()


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    """Bytes 0-31 give 5 digits each (values 0-159, digit-major), bytes 32-47 five each (160-239),
    the 4 qh bytes 4 each (240-255)."""
    n = blocks.shape[0]

    def digits(packed: torch.Tensor, count: int) -> torch.Tensor:  # [n, W] -> [n, count * W]
        powers = torch.tensor([3**k for k in range(count)], dtype=torch.int32, device=packed.device).view(1, -1, 1)
        return (((packed.to(torch.int32).unsqueeze(1) * powers) & 0xFF) * 3 >> 8).reshape(n, -1)

    q = torch.cat([digits(blocks[:, :32], 5), digits(blocks[:, 32:48], 5), digits(blocks[:, 48:52], 4)], dim=1)
    return f16(blocks, 52) * (q - 1).float()


# type -> its dequantizer: uint8 [n, block bytes] -> f32 [n, 256].
DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"TQ1_0": _tq1_0, "TQ2_0": _tq2_0}
INT4: dict[str, Callable[[torch.Tensor, int, int], int4.Int4Parts]] = {}
