"""Prompts encoded off the event loop, and refused by their length in bytes where that alone proves them too long.

`Tokenizer.encode` of a 1 MiB text takes about a second and holds the GIL; `encode_batch([text])`
releases it, so `cakemp serve` encodes in threads and its event loop (streams, /health, the
other requests) runs on. Texts over `SHORT_BYTES` have a thread of their own, so a long prompt
waits behind other long prompts, never a short one behind it.

Before any encoding, a text with more bytes than the context's tokens can stand for is refused:
where each token stands for at most `per_token` bytes of input, a text of more than
`context × per_token` bytes has more tokens than the context holds. That holds only where the
tokenizer never drops input (`most_bytes_per_token` says which); elsewhere every text is encoded.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer, pre_tokenizers

from cakemp.errors import ConfigError

SHORT_BYTES = 64 << 10  # texts up to this are encoded in well under a tenth of a second
# Normalizers that never drop input; the most UTF-8 bytes one of them turns into one output byte
# (NFKC maps the 4-byte U+1D400 MATHEMATICAL BOLD CAPITAL A to "A"; composition joins at most 3 to 1).
KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"}
MOST_SHRINKING = 4
# Pre-tokenizers that split without removing anything (besides a Split that keeps what it matches).
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


class PromptTooLong(ConfigError):
    """A text whose bytes alone prove it has more tokens than the context holds."""

    def __init__(self, size: int, context_length: int) -> None:
        super().__init__(f"the prompt is {size} bytes, more than this model's context of {context_length} tokens "
                         f"can hold")


class PromptEncoder:
    """`tokenizer`'s encodings in threads, bounded first by the bytes `context_length` tokens can stand for."""

    def __init__(self, tokenizer: Tokenizer, context_length: int | None) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        per_token = most_bytes_per_token(tokenizer)
        self.most_bytes = None if per_token is None or context_length is None else context_length * per_token
        self._short = ThreadPoolExecutor(2, "encode-short")
        self._long = ThreadPoolExecutor(1, "encode-long")

    async def encode(self, text: str, size: int, add_special_tokens: bool) -> tuple[int, ...]:
        """`text`'s ids (`size`: its length in UTF-8 bytes); PromptTooLong when `size` proves it too long."""
        if self.most_bytes is not None and size > self.most_bytes:
            raise PromptTooLong(size, self.context_length)
        encode = functools.partial(self.tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)
        encodings = await asyncio.get_running_loop().run_in_executor(
            self._short if size <= SHORT_BYTES else self._long, encode)
        return tuple(encodings[0].ids)

    def close(self) -> None:
        self._short.shutdown(cancel_futures=True)
        self._long.shutdown(cancel_futures=True)


def most_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of input one token can stand for, or None where the tokenizer may drop input
    (an unknown token for a whole word, a normalizer or pre-tokenizer that removes characters)."""
    spec = json.loads(tokenizer.to_str())
    normalizer, pre_tokenizer, model = spec.get("normalizer"), spec.get("pre_tokenizer"), spec["model"]
    if model.get("type") != "BPE" or not _keeps(normalizer, KEEPING_NORMALIZERS) or \
            not _keeps(pre_tokenizer, KEEPING_PRE_TOKENIZERS):
        return None
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    byte_level = set(pre_tokenizers.ByteLevel.alphabet()) <= vocabulary.keys()
    byte_fallback = model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocabulary for b in range(256))
    if not (byte_level or byte_fallback):  # some input byte has no token: BPE drops it, or makes it unknown
        return None
    # A token's text is at least as long as what it stands for: a byte-level character per input byte,
    # "▁" (3 bytes) for a space, "<0x41>" for one byte.
    longest = max(len(token.encode("utf-8")) for token in vocabulary)
    return longest * (MOST_SHRINKING if normalizer else 1)


def _keeps(part: dict | None, keeping: set[str]) -> bool:
    """Whether a normalizer or pre-tokenizer (tokenizer.json's object) keeps every input character."""
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_keeps(p, keeping) for p in part.get("normalizers", part.get("pretokenizers", [])))
    if kind == "Replace":  # one character for a non-empty text (Llama's " " to "▁"), never a pattern
        return len(part.get("pattern", {}).get("String", "")) == 1 and bool(part.get("content"))
    if kind == "Split":
        return part.get("behavior") != "Removed"
    return kind in keeping
