"""`tokenizer.ggml.model gpt2`: byte-level BPE (Llama 3, Qwen2/2.5/3, Mistral's Tekken, DeepSeek,
GPT-4o-style and ~40 other pre-tokenizers), built on `tokenizers`' BPE.

The tokens are spelled in GPT-2's byte alphabet, id = position; `tokenizer.ggml.merges` ("a b"
each, in rank order) are BPE's merges. The text is split first by the regexes of
`tokenizer.ggml.pre` (bpe_splits.py), then mapped to the byte alphabet.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from cakemp.errors import CheckpointError
from cakemp.master.gguf_tokenizer.bpe_splits import FAMILIES, PRE_TOKENIZERS, REFUSED
from cakemp.master.gguf_tokenizer.vocab import Vocabulary, strings


def bpe_tokenizer(vocab: Vocabulary) -> Tokenizer:
    gguf = vocab.gguf
    pre = gguf.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        why = "llama.cpp splits it with code of its own" if pre in REFUSED else "llama.cpp does not know it"
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.pre {pre!r} is not supported ({why})")
    split = PRE_TOKENIZERS[pre]
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=_merges(vocab, ids), fuse_unk=False,
                                     ignore_merges=split.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in FAMILIES[split.family]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    vocab.add_special_tokens(tokenizer)
    vocab.wrap(tokenizer, split.add_bos, bos_default=None)
    return tokenizer


def _merges(vocab: Vocabulary, ids: dict[str, int]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as pairs, each half and their join a token (else a CheckpointError naming the entry)."""
    merges = []
    for rank, merge in enumerate(strings(vocab.gguf, "tokenizer.ggml.merges")):
        # llama.cpp cuts at the first space after the first character: a merge may start with one.
        cut = merge.find(" ", 1)
        pair = (merge[:cut], merge[cut + 1:]) if cut > 0 else None
        unknown = "not two tokens" if pair is None else next(
            (f"{t!r} is not in tokenizer.ggml.tokens" for t in (*pair, pair[0] + pair[1]) if t not in ids), None)
        if unknown is not None:
            raise CheckpointError(f"{vocab.gguf.path}: GGUF metadata tokenizer.ggml.merges entry {rank} "
                                  f"{merge!r}: {unknown}")
        merges.append(pair)
    return merges
