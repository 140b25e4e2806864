"""A malformed tokenizer in a GGUF file's metadata is a one-line CheckpointError naming the file and
the key, from cakemp/master/gguf_tokenizer and from `cakemp generate` (exit 78): never an
exception from inside `tokenizers` (a merge naming an unknown token, say)."""

from __future__ import annotations

import pytest

from cakemp.checkpoint.gguf import GgufFile
from cakemp.errors import CheckpointError
from cakemp.master.gguf_tokenizer import gguf_tokenizer
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf
from tests.test_cli import EX_CONFIG, cakemp

pytestmark = needs_gguf

BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ"]
GOOD = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": [*BYTES, "th", "the"],
        "tokenizer.ggml.merges": ["t h", "th e"]}
SPM = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "b", "ab"],
       "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0]}
MALFORMED = [
    ({**GOOD, "tokenizer.ggml.merges": ["t h", "zz e"]}, "tokenizer.ggml.merges entry 1 'zz e': 'zz' is not in"),
    ({**GOOD, "tokenizer.ggml.merges": ["t h", "h e"]}, "tokenizer.ggml.merges entry 1 'h e': 'he' is not in"),
    ({**GOOD, "tokenizer.ggml.merges": ["the"]}, "tokenizer.ggml.merges entry 0 'the': not two tokens"),
    ({**GOOD, "tokenizer.ggml.tokens": [*BYTES, "th", "th"]}, "tokenizer.ggml.tokens holds 'th' twice"),
    ({**GOOD, "tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type is not one integer per token"),
    ({**GOOD, "tokenizer.ggml.add_bos_token": True}, "add_bos_token is set, but tokenizer.ggml.bos_token_id is"),
    ({**GOOD, "tokenizer.ggml.bos_token_id": 10**6, "tokenizer.ggml.add_bos_token": True},
     "tokenizer.ggml.bos_token_id 1000000 is not a token id"),
    ({**GOOD, "tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token 'yes' is not a bool"),
    ({**SPM, "tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores is not one number per token"),
    ({**SPM, "tokenizer.ggml.unknown_token_id": 99}, "tokenizer.ggml.unknown_token_id 99 is not a token id"),
]


@pytest.mark.parametrize(("metadata", "says"), MALFORMED, ids=[says.split()[0] for _, says in MALFORMED])
def test_a_malformed_tokenizer_is_one_line_naming_the_file_and_the_key(tmp_path, metadata, says):
    path = write_gguf(tmp_path / "bad.gguf", GgufSpec("llama", layers=1, global_metadata=metadata))
    with pytest.raises(CheckpointError) as caught:
        gguf_tokenizer(GgufFile(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message


def test_cakemp_generate_over_a_merge_naming_an_unknown_token_exits_78_with_one_line(tmp_path):
    metadata = {**GOOD, "tokenizer.ggml.merges": ["t h", "zz e"]}
    path = write_gguf(tmp_path / "bad.gguf", GgufSpec("llama", layers=1, vocab=len(BYTES) + 2,
                                                      global_metadata=metadata))
    result = cakemp("generate", "--model", str(path), "--prompt", "the", "--max-tokens", "1")
    assert result.returncode == EX_CONFIG, result.stderr
    assert result.stderr == f"cakemp: error: {path}: GGUF metadata tokenizer.ggml.merges entry 1 'zz e': " \
                            "'zz' is not in tokenizer.ggml.tokens\n"
