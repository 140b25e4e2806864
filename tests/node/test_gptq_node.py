"""`cakemp run` serving GPTQ checkpoints (packed by GPTQModel) over TCP, against HF's layers
computing GPTQModel's dequantization of the same weights.

One node at a time, each serving layers 1-3 of one checkpoint on one f32 CPU device:
* Llama: 4 bits, groups of 32, symmetric, checkpoint_format v1 (the checkpoints Cake reads);
* Qwen3: 3 bits, groups of 64, act-order (g_idx), asymmetric, v2;
* Qwen3-MoE: the experts alone at 8 bits with one group per column (group_size -1),
  asymmetric v1 (zero points of 0 included), attention and the router kept in 16 bits, as
  Qwen's MoE releases are.
A prompt, 8 decode steps and (a second session) a prompt in 3-token chunks match HF to F32_REL.
A variant cakemp does not compute (5 bits) makes the node exit 78 naming it.
"""

from __future__ import annotations

import json

import pytest

from tests.support.checkpoints import make_checkpoint
from tests.support.quantized import GptqSpec, gptq_checkpoints, gptq_shaped, needs_gptqmodel
from tests.support.quantized_node import check_prompt_decode_and_chunks, refused_at_start, start

SPECS = {
    "llama": GptqSpec("llama", bits=4, group_size=32),
    "qwen3": GptqSpec("qwen3", bits=3, group_size=64, desc_act=True, sym=False, v1=False),
    "qwen3_moe": GptqSpec("qwen3_moe", bits=8, group_size=-1, sym=False, experts_only=True,
                          overrides=(("norm_topk_prob", True),)),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return gptq_checkpoints(tmp_path_factory.mktemp("gptq"), SPECS)


@pytest.fixture(scope="module", params=list(SPECS))
def served(request, built, tmp_path_factory):
    path, reference = built[request.param]
    node = start(path, tmp_path_factory.mktemp("topo"))
    yield node, path, reference
    assert node.stop() == 0


@needs_gptqmodel
def test_prompt_decode_and_chunked_prompt_match_hf(served):
    check_prompt_decode_and_chunks(*served)


def test_a_gptq_variant_not_computed_is_refused_at_start(tmp_path):
    """Refused from config.json alone, before a device starts (so no oracle is needed)."""
    path = make_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 5, "group_size": 32}
    (path / "config.json").write_text(json.dumps(config))
    assert "GPTQ with 5 bits is not supported" in refused_at_start(path, tmp_path)


def test_a_gptq_weight_claiming_a_matrix_the_config_does_not_imply_stops_the_node_naming_it(tmp_path):
    """down_proj's parts agree with each other on [8192, 8192] where config.json implies [64, 128] (a
    pushed or downloaded file can say so): the node exits 78 naming the weight and both shapes, checked
    from the headers before any device dequantizes it (tests/compute/test_quantized_shapes.py measures
    the memory that is never taken)."""
    path = gptq_shaped(tmp_path / "bad", "llama", GptqSpec("llama", bits=4, group_size=32),
                       shapes={"model.layers.1.mlp.down_proj": (8192, 8192)})
    output = refused_at_start(path, tmp_path)
    assert "model.layers.1.mlp.down_proj.weight (8192, 8192)" in output and "(64, 128)" in output
