"""The read-bytes count of offloaded experts stored stacked ([E, ...] tensors, as Qwen3.5-MoE's checkpoint
holds them): each expert read counts its own share of the stack, not the whole stacked tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cakemp.compute.runner import BlockRunner
from tests.support.checkpoints import make_checkpoint

LAYER = "model.language_model.layers.1"


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe")


def stacked_bytes(checkpoint: Path) -> tuple[int, int]:
    """The bytes of LAYER's stacked expert tensors in the checkpoint's files, and the experts they stack."""
    total = 0
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.startswith(f"{LAYER}.mlp.experts."):
                    total += f.get_tensor(name).nbytes
    config = json.loads((checkpoint / "config.json").read_text())
    return total, config["text_config"]["num_experts"]


def test_each_expert_read_counts_its_share_of_the_stacked_tensors(qwen3_5_moe):
    total, experts = stacked_bytes(qwen3_5_moe)
    assert total and experts > 1
    runner = BlockRunner.load(qwen3_5_moe, [LAYER], "cpu", torch.float32, expert_cache_bytes=1 << 30)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    runner.run(0, x, runner.ops([(LAYER, 0, 0)]))
    cache = runner.expert_cache
    assert cache.misses > 0
    assert cache.read_bytes == cache.misses * (total // experts)
