"""ggml's tensor types dequantized in torch, in f32, on whatever device the bytes are on.

Each quantized type stores a row as blocks of values (checkpoint/gguf.py: GGML_TYPES gives
their sizes); a block holds f16 scales and packed integer codes. The layouts, as ggml's
ggml-common.h declares them (bytes in order):

| type | values | block                                                   | value                        |
|------|--------|---------------------------------------------------------|------------------------------|
| Q8_0 | 32     | d f16, q i8[32]                                         | d * q                        |
| Q4_0 | 32     | d, qs[16]: value i < 16 the low nibble of qs[i], i >= 16 the high nibble of qs[i - 16] | d * (q - 8) |
| Q4_1 | 32     | d, m f16, qs[16] as Q4_0                                | d * q + m                    |
| Q5_0 | 32     | d, qh[4] (bit i: the 5th bit of value i), qs[16]        | d * (q - 16)                 |
| Q5_1 | 32     | d, m, qh[4], qs[16]                                     | d * q + m                    |
| Q2_K | 256    | scales[16] (low nibble scale, high nibble min), qs[64] 2-bit, d, dmin | d*sc * q - dmin*m |
| Q3_K | 256    | hmask[32], qs[64] 2-bit, scales[12] (16 6-bit, less 32), d | d*sc * (q - 4 unless the hmask bit) |
| Q4_K | 256    | d, dmin, scales[12] (8 6-bit scales and mins), qs[128] 4-bit | d*sc * q - dmin*m       |
| Q5_K | 256    | d, dmin, scales[12], qh[32], qs[128]                    | d*sc * q - dmin*m            |
| Q6_K | 256    | ql[128], qh[64], scales i8[16], d                       | d*sc * (q - 32)              |
| IQ4_NL | 32   | d, qs[16] as Q4_0                                       | d * IQ4_VALUES[q]            |
| IQ4_XS | 256  | d, scales_h u16, scales_l[4], qs[128]: 8 sub-blocks as IQ4_NL's | d*sc * IQ4_VALUES[q]  |
| TQ2_0 | 256   | qs[64] 2-bit as Q2_K's, d                               | d * (q - 1)                  |
| TQ1_0 | 256   | qs[48] (5 base-3 digits a byte), qh[4] (4 a byte), d     | d * (digit - 1)              |

K-quant blocks are 16 (Q2_K, Q3_K, Q6_K) or 8 (Q4_K, Q5_K, IQ4_XS) sub-blocks of one scale
each; IQ4_XS's 6-bit scales (less 32) are a nibble of scales_l and 2 bits of scales_h each. The
products are formed in the order ggml's own dequantizers form them (the scale times the
sub-block scale first), so each value is the f32 ggml computes. TQ1_0 stores base-3 digits
scaled to a byte: digit k of byte b is the top bits of 3 * (3^k b mod 256). Other types (Q8_1,
Q8_K, the lattice IQ types IQ1_S..IQ3_S, whose codebooks are tables of hundreds of entries, and
MXFP4) are refused by name before a device starts
(checkpoint/gguf_model.py: DEQUANTIZED_TYPES, which tests/model/test_ggml.py keeps equal to
DEQUANTIZERS' keys).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cakemp.checkpoint import resident
from cakemp.model.weights import int4

QK_K = 256
# IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml-common.h kvalues_iq4nl), indexed by a 4-bit code.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: uint8 [nbytes], a tensor's bytes as stored -> f32 `shape` (a view of `raw` for F32)."""
    if kind == "F32":
        return raw.view(torch.float32).view(shape)
    if kind in ("F16", "BF16"):
        return raw.view(torch.float16 if kind == "F16" else torch.bfloat16).float().view(shape)
    block_bytes, dequantize_blocks = DEQUANTIZERS[kind]
    return dequantize_blocks(raw.view(-1, block_bytes)).view(shape)


# Affine 4-bit codes in groups of 32 (Q4_K: the sub-blocks of its 256-value blocks): torch's int4 matmul takes them.
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_INT4_BLOCK = 32


