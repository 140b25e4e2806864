"""cakemp's GGUF tokenizers (cakemp/master/gguf_tokenizer) against llama.cpp's own, through
llama-cpp-python (`Llama(path, vocab_only=True).tokenize`): the same ids for every
`tokenizer.ggml.pre` llama.cpp names, and for SentencePiece files, and decoding gives the text back.

Each file is written by gguf-py's GGUFWriter from a vocabulary `tokenizers`' trainers learn here
from a small corpus (byte-level BPE; SentencePiece-style BPE whose scores rank its pieces), with
a CONTROL, a USER_DEFINED and a BOS token. The texts exercise the regexes: contractions, digit
runs, CJK, Hangul, whitespace runs and newlines, emoji, case changes, and special tokens.
Skipped without llama-cpp-python (the `llama-oracle` extra) or gguf.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cakemp.checkpoint.gguf import GgufFile
from cakemp.master.gguf_tokenizer import gguf_tokenizer
from cakemp.master.gguf_tokenizer.bpe_splits import PRE_TOKENIZERS
from cakemp.master.gguf_tokenizer.vocab import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

pytestmark = needs_gguf
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llama-oracle extra) is not installed")

BOS, EOT, USER = "<|bos|>", "<|eot|>", "<|user|>"
TEXTS = [
    "Hello World! It's 2024; we'd've THEY'RE I'M you'll 12345678 apples, 3.14159 and 1,000,000.",
    "  leading spaces,\ttabs\t\tand   runs   \n\n\nnewlines\r\n  indented\n    deeper   ",
    "日本語のテキスト、中文字符。 한국어 텍스트 Ελληνικά Кириллица",
    "emoji 😀🎉👍🏽 and symbols ©®™ ∑∫≈ <tag> {code: [1, 2]} x==y && z!=w",
    f"camelCaseWords HTTPServer getX {EOT}after the end{USER}the user {EOT}{EOT}",
    "<sentinel:12> IMGIMGABZ  ßẞ naïve café… ¿Qué? «quotes» 'single' \"double\"",
]
CORPUS = TEXTS * 3 + ["the quick brown fox jumps over the lazy dog 0123456789 " * 4, "日本語 中文 한국어 " * 4]


def _write(path, metadata: dict) -> str:
    """A one-layer Llama file (llama.cpp reads its hyperparameters even for the vocabulary alone)."""
    spec = GgufSpec("llama", hidden=32, ffn=32, layers=1, heads=2, kv_heads=1,
                    vocab=len(metadata["tokenizer.ggml.tokens"]), global_metadata=metadata)
    return str(write_gguf(path, spec))


@pytest.fixture(scope="module")
def byte_level() -> dict:
    """A byte-level BPE's metadata (tokens in GPT-2's byte alphabet, merges in rank order)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=[BOS, EOT, USER], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [{EOT: CONTROL, BOS: CONTROL, USER: USER_DEFINED}.get(t, NORMAL) for t in tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": tokens.index(BOS),
            "tokenizer.ggml.eos_token_id": tokens.index(EOT)}


@pytest.fixture(scope="module")
def sentencepiece() -> dict:
    """A SentencePiece BPE's metadata: <unk> <s> </s>, the 256 byte tokens, then pieces scored by rank.
    The corpus has no emoji, so they take the byte fallback."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, special_tokens=[])
    tokenizer.train_from_iterator([t for t in CORPUS if "😀" not in t], trainer)
    pieces = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    head = ["<unk>", "<s>", "</s>", EOT, USER] + [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + [p for p in pieces if p not in head]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, USER_DEFINED] + [BYTE] * 256 + [NORMAL] * (len(tokens) - len(head))
    scores = [0.0] * len(head) + [-float(i) for i in range(len(tokens) - len(head))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def _same_as_llama_cpp(path: str, texts: list[str], round_trip: bool = True) -> None:
    theirs = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    ours = gguf_tokenizer(GgufFile(path))
    for text in texts:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special).ids
            assert ids == theirs.tokenize(text.encode(), add_bos=add_special, special=True), (text, add_special)
        if round_trip:
            assert ours.decode(ours.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_byte_level_bpe_ids_are_llama_cpps(tmp_path, byte_level, pre):
    _same_as_llama_cpp(_write(tmp_path / f"{pre}.gguf", {**byte_level, "tokenizer.ggml.pre": pre}), TEXTS)


@pytest.mark.parametrize("switches", [{}, {"tokenizer.ggml.add_bos_token": False},
                                      {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}])
def test_a_files_add_bos_and_add_eos_are_llama_cpps(tmp_path, byte_level, switches):
    for pre in ("llama-bpe", "qwen2"):  # BOS by default, and not
        _same_as_llama_cpp(_write(tmp_path / f"{pre}.gguf", {**byte_level, "tokenizer.ggml.pre": pre, **switches}),
                           TEXTS)


@pytest.mark.parametrize("switches", [{}, {"tokenizer.ggml.add_space_prefix": False},
                                      {"tokenizer.ggml.add_bos_token": False}])
def test_sentencepiece_ids_are_llama_cpps(tmp_path, sentencepiece, switches):
    path = _write(tmp_path / "spm.gguf", {**sentencepiece, **switches})
    # A special token puts a space before the text after it (llama.cpp's fragments): no round trip.
    _same_as_llama_cpp(path, [t for t in TEXTS if EOT not in t])
    _same_as_llama_cpp(path, [t for t in TEXTS if EOT in t], round_trip=False)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_a_word_that_is_a_token_is_that_token_where_llama_cpp_ignores_merges(tmp_path, pre):
    """"abc" is a token, but merging by rank gives a|bc: llama-bpe (ignore_merges) takes the token whole,
    qwen2 merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet) + ["bc", "ab", "abc"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": ["b c", "a b", "ab c"], "tokenizer.ggml.add_bos_token": False}
    path = _write(tmp_path / f"{pre}.gguf", metadata)
    _same_as_llama_cpp(path, ["abc", "xabc abc"])
    whole = gguf_tokenizer(GgufFile(path)).encode("abc").ids == [tokens.index("abc")]
    assert whole == (pre == "llama-bpe")
