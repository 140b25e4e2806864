"""Llama 3's pre-tokenizer (`tokenizer.ggml.pre llama-bpe`) splits a run of digits into groups of up
to three from its start, as Llama 3's own tokenizer.json regex (\\p{N}{1,3}) does; tested on a
GGUF file's tokenizer without llama.cpp."""

from __future__ import annotations

from cakemp.checkpoint.gguf import GgufFile
from cakemp.master.gguf_tokenizer import gguf_tokenizer
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

pytestmark = needs_gguf

BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]
# Every digit run below is a token whole too: split into groups, the run is never seen whole.
RUNS = ["12", "123", "456", "78", "1234", "12345678", "9999999"]


def test_llama3_splits_digit_runs_into_groups_of_up_to_three(tmp_path):
    tokens = ["<|begin_of_text|>", *BYTES, *RUNS, "999"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": ["1 2"], "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
                "tokenizer.ggml.bos_token_id": 0}
    path = write_gguf(tmp_path / "llama3.gguf", GgufSpec("llama", layers=1, vocab=len(tokens),
                                                         global_metadata=metadata))
    tokenizer = gguf_tokenizer(GgufFile(path))

    def pieces(text: str) -> list[str]:
        return tokenizer.encode(text).tokens[1:]  # after the BOS llama-bpe adds

    assert pieces("12345678") == ["123", "456", "78"]
    assert pieces("1234") == ["123", "4"]
    assert pieces("12") == ["12"]
    assert pieces("9999999") == ["999", "999", "9"]
    assert pieces("a12345678") == ["a", "123", "456", "78"]
