"""A GGUF file's ModelConfig (checkpoint/gguf_model.py through ModelConfig.from_dir) against the
config transformers' GGUF loader reads from the same file, and what is refused by name."""

from __future__ import annotations

import pytest

from cakemp.checkpoint.config import LinearRopeScaling, ModelConfig
from cakemp.checkpoint.gguf_model import hf_names
from cakemp.errors import CheckpointError
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

pytestmark = needs_gguf

SPECS = {
    "llama": GgufSpec("llama", rope_theta=500000.0),
    "qwen2": GgufSpec("qwen2", kv_heads=1, tied=True),
    "qwen3": GgufSpec("qwen3", head_dim=128, rope_theta=1e6),
    "qwen3moe": GgufSpec("qwen3moe", ffn=0, experts=8, expert_ffn=768, head_dim=32, top_k=3),
}


@pytest.mark.parametrize("arch", list(SPECS))
def test_the_config_is_the_one_transformers_reads(tmp_path, arch):
    import transformers

    path = write_gguf(tmp_path / f"{arch}.gguf", SPECS[arch])
    ours = ModelConfig.from_dir(path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert ours.family == theirs.model_type
    assert (ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads, ours.num_key_value_heads) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.rope_theta == pytest.approx(theirs.rope_parameters["rope_theta"])
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.qkv_bias == (arch == "qwen2")
    if arch == "qwen3moe":
        moe = ours.moe
        assert (moe.experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (
            theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size, theirs.norm_topk_prob)
        assert all(moe.sparse_layers)


def test_tensor_names_map_onto_hf_s(tmp_path):
    names = hf_names(["token_embd.weight", "output.weight", "output_norm.weight", "blk.3.attn_q.weight",
                      "blk.3.attn_k.bias", "blk.0.ffn_norm.weight", "blk.1.ffn_down_exps.weight",
                      "blk.1.ffn_gate_inp.weight", "blk.2.attn_k_norm.weight", "blk.x.attn_q.weight", "mystery"])
    assert names == {
        "model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight", "model.layers.3.self_attn.q_proj.weight": "blk.3.attn_q.weight",
        "model.layers.3.self_attn.k_proj.bias": "blk.3.attn_k.bias",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
        "model.layers.1.mlp.switch_mlp.down_proj.weight": "blk.1.ffn_down_exps.weight",
        "model.layers.1.mlp.gate.weight": "blk.1.ffn_gate_inp.weight",
        "model.layers.2.self_attn.k_norm.weight": "blk.2.attn_k_norm.weight",
    }


def test_linear_rope_scaling_is_read(tmp_path):
    spec = GgufSpec("qwen2", metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
    config = ModelConfig.from_dir(write_gguf(tmp_path / "m.gguf", spec))
    assert config.rope_scaling == LinearRopeScaling(4.0)


REFUSED = {
    "yarn": (GgufSpec("qwen3", metadata={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}),
             "qwen3.rope.scaling.type 'yarn' is not supported"),
    "rope_freqs": (GgufSpec("llama", extra_tensors={"rope_freqs.weight": (8,)}),
                   "per-frequency rope factors (rope_freqs.weight, Llama 3's rope scaling) are not supported"),
    "value_length": (GgufSpec("qwen3", head_dim=32, metadata={"attention.value_length": 16}),
                     "qwen3.attention.value_length differs from key_length"),
    "partial rotary": (GgufSpec("llama", metadata={"rope.dimension_count": 8}),
                       "llama.rope.dimension_count 8 is not the head size"),
    "no block_count": (GgufSpec("qwen2", metadata={"block_count": None}), "GGUF metadata lacks qwen2.block_count"),
    "heads per layer": (GgufSpec("qwen2", metadata={"attention.head_count_kv": [2, 2, 2, 2]}),
                        "num_key_value_heads [2, 2, 2, 2] is not a whole number"),
    "shared experts": (GgufSpec("qwen3moe", ffn=0, experts=4, expert_ffn=32, metadata={"expert_shared_count": 1}),
                       "shared experts are not supported for qwen3moe"),
    "split": (GgufSpec("qwen2", global_metadata={"split.count": 3}), "a GGUF file split in 3 parts is not supported"),
    "bad head counts": (GgufSpec("qwen2", heads=4, kv_heads=3), "4 attention heads are not a multiple of 3"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cakemp_does_not_compute_is_refused_by_name(tmp_path, case):
    spec, message = REFUSED[case]
    path = write_gguf(tmp_path / "m.gguf", spec)
    with pytest.raises(CheckpointError, match="m.gguf") as raised:
        ModelConfig.from_dir(path)
    assert message in str(raised.value)


def test_a_layer_s_estimated_size_is_its_tensors_as_stored(tmp_path):
    """What a topology completed by memory weighs a layer as (checkpoint/files.estimated_layer_bytes):
    the layers' stored bytes over their count, as gguf-py's reader counts them."""
    import gguf

    from cakemp.checkpoint.files import estimated_layer_bytes

    path = write_gguf(tmp_path / "m.gguf", GgufSpec("qwen3", types={"attn_q": "Q4_0", "ffn_up": "F16"}))
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk."))
    assert estimated_layer_bytes(path, 4, "model.layers") == stored // 4
