"""ModelConfig from config.json: one set of switches per family, refusals named."""

import dataclasses
import json
import math
import re

import pytest

from cakemp.checkpoint.config import FAMILIES, LinearRopeScaling, Llama3RopeScaling, ModelConfig, Rope
from cakemp.checkpoint.quantization import Fp8
from cakemp.errors import CheckpointError
from tests.support.checkpoints import make_config


def parsed(family, **overrides):
    return ModelConfig.from_dict(make_config(family, **overrides).to_dict())


def test_llama_has_no_biases_no_qk_norm_no_window():
    """A Llama config gives head_dim hidden/heads, GQA heads, and none of the other families' switches."""
    c = parsed("llama")
    assert (c.family, c.head_dim, c.num_attention_heads, c.num_key_value_heads) == ("llama", 16, 4, 2)
    assert not c.qkv_bias and not c.o_bias and not c.qk_norm
    assert c.layer_windows == (None,) * 4 and c.rope_scaling is None and c.quantization is None


def test_a_family_that_reuses_switches_is_one_row(monkeypatch):
    """A new architecture with Llama's switches needs only its row in FAMILIES to parse as Llama does."""
    monkeypatch.setitem(FAMILIES, "llama_like", dataclasses.replace(FAMILIES["llama"], name="llama_like",
                                                                     architecture="LlamaLikeForCausalLM"))
    raw = make_config("llama", attention_bias=True, sliding_window=8).to_dict()
    ours = ModelConfig.from_dict({**raw, "architectures": ["LlamaLikeForCausalLM"]})
    assert dataclasses.replace(ours, family="llama", architecture="LlamaForCausalLM") == ModelConfig.from_dict(raw)


def test_qwen2_always_has_qkv_biases_but_no_o_bias():
    """Qwen2 projects q/k/v with biases whatever attention_bias says, and o without."""
    c = parsed("qwen2")
    assert c.qkv_bias and not c.o_bias


def test_qwen3_takes_head_dim_from_config_and_norms_q_k():
    """Qwen3's head_dim comes from the config even when it differs from hidden/heads."""
    c = parsed("qwen3", head_dim=32)
    assert c.head_dim == 32 and c.qk_norm and not c.qkv_bias


def test_mistral_window_applies_to_every_layer():
    """Mistral's sliding_window covers all layers."""
    assert parsed("mistral", sliding_window=5).layer_windows == (5, 5, 5, 5)


def test_qwen2_window_applies_only_from_max_window_layers_when_enabled():
    """Qwen2 slides only with use_sliding_window, and only on layers at or past max_window_layers."""
    assert parsed("qwen2", sliding_window=8).layer_windows == (None,) * 4
    c = parsed("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert c.layer_windows == (None, None, 8, 8)


def test_legacy_top_level_rope_theta_and_rope_scaling_are_read():
    """A transformers-4 style Llama 3.1 config (rope_theta + rope_scaling at top level) parses."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    c = ModelConfig.from_dict(d)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_transformers_5_rope_parameters_are_read():
    """rope_parameters (transformers 5) gives theta and llama3 scaling."""
    rope = {"rope_type": "llama3", "rope_theta": 1234.0, "factor": 2.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    c = parsed("llama", rope_parameters=rope)
    assert c.rope_theta == 1234.0 and c.rope_scaling.factor == 2.0


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], ["Qwen3NextForCausalLM"]])
def test_unsupported_architecture_is_named(architectures):
    """An architecture cakemp does not implement is refused by name, never run as Llama."""
    d = make_config("llama").to_dict() | {"architectures": architectures}
    with pytest.raises(CheckpointError, match=architectures[0]):
        ModelConfig.from_dict(d)


def test_missing_architectures_is_refused():
    """A config.json with no architectures list is refused."""
    d = make_config("llama").to_dict()
    del d["architectures"]
    with pytest.raises(CheckpointError, match="None"):
        ModelConfig.from_dict(d)


def test_unsupported_rope_type_is_refused():
    """A rope type cakemp does not compute (here yarn) is an error, not silently ignored."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(CheckpointError, match="yarn"):
        parsed("llama", rope_parameters=rope)


def test_from_dir_names_a_missing_config(tmp_path):
    """A directory without config.json is a CheckpointError naming the path."""
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_from_dir_reads_fp8_block_size(tmp_path):
    """quantization_config.weight_block_size gives the FP8 block; 128x128 when absent."""
    d = make_config("llama").to_dict()
    d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 32]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_dir(tmp_path).quantization == Fp8((64, 32))
    d["quantization_config"] = {"quant_method": "fp8"}
    assert ModelConfig.from_dict(d).quantization == Fp8((128, 128))


