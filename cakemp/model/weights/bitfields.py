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


def unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """words: [rows, W] 32-bit words (`as_unsigned`) -> [rows, count] int32 codes, the first `count`
    of each row's stream (count <= W * 32 / bits; a stream may end in unused padding). Callers
    pass a few rows at a time: the temporaries are 2 (8 for 3, 5, 6 bits) times the codes' bytes."""
    rows, width = words.shape
    if count * bits > width * _WORD:
        raise ValueError(f"{width} words of {_WORD} bits hold fewer than {count} codes of {bits} bits")
    mask = (1 << bits) - 1
    if _WORD % bits == 0:
        # No code crosses a word: each word shifted by each field's offset, in int32 (the sign
        # bits an arithmetic shift brings in are masked off).
        shifts = torch.arange(0, _WORD, bits, dtype=torch.int32, device=words.device)
        fields = (_as_int32(words)[:, :, None] >> shifts).bitwise_and_(mask)  # [rows, W, 32 / bits]
        return fields.view(rows, -1)[:, :count]
    offsets = torch.arange(count, device=words.device) * bits
    first, shift = offsets // _WORD, offsets % _WORD
    block = as_unsigned(words)  # [rows, W] int64 in 0 .. 2^32 - 1
    # Each word with its successor above it, so a code crossing into the next word is whole.
    pairs = block | (torch.cat([block[:, 1:], torch.zeros_like(block[:, :1])], dim=1) << _WORD)
    return ((pairs[:, first] >> shift) & mask).to(torch.int32)


def as_unsigned(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (int32, uint32, or int64 already in 0 .. 2^32 - 1) as int64 values in 0 .. 2^32 - 1."""
    if words.dtype == torch.int32:
        return words.to(torch.int64) & _LOW_32
    if words.dtype in (torch.uint32, torch.int64):
        return words.to(torch.int64)
    raise ValueError(f"packed codes are stored as {words.dtype}, not 32-bit words")


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (`as_unsigned`'s kinds) as int32 with the same bits."""
    if words.dtype == torch.int32:
        return words
    if words.dtype == torch.uint32:
        return words.view(torch.int32)
    unsigned = as_unsigned(words)
    return torch.where(unsigned >= 1 << 31, unsigned - (1 << 32), unsigned).to(torch.int32)


def add_to_each(words: torch.Tensor, bits: int, value: int) -> torch.Tensor:
    """Add `value` to every `bits`-bit field of each word (32 % bits == 0) as one 32-bit integer
    addition: a field that overflows carries into the next one, and the top field's carry is
    lost, as in GPTQModel's v1-to-v2 zero-point conversion. -> int64 words in 0 .. 2^32 - 1."""
    per_field = sum(value << shift for shift in range(0, _WORD, bits))
    return (as_unsigned(words) + per_field) & _LOW_32
