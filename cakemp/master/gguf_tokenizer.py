"""The tokenizer a GGUF file describes in its metadata, for the master (`cakemp generate --model x.gguf`).

Only `tokenizer.ggml.model == "gpt2"` is built: byte-level BPE (Qwen2/2.5/3, Llama 3), from
`tokenizer.ggml.tokens` (each token spelled in GPT-2's byte alphabet, id = position) and
`tokenizer.ggml.merges` ("a b" each, in rank order). The text is split before BPE by the regex
of `tokenizer.ggml.pre`, the pre-tokenizer llama.cpp names (the patterns are those tokenizers'
own, as their tokenizer.json files carry them); an unknown name is refused rather than split
wrongly. Tokens typed CONTROL (3) are special, USER_DEFINED (4) added, both matched whole.
`tokenizer.ggml.add_bos_token` puts the BOS token first, as llama.cpp does. SentencePiece
("llama") and other tokenizer models are refused by name. The chat template is the file's
`tokenizer.chat_template`, rendered with its BOS and EOS tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from cakemp.checkpoint.gguf import GgufFile, StringArray
from cakemp.errors import CheckpointError
from cakemp.master.chat import ChatTemplate

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex (None: GPT-2's own, which ByteLevel applies).
SPLITS = {"default": None, "gpt2": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(gguf: GgufFile) -> Tokenizer:
    """The file's tokenizer; CheckpointError naming what is missing or not supported."""
    meta = gguf.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported "
                              "(only gpt2, byte-level BPE)")
    tokens = _strings(gguf, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in _strings(gguf, "tokenizer.ggml.merges")]
    if any(len(merge) != 2 for merge in merges):
        raise CheckpointError(f"{gguf.path}: a tokenizer.ggml.merges entry is not two tokens")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.pre {pre!r} is not supported "
                              f"(only {', '.join(SPLITS)})")
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False))
    split = SPLITS[pre]
    tokenizer.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                               pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)]))
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    if meta.get("tokenizer.ggml.add_bos_token", False):
        bos = _token_id(gguf, "tokenizer.ggml.bos_token_id", len(tokens))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return tokenizer


def gguf_eos_ids(gguf: GgufFile) -> frozenset[int]:
    """The ids that end a generation: tokenizer.ggml.eos_token_id (and eot_token_id, llama.cpp's end of turn)."""
    count = len(gguf.metadata.get("tokenizer.ggml.tokens") or [])
    return frozenset(_token_id(gguf, key, count) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                     if key in gguf.metadata)


def gguf_chat_template(gguf: GgufFile, tokenizer: Tokenizer) -> ChatTemplate | None:
    """`tokenizer.chat_template` (llama.cpp's copy of the model's template), with the file's BOS and
    EOS tokens as the template's bos_token and eos_token; None for a file without one."""
    source = gguf.metadata.get("tokenizer.chat_template")
    if source is None:
        return None
    if not isinstance(source, str):
        raise CheckpointError(f"{gguf.path}: GGUF metadata tokenizer.chat_template is not a string")
    tokens = _strings(gguf, "tokenizer.ggml.tokens")
    special = {name: tokens[_token_id(gguf, f"tokenizer.ggml.{name}_id", len(tokens))]
               for name in ("bos_token", "eos_token") if f"tokenizer.ggml.{name}_id" in gguf.metadata}
    return ChatTemplate(source, special, tokenizer)


def _strings(gguf: GgufFile, key: str) -> StringArray:
    value: Any = gguf.metadata.get(key)
    if not isinstance(value, StringArray):
        raise CheckpointError(f"{gguf.path}: GGUF metadata {key} is not a list of strings")
    return value


def _token_id(gguf: GgufFile, key: str, count: int) -> int:
    value = gguf.metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise CheckpointError(f"{gguf.path}: GGUF metadata {key} {value!r} is not a token id (0..{count - 1})")
    return value