def test_layer_index_accepts_only_this_models_layers():
    """model.layers.N maps to N when N < num_hidden_layers; other names map to None."""
    c = parsed("llama")
    assert c.layer_index("model.layers.3") == 3
    assert c.layer_index("model.layers.4") is None
    assert c.layer_index("model.language_model.layers.0") is None
    assert c.layer_index("model.layers.x") is None


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("mlp_bias", True)])
def test_unsupported_mlp_variants_are_refused(key, value):
    """An MLP cakemp does not compute (another activation, MLP biases) is refused, not approximated."""
    d = make_config("llama").to_dict() | {key: value}
    with pytest.raises(CheckpointError, match=key):
        ModelConfig.from_dict(d)


def test_qwen3_5_reads_text_config_layer_kinds_and_partial_rotary():
    """Qwen3.5's text_config gives the hybrid's switches, its layer prefix and the linear layers."""
    c = parsed("qwen3_5")
    assert c.layer_prefix == "model.language_model.layers" and c.layer_name(3) == "model.language_model.layers.3"
    assert c.linear_layers == {0, 1, 2} and c.layout.norm_plus_one and c.attention_output_gate and c.qk_norm == "head"
    assert c.layer_ropes[3].dim == 4 and c.moe is None  # head_dim 16 x 0.25
    assert c.layer_ropes[:3] == (None,) * 3  # linear-attention layers rotate nothing
    assert (c.linear_attention.key_heads, c.linear_attention.value_heads, c.linear_attention.conv_channels) == (2, 4, 96)


def test_qwen3_5_layer_kinds_from_full_attention_interval_and_classic_rope_keys():
    """Without layer_types every interval-th layer attends; rope_theta and partial_rotary_factor may be plain keys."""
    d = make_config("qwen3_5", num_hidden_layers=6).to_dict()
    text = d["text_config"]
    del text["layer_types"], text["rope_parameters"]
    text.update(full_attention_interval=3, rope_theta=5e6, partial_rotary_factor=0.5)
    c = ModelConfig.from_dict(d)
    assert c.linear_layers == {0, 1, 3, 4} and c.rope_theta == 5e6 and c.layer_ropes[2].dim == 8


def test_qwen3_5_moe_always_renormalises_and_has_a_shared_expert():
    c = parsed("qwen3_5_moe")
    assert (c.moe.experts, c.moe.top_k, c.moe.renormalize, c.moe.shared_intermediate_size) == (8, 2, True, 48)
    assert c.moe.sparse_layers == (True,) * 4


def test_qwen3_moe_sparse_layers_follow_mlp_only_layers_and_step():
    """Hub configs say num_experts (transformers 5: num_local_experts); dense layers from mlp_only_layers and the step."""
    d = make_config("qwen3_moe", mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=True).to_dict()
    d["num_experts"] = d.pop("num_local_experts")
    c = ModelConfig.from_dict(d)
    assert c.moe.sparse_layers == (False, True, False, True) and c.moe.renormalize and c.qk_norm == "head"


def hub(family, **keys):
    """A hub-keyed config.json dict (classic keys, as tests/support/families.py writes them)."""
    architecture = {"gemma3": "Gemma3ForCausalLM", "exaone4": "Exaone4ForCausalLM", "phi3": "Phi3ForCausalLM",
                    "olmo2": "Olmo2ForCausalLM"}[family]
    return {"architectures": [architecture], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512} | keys


def test_gemma3_layer_kinds_from_the_pattern_with_their_own_rotary():
    """Without layer_types, every 6th Gemma 3 layer is global (rope_theta, scaled) and the rest
    local (window, rope_local_base_freq); the scale is query_pre_attn_scalar's; tied by default."""
    c = ModelConfig.from_dict(hub("gemma3", rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=512,
                                  query_pre_attn_scalar=144, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert c.layer_windows == (512,) * 5 + (None,)
    local, global_ = Rope(1e4, 16), Rope(1e6, 16, LinearRopeScaling(8.0))
    assert c.layer_ropes == (local,) * 5 + (global_,)
    assert c.attention_scale == 144**-0.5 and c.tie_word_embeddings and c.activation == "gelu_tanh"
    assert c.layout.norm_plus_one and c.qk_norm == "head"


def test_exaone4_pattern_string_makes_the_last_layer_global_and_global_layers_unrotated():
    """EXAONE 4's "LLLG" repeats, the last layer is global whatever the pattern says, and global
    layers get no rotary when a window is configured; without a window every layer rotates."""
    c = ModelConfig.from_dict(hub("exaone4", sliding_window=8, sliding_window_pattern="LLLG"))
    assert c.layer_windows == (8, 8, 8, None, 8, None)
    assert [r is None for r in c.layer_ropes] == [False, False, False, True, False, True]
    c = ModelConfig.from_dict(hub("exaone4", sliding_window=None, layer_types=["full_attention"] * 6))
    assert c.layer_windows == (None,) * 6 and None not in c.layer_ropes


def test_phi3_longrope_reads_the_top_level_original_context_and_derives_the_attention_factor():
    """A Phi-3 "su"/longrope config: partial rotary, factors per rotated pair, attention factor
    sqrt(1 + ln(max / original) / ln(original))."""
    factors = [1.0, 2.0, 3.0]  # rotary_dim 6 of head_dim 16 (partial_rotary_factor 0.375)
    c = ModelConfig.from_dict(hub("phi3", partial_rotary_factor=0.375, original_max_position_embeddings=32,
                                  rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors}))
    scaling = c.rope_scaling
    assert c.layer_ropes[0].dim == 6 and scaling.original_max_position_embeddings == 32
    assert scaling.attention_factor == pytest.approx((1 + math.log(512 / 32) / math.log(32)) ** 0.5)


def test_phi3_longrope_factors_of_the_wrong_length_are_refused():
    """longrope factors must cover every rotated pair of a head."""
    rope = {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "original_max_position_embeddings": 32}
    with pytest.raises(CheckpointError, match="longrope"):
        ModelConfig.from_dict(hub("phi3", rope_scaling=rope))


def test_olmo2_norms_after_each_branch_and_q_k_over_the_projection():
    """OLMo 2 has no input norm, norms after attention and after the MLP, q/k norm over the projection."""
    c = ModelConfig.from_dict(hub("olmo2"))
    assert dict(c.layout.norms) == {"attn_out_norm": "post_attention_layernorm.weight",
                                    "mlp_out_norm": "post_feedforward_layernorm.weight"}
    assert c.qk_norm == "projection" and not c.tie_word_embeddings


def test_an_embedding_gemma_is_refused():
    """A bidirectional (embedding) Gemma 3 is not a causal decoder and is refused by name."""
    with pytest.raises(CheckpointError, match="use_bidirectional_attention"):
        ModelConfig.from_dict(hub("gemma3", use_bidirectional_attention=True))


DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 6, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 512,
           "vocab_size": 128, "torch_dtype": "bfloat16"}


