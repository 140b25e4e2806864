"""ggml's IQ4 types, 4-bit codes indexing 16 non-uniform levels, dequantized in torch in f32 on
whatever device the bytes are on (one ggml family: its row in checkpoint/gguf_model.GGML_FAMILIES).
The layouts, as ggml's ggml-common.h declares them (bytes in order):

| type   | values | block                                                   | value                  |
|--------|--------|---------------------------------------------------------|------------------------|
| IQ4_NL | 32     | d, qs[16] as Q4_0's                                     | d * IQ4_VALUES[q]      |
| IQ4_XS | 256    | d, scales_h u16, scales_l[4], qs[128]: 8 sub-blocks as IQ4_NL's | d*sc * IQ4_VALUES[q] |

IQ4_XS's 6-bit scales (less 32) are a nibble of scales_l and 2 bits of scales_h each. Never kept
quantized (torch's int4 matmul takes affine codes): dequantized, the compute dtype's bytes; each
value the f32 ggml computes. The lattice IQ types (IQ1_S..IQ3_S, codebooks of hundreds of entries)
are not read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cakemp.model.weights import int4
from cakemp.model.weights.ggml_blocks import QK_K, f16, nibbles

# IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml-common.h kvalues_iq4nl), indexed by a 4-bit code.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) -> IQ4_VALUES, f32."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return f16(blocks, 0) * _iq4_levels(nibbles(blocks[:, 2:]))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = nibbles(blocks[:, 4:8]).view(n, 2, 4).transpose(1, 2).reshape(n, 8)  # sub-block j: byte j // 2, low nibble first
    high_word = blocks[:, 2:4].to(torch.int32)
    high = ((high_word[:, :1] | (high_word[:, 1:] << 8)) >> torch.arange(0, 16, 2, device=blocks.device)) & 3  # [n, 8]
    scale = (f16(blocks, 0) * ((low.to(torch.int32) | (high << 4)) - 32).float()).unsqueeze(2)  # [n, 8, 1]
    codes = torch.cat([blocks[:, 8:].reshape(n, 8, 16) & 0x0F, blocks[:, 8:].reshape(n, 8, 16) >> 4], dim=2)
    return (scale * _iq4_levels(codes)).reshape(n, QK_K)


# type -> its dequantizer: uint8 [n, block bytes] -> f32 [n, values].
DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
INT4: dict[str, Callable[[torch.Tensor, int, int], int4.Int4Parts]] = {}
