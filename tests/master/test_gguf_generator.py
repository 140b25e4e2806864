"""The Python master over a GGUF file (`cakemp generate --model x.gguf`) against transformers'
own GGUF loading of the same file: its tokenizer (AutoTokenizer with gguf_file=) and its model
(AutoModelForCausalLM with gguf_file=, greedy `generate`).

The file (tests/support/gguf_files.py, written by gguf-py) is a tiny Llama with q/k rows in llama.cpp's
permuted order and a byte-level BPE tokenizer in its metadata: GPT-2's 256 byte tokens, 13
merges, <|endoftext|> as a CONTROL token and the EOS, Qwen2's split regex (tokenizer.ggml.pre
"qwen2"), and a chat template (tokenizer.chat_template). The master keeps embeddings, final norm
and head from the file; all layers local (also for the same model with tied embeddings: no
output.weight, whose random greedy text repeats one token, but must be HF's token), then layers
1-2 on a live node serving the same file.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from click.testing import CliRunner

from cakemp.checkpoint.gguf import GgufFile
from cakemp.cli import cli
from cakemp.demo.local_node import LocalNode, free_port
from cakemp.errors import CheckpointError
from cakemp.master.generator import Generator
from cakemp.master.gguf_tokenizer import gguf_chat_template, gguf_eos_ids, gguf_tokenizer
from cakemp.master.sampler import SamplingParams
from cakemp.topology import Topology
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf
from tests.support.node import LoggedProcess

pytestmark = needs_gguf
transformers = pytest.importorskip("transformers")

MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "o n", "e r", "Ġ u", "Ġu p", "t i", "m e", "ti me", "Ġ ti"]
EOS = "<|endoftext|>"
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
PROMPT = "Once upon a time"
STEPS = 12
# A ChatML-like template that also uses the file's eos_token (and bos_token, when the caller has one).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}")
TEXTS = ["Once upon a time", f"the time is up{EOS}in 12345 words\n\n  x", "héllo wörld — it's 3.14!", "    "]


def _tokenizer_metadata() -> dict[str, object]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES] + [EOS]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
            "tokenizer.ggml.eos_token_id": len(tokens) - 1, "tokenizer.ggml.bos_token_id": len(tokens) - 1,
            "tokenizer.chat_template": TEMPLATE}


def _write(directory, tied: bool):
    metadata = _tokenizer_metadata()
    spec = GgufSpec("llama", vocab=len(metadata["tokenizer.ggml.tokens"]), tied=tied, global_metadata=metadata,
                    types={"attn_q": "Q4_0", "attn_k": "Q5_1", "token_embd": "Q8_0", "output": "Q4_1"})
    return write_gguf(directory / "tiny-llama.gguf", spec)


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gguf"), tied=False)


@pytest.fixture(scope="module")
def hf(path):
    return _hf(path)


def hf_greedy(model, prompt_tokens, steps):
    ids = torch.tensor([list(prompt_tokens)])
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, attention_mask=torch.ones_like(ids),
                         eos_token_id=None, pad_token_id=0)
    return tuple(out[0, ids.shape[1]:].tolist())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def generate(path, topology):
    async def go():
        async with await Generator.open(path, topology, dtype="f32") as generator:
            return await generator.generate(PROMPT, STEPS, GREEDY)

    return run(go())


def test_the_tokenizer_is_transformers_reading_of_the_file(path, hf):
    _, theirs = hf
    ours = gguf_tokenizer(GgufFile(path))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids) == text
    assert gguf_eos_ids(GgufFile(path)) == {theirs.convert_tokens_to_ids(EOS)}


def test_the_chat_template_renders_as_transformers_renders_it(path, hf):
    _, theirs = hf
    file = GgufFile(path)
    chat = gguf_chat_template(file, gguf_tokenizer(file))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the time?"}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.render(messages) == expected
    assert chat.encode(messages) == theirs.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("tied", [False, True])
def test_all_local_greedy_equals_transformers_generate(tmp_path, tied):
    path = _write(tmp_path, tied)
    model, _ = _hf(path)
    generation = generate(path, Topology(()))
    expected = hf_greedy(model, generation.prompt_tokens, STEPS)
    assert generation.tokens == expected[: len(generation.tokens)]


def test_cakemp_generate_through_a_node_serving_the_file_prints_transformers_greedy_text(path, hf, tmp_path):
    model, theirs = hf
    port = free_port()
    topology = tmp_path / "topology.yml"
    topology.write_text(f"node0:\n  host: 127.0.0.1:{port}\n  layers: [model.layers.1-2]\n")
    node = LocalNode(name="node0", model_dir=path, topology=topology, port=port, gpus="cpu", dtype="f32",
                     log_path=tmp_path / "node.log")
    node.start()
    try:
        run(node.wait_ready())
        result = CliRunner().invoke(cli, [
            "generate", "--model", str(path), "--topology", str(topology), "--prompt", PROMPT,
            "--max-tokens", str(STEPS), "--temperature", "0", "--repeat-penalty", "1", "--dtype", "f32", "--raw",
        ])  # fmt: skip
    finally:
        assert node.stop() == 0
    assert result.exit_code == 0, result.output
    prompt_ids = theirs.encode(PROMPT, add_special_tokens=False)
    expected = list(hf_greedy(model, prompt_ids, STEPS))
    eos = theirs.convert_tokens_to_ids(EOS)
    shown = expected[: expected.index(eos)] if eos in expected else expected
    assert result.stdout == PROMPT + theirs.decode(shown) + "\n"


def test_cakemp_serve_names_the_model_by_the_files_stem(path, hf):
    """`cakemp serve --model tiny-llama.gguf` (every layer here) serves it as "tiny-llama": the name
    /v1/models lists and a chat naming it is answered with transformers' greedy tokens."""
    openai = pytest.importorskip("openai")
    model, theirs = hf
    server = LoggedProcess(["serve", "--model", str(path), "--dtype", "f32", "--address", "127.0.0.1:0",
                            "--repeat-penalty", "1", "--log-format", "json"], ready="api listening")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-llama"]
        messages = [{"role": "user", "content": PROMPT}]
        answer = client.chat.completions.create(model="tiny-llama", messages=messages, temperature=0, max_tokens=STEPS)
    finally:
        assert server.stop() == 0
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = list(hf_greedy(model, ids, STEPS))
    eos = theirs.convert_tokens_to_ids(EOS)
    assert answer.choices[0].message.content == theirs.decode(expected[: expected.index(eos)] if eos in expected
                                                              else expected)


def test_a_tokenizer_not_built_is_refused_by_name(tmp_path):
    spec = GgufSpec("llama", global_metadata={"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model 'bert' is not supported"):
        gguf_tokenizer(GgufFile(write_gguf(tmp_path / "wpm.gguf", spec)))
    for pre, why in (("kimi-k2", "code of its own"), ("no-such-pre", "llama.cpp does not know it")):
        spec = GgufSpec("llama", global_metadata={**_tokenizer_metadata(), "tokenizer.ggml.pre": pre})
        with pytest.raises(CheckpointError, match=f"tokenizer.ggml.pre '{pre}' is not supported .*{why}"):
            gguf_tokenizer(GgufFile(write_gguf(tmp_path / "pre.gguf", spec)))
