"""Integer codes of 2 to 8 bits packed into 32-bit words, as GPTQ and MLX store them.

Both formats write one little-endian bit stream per row of words: code i occupies bits
[i * bits, (i + 1) * bits) of the row, counted from bit 0 of word 0. For 2, 4 and 8 bits a
code never crosses a word (word j holds codes 32/bits * j ..); for 3, 5 and 6 bits some do,
and their low bits end one word, their high bits start the next (GPTQ's 3-bit layout, 32
codes in 3 words, is the same stream).
"""

from __future__ import annotations

import torch

_WORD = 32
_LOW_32 = (1 << 32) - 1
# Codes unpacked per step: bounds the int64 temporaries (8 bytes a code) to ~128 MiB.
_CODES_PER_STEP = 16 << 20


def unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """words: [rows, W] 32-bit words (`as_unsigned`) -> [rows, count] int32 codes, the first `count` of each
    row's stream (count <= W * 32 / bits; a stream may end in unused padding)."""
    rows, width = words.shape
    if count * bits > width * _WORD:
        raise ValueError(f"{width} words of {_WORD} bits hold fewer than {count} codes of {bits} bits")
    offsets = torch.arange(count, device=words.device) * bits
    first, shift = offsets // _WORD, offsets % _WORD
    mask = (1 << bits) - 1
    out = torch.empty(rows, count, dtype=torch.int32, device=words.device)
    step = max(1, _CODES_PER_STEP // max(count, 1))
    for start in range(0, rows, step):
        block = as_unsigned(words[start : start + step])  # [r, W] int64 in 0 .. 2^32 - 1
        # Each word with its successor above it, so a code crossing into the next word is whole.
        pairs = block | (torch.cat([block[:, 1:], torch.zeros_like(block[:, :1])], dim=1) << _WORD)
        out[start : start + step] = ((pairs[:, first] >> shift) & mask).to(torch.int32)
    return out


def as_unsigned(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (int32, uint32, or int64 already in 0 .. 2^32 - 1) as int64 values in 0 .. 2^32 - 1."""
    if words.dtype == torch.int32:
        return words.to(torch.int64) & _LOW_32
    if words.dtype in (torch.uint32, torch.int64):
        return words.to(torch.int64)
    raise ValueError(f"packed codes are stored as {words.dtype}, not 32-bit words")


def add_to_each(words: torch.Tensor, bits: int, value: int) -> torch.Tensor:
    """Add `value` to every `bits`-bit field of each word (32 % bits == 0) as one 32-bit integer
    addition: a field that overflows carries into the next one, and the top field's carry is
    lost, as in GPTQModel's v1-to-v2 zero-point conversion. -> int64 words in 0 .. 2^32 - 1."""
    per_field = sum(value << shift for shift in range(0, _WORD, bits))
    return (as_unsigned(words) + per_field) & _LOW_32