def vibevoice(streaming: bool, **decoder) -> dict:
    architecture = "VibeVoiceStreamingForConditionalGenerationInference" if streaming else \
        "VibeVoiceForConditionalGeneration"
    config = {"architectures": [architecture], "decoder_config": DECODER | decoder}
    return config | ({"tts_backbone_num_hidden_layers": 4} if streaming else {})


def test_vibevoice_reads_decoder_config_as_cakes_worker_does():
    """The decoder's sizes, epsilon and rope_theta from decoder_config; q/k/v bias forced; no window,
    rope scaling or head_dim of its own applies (Cake reads none); bf16 declared by its torch_dtype."""
    c = ModelConfig.from_dict(vibevoice(False, use_sliding_window=True, sliding_window=4, head_dim=8,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert (c.family, c.model_type, c.hidden_size, c.num_hidden_layers, c.rms_norm_eps, c.rope_theta) == \
        ("vibevoice", "audio-model", 64, 6, 1e-5, 1e6)
    assert c.qkv_bias and not c.o_bias and c.head_dim == 16 and c.rope_scaling is None
    assert c.layer_windows == (None,) * 6 and c.declared_dtype == "bf16"
    assert c.stacks == (("model.language_model.layers", 0, 6),) and c.layer_name(5) == "model.language_model.layers.5"
    assert ModelConfig.from_dict(vibevoice(False, torch_dtype="float32")).declared_dtype is None
    assert FAMILIES["llama"].model_type == "text-model"


def test_vibevoice_realtime_has_two_stacks_numbered_from_zero_in_their_names():
    """Base LM: the decoder's layers less the TTS LM's; each stack's names and block_idx from 0; here
    the TTS stack's layers (and KV slots) come after the base's."""
    c = ModelConfig.from_dict(vibevoice(True))
    assert c.stacks == (("model.language_model.layers", 0, 2), ("model.tts_language_model.layers", 2, 4))
    assert [c.layer_name(i) for i in (1, 2, 5)] == ["model.language_model.layers.1",
                                                   "model.tts_language_model.layers.0", "model.tts_language_model.layers.3"]
    assert c.layer_index("model.tts_language_model.layers.0") == 2 and c.layer_index("model.language_model.layers.2") is None
    assert c.kv_slot("model.tts_language_model.layers.1", 1) == 3 and c.kv_slot("model.language_model.layers.1", 1) == 1


@pytest.mark.parametrize("config, words", [
    (vibevoice(True) | {"tts_backbone_num_hidden_layers": 6}, "tts_backbone_num_hidden_layers"),
    ({k: v for k, v in vibevoice(True).items() if k != "tts_backbone_num_hidden_layers"}, "tts_backbone_num_hidden_layers"),
    (vibevoice(False) | {"decoder_config": {k: v for k, v in DECODER.items() if k != "rope_theta"}},
     "decoder_config.rope_theta"),
    ({"architectures": ["VibeVoiceForConditionalGeneration"]}, "decoder_config"),
])
def test_a_vibevoice_config_cake_could_not_read_is_refused(config, words):
    with pytest.raises(CheckpointError, match=re.escape(words)):
        ModelConfig.from_dict(config)