def int4_group(kind: str, shape: tuple[int, ...]) -> int | str:
    """The group size torch's int4 matmul can take a tensor of `kind` and `shape` in, or why not."""
    if kind not in INT4_TYPES:
        return f"GGUF {kind} tensors (torch's int4 matmul takes {', '.join(INT4_TYPES)})"
    if len(shape) != 2:
        return f"GGUF {kind} tensors of shape {shape}"
    return resident.int4_unfit_reason(shape[0], shape[1], _INT4_BLOCK) or _INT4_BLOCK


def int4_parts(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> int4.Int4Parts:
    """A matrix of an INT4_TYPES type `int4_group` accepted, in torch's int4 convention, group by
    group of 32: Q4_0's d * (q - 8) is it with zero 0; Q4_1's d * q + m = (q - 8) * d + (m + 8 d);
    Q4_K's sub-block scale * q - min = (q - 8) * scale + (8 scale - min)."""
    rows, cols = shape
    groups = (rows, cols // _INT4_BLOCK)
    blocks = raw.view(-1, DEQUANTIZERS[kind][0])  # [rows * cols / values per block, block bytes]
    if kind == "Q4_K":
        scale, low, q = _q4_k_fields(blocks)
        scale, low = scale.reshape(groups), low.reshape(groups)
        return int4.Int4Parts(q.reshape(rows, cols), scale, 8 * scale - low, _INT4_BLOCK)
    d = _f16(blocks, 0).view(groups)
    zeros = torch.zeros_like(d) if kind == "Q4_0" else _f16(blocks, 2).view(groups) + 8 * d
    codes = _nibbles(blocks[:, 2 if kind == "Q4_0" else 4:]).view(rows, cols)
    return int4.Int4Parts(codes, d, zeros, _INT4_BLOCK)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's f16 at byte `at` -> f32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> the 32 4-bit codes [n, 32] of a 32-value block: low nibbles, then high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(packed: torch.Tensor, shifts: range | list[int]) -> torch.Tensor:
    """uint8 [n, G, W] -> [n, G, len(shifts), W]: each byte shifted right by each shift (unmasked)."""
    return packed.unsqueeze(2) >> torch.tensor(list(shifts), dtype=torch.uint8, device=packed.device).view(1, 1, -1, 1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's qh uint8 [n, 4], a little-endian u32 -> bit i of it for each value i, [n, 32]."""
    return (_bits(qh.unsqueeze(2), range(8)) & 1).view(-1, 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:]) | (_high_bits(blocks[:, 2:6]) << 4)
    return _f16(blocks, 0) * (q.float() - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 8:]) | (_high_bits(blocks[:, 4:8]) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, :16]  # sub-block s: scale in the low nibble, min in the high one
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    # Two halves of 128 values, each 32 bytes read at shifts 0, 2, 4, 6: sub-blocks of 16 in that order.
    q = (_bits(blocks[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 16, 16).float()
    scale = (d * (scales & 0x0F).float()).unsqueeze(2)
    low = (dmin * (scales >> 4).float()).unsqueeze(2)
    return (scale * q - low).reshape(n, QK_K)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes -> its 16 signed 6-bit sub-block scales (stored plus 32), f32 [n, 16]:
    the low 4 bits are the nibbles of bytes 0-7 (low nibbles first), the high 2 bits come from
    bytes 8-11 at shifts 0, 2, 4, 6."""
    n = packed.shape[0]
    low = _nibbles(packed[:, :8])  # [s]: byte s's low nibble (s < 8), byte s - 8's high one
    high = (_bits(packed[:, 8:12].reshape(n, 1, 4), [0, 2, 4, 6]) & 3).reshape(n, 16)
    return ((low | (high << 4)).to(torch.int16) - 32).float()


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])).unsqueeze(2)  # [n, 16, 1]
    low = (_bits(blocks[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 16, 16)
    # hmask: value 32 j + l has its high bit in bit j of byte l; a clear bit means minus 4.
    high = (_bits(blocks[:, :32].reshape(n, 1, 32), range(8)) & 1).reshape(n, 16, 16)
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
    q = (_bits(blocks[:, 16:].reshape(n, 4, 32), [0, 4]) & 0x0F).reshape(n, 8, 32)
    return _f16(blocks, 0) * sc, _f16(blocks, 2) * m, q


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc, m = _k4_scales(blocks[:, 4:16])
    scale, low = (_f16(blocks, 0) * sc).unsqueeze(2), (_f16(blocks, 2) * m).unsqueeze(2)
    ql = (_bits(blocks[:, 48:].reshape(n, 4, 32), [0, 4]) & 0x0F).reshape(n, 8, 32)
    qh = (_bits(blocks[:, 16:48].reshape(n, 1, 32), range(8)) & 1).reshape(n, 8, 32)  # sub-block s: bit s
    return (scale * (ql | (qh << 4)).float() - low).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale = (_f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(2)  # [n, 16, 1]
    # Two halves of 128 values: 64 ql bytes give 4 runs of 32 (low nibbles of bytes 0-31, of
    # 32-63, then their high nibbles), 32 qh bytes their top 2 bits at shifts 0, 2, 4, 6.
    ql = (_bits(blocks[:, :128].reshape(n, 2, 64), [0, 4]) & 0x0F).reshape(n, 8, 32)
    qh = (_bits(blocks[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return (scale * q).reshape(n, QK_K)


def _iq4_levels(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) -> IQ4_VALUES, f32."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _iq4_levels(_nibbles(blocks[:, 2:]))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 4:8]).view(n, 2, 4).transpose(1, 2).reshape(n, 8)  # sub-block j: byte j // 2, low nibble first
    high_word = blocks[:, 2:4].to(torch.int32)
    high = ((high_word[:, :1] | (high_word[:, 1:] << 8)) >> torch.arange(0, 16, 2, device=blocks.device)) & 3  # [n, 8]
    scale = (_f16(blocks, 0) * ((low.to(torch.int32) | (high << 4)) - 32).float()).unsqueeze(2)  # [n, 8, 1]
    codes = torch.cat([blocks[:, 8:].reshape(n, 8, 16) & 0x0F, blocks[:, 8:].reshape(n, 8, 16) >> 4], dim=2)
    return (scale * _iq4_levels(codes)).reshape(n, QK_K)


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    q = (_bits(blocks[:, :64].reshape(n, 2, 32), [0, 2, 4, 6]) & 3).reshape(n, QK_K)
    return _f16(blocks, 64) * (q.to(torch.int16) - 1).float()


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    """Bytes 0-31 give 5 digits each (values 0-159, digit-major), bytes 32-47 five each (160-239),
    the 4 qh bytes 4 each (240-255)."""
    n = blocks.shape[0]

    def digits(packed: torch.Tensor, count: int) -> torch.Tensor:  # [n, W] -> [n, count * W]
        powers = torch.tensor([3**k for k in range(count)], dtype=torch.int32, device=packed.device).view(1, -1, 1)
        return (((packed.to(torch.int32).unsqueeze(1) * powers) & 0xFF) * 3 >> 8).reshape(n, -1)

    q = torch.cat([digits(blocks[:, :32], 5), digits(blocks[:, 32:48], 5), digits(blocks[:, 48:52], 4)], dim=1)
    return _f16(blocks, 52) * (q - 1).float()


# type name -> (bytes of one block, its dequantizer: uint8 [n, bytes] -> f32 [n, values]).
DEQUANTIZERS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q5_0": (22, _q5_0), "Q5_1": (24, _q5_1),
    "Q2_K": (84, _q2_k), "Q3_K": (110, _q3_k), "Q4_K": (144, _q4_k), "Q5_K": (176, _q5_k), "Q6_K": (210, _q6_k),
    "IQ4_NL": (18, _iq4_nl), "IQ4_XS": (136, _iq4_xs), "TQ1_0": (54, _tq1_0), "TQ2_0": (66, _tq2_0),
}
