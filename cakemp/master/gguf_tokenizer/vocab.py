"""A GGUF file's vocabulary as every tokenizer model reads it: the token strings, their types and
scores, the special ids, and what llama.cpp puts around a text (BOS, EOS).

Each key is checked as llama.cpp's loader reads it, and a wrong one is a one-line CheckpointError
naming the file and the key, never an exception from inside `tokenizers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from cakemp.checkpoint.gguf import GgufFile, NumberArray, StringArray
from cakemp.errors import CheckpointError

# The most tokens, or merges, a tokenizer may have: twice the largest vocabularies real models use
# (Gemma's 262,144 tokens; a byte-level BPE has about as many merges). A file past it is refused by
# name before anything is built: building a tokenizer costs some microseconds an entry, so a valid
# file of millions of entries would hold `cakemp generate`/`serve` at start for minutes.
MAX_ENTRIES = 1 << 19

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Vocabulary:
    """tokenizer.ggml.tokens (id = position) and tokenizer.ggml.token_type (NORMAL where absent)."""

    gguf: GgufFile
    tokens: list[str]
    types: list[int]

    @classmethod
    def read(cls, gguf: GgufFile) -> Vocabulary:
        tokens = list(strings(gguf, "tokenizer.ggml.tokens"))  # decoded once: every builder walks them
        seen: set[str] = set()
        for token in tokens:
            if token in seen:  # llama.cpp asserts every token is distinct
                raise CheckpointError(f"{gguf.path}: GGUF metadata tokenizer.ggml.tokens holds {token!r} twice")
            seen.add(token)
        types = numbers(gguf, "tokenizer.ggml.token_type", len(tokens), integers=True)
        return cls(gguf, tokens, [NORMAL] * len(tokens) if types is None else list(types))

    def token_id(self, key: str, default: int | None = None) -> int | None:
        """The id under tokenizer.ggml.KEY (`default` where absent); CheckpointError if it is not one."""
        return token_id(self.gguf, f"tokenizer.ggml.{key}", len(self.tokens), default)

    def flag(self, key: str, default: bool) -> bool:
        value = self.gguf.metadata.get(f"tokenizer.ggml.{key}", default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.gguf.path}: GGUF metadata tokenizer.ggml.{key} {value!r} is not a bool")
        return value

    def add_special_tokens(self, tokenizer: Tokenizer) -> None:
        """CONTROL and UNKNOWN tokens special, USER_DEFINED ones added: all matched whole in a text, as
        llama.cpp's tokenize(parse_special=true) partitions them out before its tokenizer model runs."""
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t, kind in zip(self.tokens, self.types) if kind in (CONTROL, UNKNOWN)])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t, kind in zip(self.tokens, self.types) if kind == USER_DEFINED])

    def wrap(self, tokenizer: Tokenizer, add_bos: bool, bos_default: int | None) -> None:
        """BOS first and EOS last where the file (or the model's default, `add_bos`) asks for them
        (tokenizer.ggml.add_bos_token, add_eos_token), as llama.cpp's tokenize(add_special=true)."""
        bos = self._added("bos", add_bos, bos_default)
        eos = self._added("eos", False, None)
        if bos is None and eos is None:
            return
        head = [] if bos is None else [self.tokens[bos]]
        tail = [] if eos is None else [self.tokens[eos]]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join([*head, "$A", *tail]), pair=" ".join([*head, "$A", "$B", *tail]),
            special_tokens=[(self.tokens[i], i) for i in {bos, eos} - {None}])

    def _added(self, name: str, add: bool, default: int | None) -> int | None:
        """The id of the BOS or EOS token put around every text, or None where none is."""
        if not self.flag(f"add_{name}_token", add):
            return None
        found = self.token_id(f"{name}_token_id", default)
        if found is None:
            raise CheckpointError(f"{self.gguf.path}: GGUF metadata tokenizer.ggml.add_{name}_token is set, "
                                  f"but tokenizer.ggml.{name}_token_id is missing")
        return found


def strings(gguf: GgufFile, key: str) -> StringArray:
    value: Any = gguf.metadata.get(key)
    if not isinstance(value, StringArray):
        raise CheckpointError(f"{gguf.path}: GGUF metadata {key} is not a list of strings")
    if len(value) > MAX_ENTRIES:
        raise CheckpointError(f"{gguf.path}: GGUF metadata {key} holds {len(value)} entries, more than the "
                              f"{MAX_ENTRIES} of any tokenizer cakemp builds (real models' hold at most about 262,144)")
    return value


def numbers(gguf: GgufFile, key: str, count: int, integers: bool) -> NumberArray | None:
    """Metadata `key`: an array of `count` numbers (integers, where `integers`), or None where absent."""
    value: Any = gguf.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, NumberArray) or len(value) != count or (integers and value.typecode in "fd"):
        raise CheckpointError(f"{gguf.path}: GGUF metadata {key} is not one {'integer' if integers else 'number'} "
                              f"per token ({count})")
    return value


def token_id(gguf: GgufFile, key: str, count: int, default: int | None = None) -> int | None:
    value = gguf.metadata.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise CheckpointError(f"{gguf.path}: GGUF metadata {key} {value!r} is not a token id (0..{count - 1})")
    return value
