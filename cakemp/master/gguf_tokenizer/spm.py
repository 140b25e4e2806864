"""`tokenizer.ggml.model llama`: SentencePiece's BPE (Llama 1/2, Mistral 7B, Gemma, Phi-3), as
llama.cpp's llm_tokenizer_spm runs it, built on `tokenizers`' BPE.

llama.cpp starts from a text's characters and merges, again and again, the adjacent pair whose
join is a token of the highest `tokenizer.ggml.scores`; a character that is no token falls back to
its UTF-8 bytes, the tokens `<0xXX>` (the unknown token, `tokenizer.ggml.unknown_token_id`, only
where one of those is missing). A BPE whose merges are every split of every token into two
tokens, ranked by the joined token's score, makes the same choices (transformers' converter
builds Llama's tokenizer.json the same way). Only where two different tokens have the very same
score can the order differ: llama.cpp takes the leftmost pair, this BPE the token listed first.

Before that, spaces become U+2581 and, with `tokenizer.ggml.add_space_prefix` (true where
absent), one is put first, at the start and again after each special token (a normalizer runs on
each stretch between them, as llama.cpp's fragments). Decoding undoes both.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers

from cakemp.master.gguf_tokenizer.vocab import Vocabulary, numbers

SPACE = "\u2581"


def spm_tokenizer(vocab: Vocabulary) -> Tokenizer:
    scores = _scores(vocab)
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    unknown = vocab.token_id("unknown_token_id", 0 if vocab.tokens else None)
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=_merges(vocab.tokens, scores, ids), fuse_unk=True,
                                     byte_fallback=True, unk_token=None if unknown is None else vocab.tokens[unknown]))
    space_prefix = vocab.flag("add_space_prefix", True)
    escape = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if space_prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    vocab.add_special_tokens(tokenizer)
    vocab.wrap(tokenizer, add_bos=True, bos_default=1 if len(vocab.tokens) > 1 else None)
    return tokenizer


def _scores(vocab: Vocabulary) -> list[float]:
    """tokenizer.ggml.scores, one number per token (0 each where absent, as llama.cpp reads it)."""
    value = numbers(vocab.gguf, "tokenizer.ggml.scores", len(vocab.tokens), integers=False)
    return [0.0] * len(vocab.tokens) if value is None else list(value)


def _merges(tokens: list[str], scores: list[float], ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) whose join is a token, both halves tokens, by the join's score (highest first)."""
    ranked = [(-scores[i], i, token[:cut], token[cut:]) for i, token in enumerate(tokens)
              for cut in range(1, len(token)) if token[:cut] in ids and token[cut:] in ids]
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]
