"""The quantization a config.json declares, read without torch: GPTQ and MLX affine configs as
their writers lay them out, every variant cakemp does not compute refused by name, and the
facts read from the tensors' names and shapes (the layer prefix, MLX's pre-added norms)."""

from __future__ import annotations

import pytest

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import layer_prefix
from cakemp.checkpoint.quantization import Fp8, Gptq, GptqParts, MlxAffine, MlxParts, norms_carry_one
from cakemp.errors import CheckpointError

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
QWEN3_5_MOE = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": {
    **LLAMA, "architectures": None, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}}
# As GPTQModel writes it (AutoGPTQ's has no checkpoint_format: v1).
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "pack_dtype": "int32"}
MLX = {"group_size": 64, "bits": 4, "mode": "affine"}


def parsed(**keys):
    return ModelConfig.from_dict(LLAMA | keys).quantization


def refusal(config: dict) -> str:
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_dict(config)
    return str(refused.value)


def test_gptq_configs_as_autogptq_and_gptqmodel_write_them():
    """bits, group_size (-1 included), desc_act, sym and the checkpoint format (v1 by default)."""
    assert parsed(quantization_config=GPTQ) == Gptq(4, 128, desc_act=True, sym=False, v1=True)
    v2 = GPTQ | {"bits": 3, "group_size": -1, "desc_act": False, "sym": True, "checkpoint_format": "gptq_v2"}
    assert parsed(quantization_config=v2) == Gptq(3, -1, desc_act=False, sym=True, v1=False)
    autogptq = {"quant_method": "gptq", "bits": 8, "group_size": 32}  # no format key: AutoGPTQ's v1
    assert parsed(quantization_config=autogptq) == Gptq(8, 32, desc_act=False, sym=True, v1=True)
    assert parsed(quantization_config=GPTQ | {"checkpoint_format": None, "format": "gptq_v2"}).v1 is False


