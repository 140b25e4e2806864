"""`cakemp run` serving MLX affine checkpoints (quantized by mx.quantize, laid out as mlx-lm
converts) over TCP, against HF's layers computing mx.dequantize of the same weights.

One node at a time, each serving layers 1-3 of one checkpoint on one f32 CPU device:
* Llama: 4 bits, groups of 64;
* Qwen3: 8 bits, groups of 32, sharded in 2 files;
* Qwen3.5-MoE, the checkpoint Cake's maintainer runs (Qwen3.5-35B-A3B-4bit) in small: 4 bits,
  groups of 32, routers and shared-expert gates at 8 bits with groups of 64 (mlx-lm's
  per-module overrides), experts stacked under switch_mlp, norms stored with their 1, the
  convolution as [C, K, 1], layers under language_model.model (the prefix read from the index).
A prompt, 8 decode steps and (a second session) a prompt in 3-token chunks match HF to F32_REL.
An MLX mode cakemp does not compute (mxfp4) makes the node exit 78 naming it.
"""

from __future__ import annotations

import json

import pytest

from tests.support.checkpoints import make_checkpoint
from tests.support.quantized import mlx_checkpoint, needs_mlx
from tests.support.quantized_node import check_prompt_decode_and_chunks, refused_at_start, start

CHECKPOINTS = {
    "llama": dict(family="llama", bits=4, group_size=64),
    "qwen3": dict(family="qwen3", bits=8, group_size=32, shards=2),
    "qwen3_5_moe": dict(family="qwen3_5_moe", bits=4, group_size=32),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request, tmp_path_factory):
    path, reference = mlx_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])
    node = start(path, tmp_path_factory.mktemp("topo"))
    yield node, path, reference
    assert node.stop() == 0


@needs_mlx
def test_prompt_decode_and_chunked_prompt_match_hf(served):
    check_prompt_decode_and_chunks(*served)


def test_an_mlx_mode_not_computed_is_refused_at_start(tmp_path):
    """Refused from config.json alone, before a device starts (so no oracle is needed)."""
    path = make_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    assert "MLX quantization mode 'mxfp4' is not supported" in refused_at_start(path, tmp_path)
