"""A GGUF tokenizer with more tokens than any real model's is refused by name before it is built (a
valid file of millions of entries took minutes to build)."""

from __future__ import annotations

import time

import pytest

from cakemp.checkpoint.gguf import GgufFile
from cakemp.errors import CheckpointError
from cakemp.master.gguf_tokenizer import gguf_tokenizer
from cakemp.master.gguf_tokenizer.vocab import MAX_ENTRIES
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

pytestmark = needs_gguf


def test_a_vocabulary_past_the_largest_real_ones_is_refused_by_name(tmp_path):
    count = MAX_ENTRIES + 1
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                "tokenizer.ggml.tokens": [f"t{i}" for i in range(count)], "tokenizer.ggml.merges": ["t 0"]}
    path = write_gguf(tmp_path / "huge.gguf", GgufSpec("llama", layers=1, vocab=count, global_metadata=metadata))
    started = time.perf_counter()
    with pytest.raises(CheckpointError) as caught:
        gguf_tokenizer(GgufFile(path))
    print(f"{count} tokens refused in {time.perf_counter() - started:.2f} s")
    assert f"tokenizer.ggml.tokens holds {count} entries, more than the {MAX_ENTRIES}" in str(caught.value)