def test_mlx_configs_as_mlx_lm_writes_them():
    """`quantization` (and its copy in quantization_config) with per-module overrides and
    modules left unquantized; a config with only quantization_config is read the same way."""
    with_overrides = MLX | {"model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}, "model.layers.1.mlp.gate": False}
    expected = MlxAffine(4, 64, (("model.layers.0.mlp.gate", (8, 64)), ("model.layers.1.mlp.gate", None)))
    assert parsed(quantization=with_overrides, quantization_config=with_overrides) == expected
    assert parsed(quantization_config=MLX | {"bits": 8, "group_size": 32}) == MlxAffine(8, 32)
    hybrid = ModelConfig.from_dict(QWEN3_5_MOE | {"quantization": MLX})  # at the top level beside text_config
    assert hybrid.quantization == MlxAffine(4, 64)


def test_fp8_stays_as_it_was():
    assert parsed(quantization_config={"quant_method": "fp8", "weight_block_size": [64, 32]}) == Fp8((64, 32))
    assert ModelConfig.from_dict(LLAMA | {"quantization_config": {"quant_method": "fp8"}}).quantization == Fp8((128, 128))


REFUSED = {
    "awq": ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization 'awq' is not supported"),
    "bitsandbytes": ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
    "compressed-tensors": ({"quantization_config": {"quant_method": "compressed-tensors"}}, "'compressed-tensors'"),
    "gptq 5 bits": ({"quantization_config": GPTQ | {"bits": 5}}, "GPTQ with 5 bits is not supported"),
    "gptq marlin": ({"quantization_config": GPTQ | {"checkpoint_format": "marlin"}}, "checkpoint_format 'marlin'"),
    "gptq is_marlin_format": ({"quantization_config": GPTQ | {"is_marlin_format": True}}, "'marlin'"),
    "gptq planar": ({"quantization_config": GPTQ | {"checkpoint_format": "gptq_p"}}, "'gptq_p'"),
    "gptq dynamic": ({"quantization_config": GPTQ | {"dynamic": {"-:.*mlp.*": {}}}}, "dynamic"),
    "gptq int16 words": ({"quantization_config": GPTQ | {"pack_dtype": "int16"}}, "pack_dtype 'int16'"),
    "gptq group 0": ({"quantization_config": GPTQ | {"group_size": 0}}, "gptq group_size 0"),
    "gptq desc_act a string": ({"quantization_config": GPTQ | {"desc_act": "yes"}}, "desc_act 'yes'"),
    "mlx mxfp4": ({"quantization": MLX | {"mode": "mxfp4", "group_size": 32}}, "mode 'mxfp4' is not supported"),
    "mlx nvfp4": ({"quantization": MLX | {"mode": "nvfp4"}}, "'nvfp4'"),
    "mlx 7 bits": ({"quantization": MLX | {"bits": 7}}, "MLX affine with 7 bits is not supported"),
    "mlx group 16": ({"quantization": MLX | {"group_size": 16}}, "group_size 16 is not supported"),
    "mlx override mode": ({"quantization": MLX | {"model.layers.0.mlp.gate": {"bits": 4, "group_size": 32,
                                                                              "mode": "mxfp8"}}}, "'mxfp8'"),
    "mlx override junk": ({"quantization": MLX | {"model.layers.0.mlp.gate": 8}}, "neither bits and group_size"),
    "mlx not an object": ({"quantization": "4bit"}, "quantization '4bit' is not a JSON object"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_variant_not_computed_is_refused_by_name(case):
    keys, fragment = REFUSED[case]
    assert fragment in refusal(LLAMA | keys)


def test_the_stored_parts_of_a_quantized_weight():
    """A weight is quantized exactly where its parts are stored; g_idx is optional; an MLX
    module takes its override's bits, and one the config leaves unquantized may not have scales."""
    stored = {"a.qweight", "a.g_idx", "b.qweight", "m.scales", "n.scales"}.__contains__
    gptq = Gptq(4, 128, False, True, True)
    assert gptq.parts("a.weight", stored) == GptqParts("a.qweight", "a.qzeros", "a.scales", "a.g_idx", gptq)
    assert gptq.parts("b.weight", stored).g_idx is None
    assert gptq.parts("c.weight", stored) is None and gptq.parts("a.bias", stored) is None
    mlx = MlxAffine(4, 64, (("m", (8, 32)), ("n", None)))
    assert mlx.parts("m.weight", stored) == MlxParts("m.weight", "m.scales", "m.biases", 8, 32)
    assert mlx.parts("a.weight", stored) is None
    with pytest.raises(ValueError, match="leaves it unquantized"):
        mlx.parts("n.weight", stored)


def test_the_layer_prefix_is_read_from_the_tensor_names():
    """The family's prefix where its layers are stored; else the first layer tensor's, as Cake
    does (mlx-lm's "language_model.model.layers"), never a multi-token-prediction head's."""
    assert layer_prefix(["model.layers.0.a.weight", "mtp.layers.0.a"], "model.layers") == "model.layers"
    mlx = ["language_model.lm_head.weight", "language_model.model.layers.0.mlp.gate.weight", "mtp.layers.0.x"]
    assert layer_prefix(mlx, "model.language_model.layers") == "language_model.model.layers"
    assert layer_prefix(["language_model.model.layers.7.a"], "model.language_model.layers") == \
        "language_model.model.layers"  # a push of later layers holds no layer 0
    assert layer_prefix(["mtp.layers.0.a", "lm_head.weight"], "model.layers") == "model.layers"
    assert layer_prefix([], "model.layers") == "model.layers"


def test_mlx_norms_carry_their_one_where_the_convolution_is_in_mlx_layout():
    """conv1d [C, K, 1] (mlx-lm's sanitize) means 1 + w stored; HF's [C, 1, K] means w."""
    assert norms_carry_one((96, 4, 1)) and not norms_carry_one((96, 1, 4))
    assert not norms_carry_one(None) and not norms_carry_one((96, 4))
