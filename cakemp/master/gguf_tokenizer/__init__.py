"""The tokenizer a GGUF file describes in its metadata, for the master (`cakemp generate --model x.gguf`):
the ids llama.cpp's own tokenizer gives for the same file and text.

- `tokenizer.ggml.model gpt2`: byte-level BPE, split first by the regexes of `tokenizer.ggml.pre`
  (bpe.py, bpe_splits.py);
- `llama`: SentencePiece BPE, with its scores, byte fallback and add_space_prefix (spm.py);
- any other is refused by name: `bert` (WordPiece) and `t5` (Unigram) are encoders' tokenizers,
  `rwkv`, `plamo2`, `gemma4` and `hybriddna` those of other models, none of which cakemp serves.

Each is built on `tokenizers` directly, from tables of this package. transformers' GGUF
converter (transformers.integrations.ggml) is not used: transformers is no dependency of the
master, and its converter knows a handful of pre-tokenizers where llama.cpp knows ~90 names.
vocab.py reads what every model shares: the token types (CONTROL, UNKNOWN and USER_DEFINED
tokens matched whole, as llama.cpp's tokenize with parse_special), BOS and EOS around a text,
and checks each key, a wrong one being a one-line CheckpointError naming the file and the key.
The chat template is the file's `tokenizer.chat_template`, rendered with its BOS and EOS tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from cakemp.checkpoint.gguf import GgufFile
from cakemp.errors import CheckpointError
from cakemp.master.chat import ChatTemplate
from cakemp.master.gguf_tokenizer.bpe import bpe_tokenizer
from cakemp.master.gguf_tokenizer.spm import spm_tokenizer
from cakemp.master.gguf_tokenizer.vocab import Vocabulary, strings, token_id

BUILDERS = {"gpt2": bpe_tokenizer, "llama": spm_tokenizer}


def gguf_tokenizer(gguf: GgufFile) -> Tokenizer:
    """The file's tokenizer; CheckpointError naming what is missing, malformed or not supported."""
    kind = gguf.metadata.get("tokenizer.ggml.model")
    if kind not in BUILDERS:
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.model {kind!r} is not supported "
                              f"(only {', '.join(BUILDERS)}: the tokenizers of the text models cakemp serves)")
    return BUILDERS[kind](Vocabulary.read(gguf))


def gguf_eos_ids(gguf: GgufFile) -> frozenset[int]:
    """The ids that end a generation: tokenizer.ggml.eos_token_id (and eot_token_id, llama.cpp's end of turn)."""
    count = len(gguf.metadata.get("tokenizer.ggml.tokens") or [])
    return frozenset(token_id(gguf, key, count) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                     if key in gguf.metadata)


def gguf_chat_template(gguf: GgufFile, tokenizer: Tokenizer) -> ChatTemplate | None:
    """`tokenizer.chat_template` (llama.cpp's copy of the model's template), with the file's BOS and
    EOS tokens as the template's bos_token and eos_token; None for a file without one."""
    source = gguf.metadata.get("tokenizer.chat_template")
    if source is None:
        return None
    if not isinstance(source, str):
        raise CheckpointError(f"{gguf.path}: GGUF metadata tokenizer.chat_template is not a string")
    tokens = strings(gguf, "tokenizer.ggml.tokens")
    special = {name: tokens[token_id(gguf, f"tokenizer.ggml.{name}_id", len(tokens))]
               for name in ("bos_token", "eos_token") if f"tokenizer.ggml.{name}_id" in gguf.metadata}
    return ChatTemplate(source, special, tokenizer)
