import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from cakemp.demo.synthetic import DEMO, EOS, SyntheticSpec, cache_root, demo_checkpoint, write_checkpoint
from cakemp.master.chat import ChatTemplate, conversation

SMALL = SyntheticSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, shards=3)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    directory = tmp_path_factory.mktemp("synthetic")
    write_checkpoint(directory, SMALL)
    return directory


def shard_tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: (path.name, f.get_tensor(name)) for name in f.keys()})
    return tensors


def test_demo_checkpoint_is_built_once_in_the_cache_dir(tmp_path, monkeypatch):
    """The checkpoint lands under $XDG_CACHE_HOME/cakemp, is reused on the next call, and leaves no temp dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = demo_checkpoint(SMALL)
    assert first.parent == tmp_path / "cakemp" == cache_root()
    assert first.name == f"demo-{SMALL.version_hash()}"
    stamp = (first / "config.json").stat().st_mtime_ns
    assert demo_checkpoint(SMALL) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cakemp").iterdir()] == [first.name]


def test_other_spec_gets_another_cache_entry():
    """Changing any field of the spec changes the version hash."""
    assert SyntheticSpec().version_hash() != SyntheticSpec(seed=1).version_hash()
    assert SyntheticSpec().version_hash() == SyntheticSpec().version_hash()


def test_index_maps_every_tensor_to_its_shard(small):
    """The weights are sharded into the asked number of files and the index names each tensor's file."""
    index = json.loads((small / "model.safetensors.index.json").read_text())
    tensors = shard_tensors(small)
    assert len({filename for filename, _ in tensors.values()}) == 3
    assert index["weight_map"] == {name: filename for name, (filename, _) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors.values())


def test_config_matches_the_tensors_and_the_tokenizer(small):
    """Config sizes, GQA shapes and the tokenizer's vocabulary and special tokens agree."""
    config = json.loads((small / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(small / "tokenizer.json"))
    tensors = {name: t for name, (_, t) in shard_tensors(small).items()}
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == tokenizer.get_vocab_size() == 512
    assert tokenizer.id_to_token(config["bos_token_id"]) == "<s>"
    assert tokenizer.id_to_token(config["eos_token_id"]) == "</s>"
    assert tensors["model.embed_tokens.weight"].shape == (512, 64)
    assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["lm_head.weight"].shape == (512, 64)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert len(tensors) == 1 + 9 * 3 + 2


def test_weights_are_reproducible_from_the_seed(small, tmp_path):
    """Writing the same spec again gives byte-identical files."""
    write_checkpoint(tmp_path, SMALL)
    for path in small.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


def test_tokenizer_prepends_bos_and_round_trips_any_text(small):
    """Encoding adds <s> in front, and decoding gives back the text, including bytes never seen in training."""
    tokenizer = Tokenizer.from_file(str(small / "tokenizer.json"))
    text = "Hello world — ünïcode 🍰 and the quick brown fox"
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer.encode("the quick brown fox").ids) < len("the quick brown fox")


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_it_without_missing_weights(tmp_path, tied):
    """HF transformers reads the checkpoint as a Llama with every weight present (lm_head tied or not)."""
    transformers = pytest.importorskip("transformers")
    write_checkpoint(tmp_path, dataclasses.replace(SMALL, tie_word_embeddings=tied))
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.tie_word_embeddings is tied
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight) is tied


def test_attention_depends_on_position(tmp_path):
    """The default checkpoint's first layer answers one decode step differently after a reordered
    copy of the same prefix, by half of what the layer adds to the step (observed 0.50). Without
    positions attention cannot tell the orders apart (the keys and values are the same set), so
    this is the rotary positions at work: with HF's 0.02 initialisation for q and k it was 0.04,
    and a generation with the rotary offset dropped gave the same greedy tokens."""
    from cakemp.compute.runner import BlockRunner

    write_checkpoint(tmp_path)
    runner = BlockRunner.load(tmp_path, ["model.layers.0"], "cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randn(1, 12, runner.config.hidden_size, generator=generator)
    step = torch.randn(1, 1, runner.config.hidden_size, generator=generator)
    outputs = []
    for session, order in enumerate((torch.arange(12), torch.randperm(12, generator=generator))):
        runner.run(session, prefix[:, order], runner.ops([("model.layers.0", 0, 0)]))
        outputs.append(runner.run(session, step, runner.ops([("model.layers.0", 12, 0)])))
    update = (outputs[0] - step).abs().max()  # what the layer adds to the residual stream
    assert (outputs[0] - outputs[1]).abs().max() > 0.2 * update


def test_the_demos_checkpoint_has_a_chat_template_rendered_as_transformers_renders_it(tmp_path):
    """The demo's checkpoint ships a chat template (so `cakemp serve`'s chat route answers on it): its
    ids are transformers' apply_chat_template's, and the turn before the answer ends in the end token."""
    transformers = pytest.importorskip("transformers")
    write_checkpoint(tmp_path, dataclasses.replace(SMALL, chat_template=DEMO.chat_template))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    messages = [*conversation("Be brief.", "hello"), {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "and then?"}]
    ours = ChatTemplate.load(tmp_path, tokenizer)
    assert ours is not None
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode(messages) == expected
    assert ours.render(messages).endswith(f"and then?{EOS}\n<|assistant|>\n")
