"""A config.json from a peer: whatever it holds, ModelConfig refuses it with CheckpointError or
gives numbers the model code can build and run blocks from."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute.loading import block_type
from cakemp.compute.runner import BlockRunner
from cakemp.errors import CheckpointError
from tests.support.checkpoints import make_config

LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hub(architecture: str, **keys) -> dict:
    return {"architectures": [architecture], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512} | keys


def as_json(config) -> dict:
    return json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else config, default=str))


# One valid config per family and rotary kind, as the hub's files or transformers 5 write them.
BASES = {
    **{family: as_json(make_config(family)) for family in
       ("llama", "qwen2", "qwen3", "mistral", "olmo2", "qwen3_moe", "qwen3_5", "qwen3_5_moe")},
    "llama3": hub("LlamaForCausalLM", rope_theta=5e5, rope_scaling=LLAMA3),
    "qwen2 sliding": hub("Qwen2ForCausalLM", sliding_window=3, use_sliding_window=True, max_window_layers=2),
    "gemma3": hub("Gemma3ForCausalLM", head_dim=32, query_pre_attn_scalar=24, sliding_window=4, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "phi3": hub("Phi3ForCausalLM", head_dim=16, partial_rotary_factor=0.75, original_max_position_embeddings=16,
                sliding_window=5, rope_scaling=LONGROPE),
    "exaone4": hub("Exaone4ForCausalLM", sliding_window=3, sliding_window_pattern="LLLG", rope_scaling=LLAMA3),
}


def test_every_base_config_parses():
    """The configs the hostile ones are made from are themselves valid."""
    for name, base in BASES.items():
        assert ModelConfig.from_dict(copy.deepcopy(base)).num_hidden_layers == 4, name


def refusal(config) -> str:
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_dict(config)
    return str(refused.value)


def llama(**keys) -> dict:
    return BASES["llama"] | keys


def text(family: str, **keys) -> dict:
    base = copy.deepcopy(BASES[family])
    base["text_config"] |= keys
    return base


# (config, a fragment the refusal must name); the first six are the review's crashes.
BAD = {
    "a JSON list": ([1, 2], "not a JSON object"),
    "architectures a number": (llama(architectures=5), "architecture 5"),
    "architectures nested": (llama(architectures=[[1]]), "architecture [1]"),
    "no attention heads": (llama(num_attention_heads=0), "num_attention_heads 0"),
    "infinite context": (llama(max_position_embeddings=1e400), "max_position_embeddings"),
    "rope_scaling a number": (llama(rope_parameters=None, rope_scaling=5), "rope_scaling 5"),
    "negative heads": (llama(num_attention_heads=-4), "num_attention_heads -4"),
    "fractional heads": (llama(num_attention_heads=2.5), "num_attention_heads 2.5"),
    "heads a list": (llama(num_attention_heads=[4]), "num_attention_heads [4]"),
    "heads a bool": (llama(num_attention_heads=True), "num_attention_heads True"),
    "kv heads not dividing": (llama(num_key_value_heads=3), "not a multiple of 3"),
    "more kv heads than heads": (llama(num_key_value_heads=8), "num_key_value_heads 8"),
    "heads past the hidden size": (llama(num_attention_heads=128, num_key_value_heads=128, head_dim=None), "head_dim 0"),
    "zero hidden size": (llama(hidden_size=0), "hidden_size 0"),
    "an astronomic hidden size": (llama(hidden_size=10**30), "hidden_size"),
    "no layers": (llama(num_hidden_layers=0), "num_hidden_layers 0"),
    "a trillion layers": (llama(num_hidden_layers=10**12), "num_hidden_layers"),
    "layers as text": (llama(num_hidden_layers="x" * 5000), "num_hidden_layers"),
    "zero intermediate size": (llama(intermediate_size=0), "intermediate_size 0"),
    "negative intermediate size": (llama(intermediate_size=-1), "intermediate_size -1"),
    "NaN norm epsilon": (llama(rms_norm_eps=math.nan), "rms_norm_eps"),
    "negative norm epsilon": (llama(rms_norm_eps=-1e-6), "rms_norm_eps"),
    "zero rope theta": (llama(rope_parameters={"rope_type": "default", "rope_theta": 0}), "rope_theta 0"),
    "infinite rope theta": (llama(rope_parameters={"rope_type": "default", "rope_theta": math.inf}), "rope_theta"),
    "odd rotary dimension": (llama(head_dim=15, rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.0}),
                             "rotary dimension 15"),
    "rotary past the head": (llama(rope_parameters={"rope_type": "default", "partial_rotary_factor": 2.0}),
                             "rotary dimension 32"),
    "no rotary": (llama(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.01}), "rotary dimension 0"),
    "llama3 ramp of width zero": (llama(rope_parameters={**LLAMA3, "low_freq_factor": 4.0}), "low_freq_factor"),
    "llama3 factor zero": (llama(rope_parameters={**LLAMA3, "factor": 0}), "rope factor 0"),
    "llama3 high factor zero": (llama(rope_parameters={**LLAMA3, "high_freq_factor": 0}), "high_freq_factor 0"),
    "linear factor negative": (llama(rope_parameters={"rope_type": "linear", "factor": -2}), "rope factor -2"),
    "rope_parameters a list": (llama(rope_parameters=[1]), "rope_parameters [1]"),
    "longrope original context 1": (BASES["phi3"] | {"original_max_position_embeddings": 1},
                                    "original_max_position_embeddings 1"),
    "longrope factor zero": (BASES["phi3"] | {"rope_scaling": {**LONGROPE, "short_factor": [0.0] * 6}}, "short_factor"),
    "longrope factors not a list": (BASES["phi3"] | {"rope_scaling": {**LONGROPE, "long_factor": 7}}, "long_factor 7"),
    "zero window": (BASES["phi3"] | {"sliding_window": 0}, "sliding_window 0"),
    "negative window": (BASES["qwen2 sliding"] | {"sliding_window": -3}, "sliding_window -3"),
    "qwen layer_types too short": (BASES["qwen2 sliding"] | {"layer_types": ["sliding_attention"]},
                                   "layer_types names 1 layers"),
    "qwen layer_types a number": (BASES["qwen2 sliding"] | {"layer_types": 3}, "layer_types 3"),
    "gemma pattern zero": (BASES["gemma3"] | {"sliding_window_pattern": 0}, "sliding_window_pattern 0"),
    "gemma layer_types too long": (BASES["gemma3"] | {"layer_types": ["full_attention"] * 5}, "layer_types"),
    "gemma attention scalar zero": (BASES["gemma3"] | {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar 0"),
    "gemma attention scalar negative": (BASES["gemma3"] | {"query_pre_attn_scalar": -4}, "query_pre_attn_scalar -4"),
    "gemma local theta negative": (BASES["gemma3"] | {"rope_local_base_freq": -1}, "rope_local_base_freq -1"),
    "exaone pattern empty": (BASES["exaone4"] | {"sliding_window_pattern": ""}, "sliding_window_pattern"),
    "no experts": (BASES["qwen3_moe"] | {"num_experts": 0, "num_local_experts": 0}, "num_experts 0"),
    "a billion experts": (BASES["qwen3_moe"] | {"num_local_experts": 10**9}, "num_experts"),
    "top-k past the experts": (BASES["qwen3_moe"] | {"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
    "top-k zero": (BASES["qwen3_moe"] | {"num_experts_per_tok": 0}, "num_experts_per_tok 0"),
    "expert size zero": (BASES["qwen3_moe"] | {"moe_intermediate_size": 0}, "moe_intermediate_size 0"),
    "sparse step zero": (BASES["qwen3_moe"] | {"decoder_sparse_step": 0}, "decoder_sparse_step 0"),
    "dense layers a number": (BASES["qwen3_moe"] | {"mlp_only_layers": 3}, "mlp_only_layers 3"),
    "text_config a list": (BASES["qwen3_5"] | {"text_config": [1]}, "text_config [1]"),
    "hybrid interval zero": (text("qwen3_5", layer_types=None, full_attention_interval=0), "full_attention_interval 0"),
    "hybrid layer_types short": (text("qwen3_5", layer_types=["full_attention"]), "layer_types"),
    "linear key heads zero": (text("qwen3_5", linear_num_key_heads=0), "linear_num_key_heads 0"),
    "linear value heads not a multiple": (text("qwen3_5", linear_num_value_heads=3), "not a multiple of 2"),
    "linear head dim zero": (text("qwen3_5", linear_value_head_dim=0), "linear_value_head_dim 0"),
    "conv kernel zero": (text("qwen3_5", linear_conv_kernel_dim=0), "linear_conv_kernel_dim 0"),
    "shared expert negative": (text("qwen3_5_moe", shared_expert_intermediate_size=-1), "shared_expert_intermediate"),
    "dense hybrid without intermediate size": (text("qwen3_5", intermediate_size=0), "intermediate_size 0"),
    "fp8 block zero": (llama(quantization_config={"quant_method": "fp8", "weight_block_size": [0, 128]}),
                       "weight_block_size 0"),
    "fp8 block of three": (llama(quantization_config={"quant_method": "fp8", "weight_block_size": [1, 2, 3]}),
                           "weight_block_size"),
    "quantization_config a string": (llama(quantization_config="fp8"), "quantization_config 'fp8'"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_config_is_refused_by_name(case):
    """Each config the model code would divide by zero with, index past, allocate without
    bound from or compute garbage with is a CheckpointError naming the field."""
    config, fragment = BAD[case]
    assert fragment in refusal(copy.deepcopy(config))


def test_a_refusal_clips_what_it_repeats_of_the_config():
    """A huge value is named by its start only."""
    message = refusal(llama(hidden_act="x" * 100_000))
    assert "hidden_act" in message and len(message) < 500


# --------------------------------------------------------------------------- any JSON at all

# The keys the parser reads (at the top level, or in text_config for a wrapped family).
KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
        "max_position_embeddings", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
        "sliding_window_pattern", "query_pre_attn_scalar", "rope_local_base_freq", "original_max_position_embeddings",
        "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers",
        "decoder_sparse_step", "shared_expert_intermediate_size", "full_attention_interval", "linear_num_key_heads",
        "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim", "linear_conv_kernel_dim",
        "quantization_config", "architectures", "text_config", "attention_bias", "hidden_act"]
ROPE_KEYS = ["rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor", "short_factor", "long_factor",
             "attention_factor", "full_attention", "sliding_attention"]

scalars = st.one_of(
    st.integers(-3, 9), st.sampled_from([16, 32, 64, 128, 10**6, 10**40, -(10**40)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.25, 0.5, 0.75, 1.5, 1e-300, 1e300]),
    st.booleans(), st.none(), st.text(max_size=4),
    st.sampled_from(["default", "linear", "llama3", "longrope", "su", "yarn", "fp8", "sliding_attention",
                     "full_attention", "linear_attention", "LG", "64", "nan", "inf"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(ROPE_KEYS + ["quant_method", "weight_block_size"]),
                                                 inner, max_size=4)), max_leaves=8)


@st.composite
def hostile_configs(draw) -> dict:
    """A valid base config with some of the keys the parser reads set to any JSON value."""
    config = copy.deepcopy(draw(st.sampled_from(list(BASES.values()))))
    target = config.get("text_config", config)
    for key in draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True)):
        into = config if key in ("architectures", "text_config") else target
        into[key] = draw(values)
    # Through JSON: what a peer's file can really hold (NaN, Infinity and 1e400 included).
    return json.loads(json.dumps(config))


def run_blocks(config: ModelConfig) -> None:
    """Build the first, second and last layers with random weights of the shapes the config
    implies, and run a prompt, a decode step and a restart at 0 through them."""
    indices = sorted({0, min(1, config.num_hidden_layers - 1), config.num_hidden_layers - 1})
    layers, shapes = {}, {}
    for index in indices:
        kind = block_type(config, index)
        shapes[index] = kind.weight_shapes(config, index, lambda name: False)
        groups = kind.weight_groups(config, index, lambda name: False)
        shapes[index] = {key: shapes[index][key] for key in groups}
    assume(sum(math.prod(shape) for by_key in shapes.values() for shape in by_key.values()) <= 4_000_000)
    generator = torch.Generator().manual_seed(0)
    for index in indices:
        weights = {key: torch.randn(shape, generator=generator) * 0.1 for key, shape in shapes[index].items()}
        layers[config.layer_name(index)] = block_type(config, index)(config, index, weights)
    runner = BlockRunner(config, layers, torch.device("cpu"), torch.float32, max_context=16)
    prompt = runner.ops([(config.layer_name(index), 0, index) for index in indices])
    x = torch.randn(1, 7, config.hidden_size, generator=generator)
    assert runner.run(1, x, prompt).shape == x.shape
    step = runner.ops([(config.layer_name(index), 7, index) for index in indices])
    assert runner.run(1, x[:, :1], step).shape == (1, 1, config.hidden_size)
    assert runner.run(1, x[:, :3], prompt).shape == (1, 3, config.hidden_size)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(hostile_configs())
def test_any_config_the_parser_accepts_builds_and_runs_blocks(config):
    """Any JSON in the keys the parser reads is a CheckpointError or a config whose blocks build
    from weights of its shapes and run a prompt and a decode step without an exception."""
    try:
        parsed = ModelConfig.from_dict(config)
    except CheckpointError:
        return
    run_blocks(parsed)
