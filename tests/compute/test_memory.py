"""What a GPU's memory allows: the load-size check, the default KV budget, and the loader's estimate they rely on."""

from __future__ import annotations

import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute import memory
from cakemp.compute.memory import GIB
from cakemp.compute.runner import BlockRunner
from cakemp.errors import ConfigError
from cakemp.model.block import DecoderBlock
from cakemp.model.weights import fp8
from cakemp.model.weights.safetensors import Checkpoint
from tests.support.checkpoints import make_checkpoint

LAYERS = ["model.layers.1", "model.layers.2"]


def test_layers_that_do_not_fit_are_a_configuration_error_naming_both_sizes():
    """Needing more than is free is refused with the bytes needed and free; exactly what is free fits."""
    memory.check_fits(5 * GIB, 5 * GIB, "cuda:0")
    with pytest.raises(ConfigError, match=r"need 5368709121 bytes \(5.00 GiB\) on cuda:0 but 1073741824 bytes"):
        memory.check_fits(5 * GIB + 1, GIB, "cuda:0")


@pytest.mark.parametrize("free, total, budget", [
    (70 * GIB, 80 * GIB, 62 * GIB),  # a tenth of the card stays free for activations
    (10 * GIB, 12 * GIB, 8 * GIB),  # at least 2 GiB
])
def test_default_kv_budget_is_free_memory_after_loading_less_the_headroom(free, total, budget):
    """Without --kv-budget-mib a GPU device budgets what loading left, less max(2 GiB, total / 10)."""
    assert memory.default_kv_budget(free, total, "cuda:0") == budget


def test_no_room_left_for_kv_caches_is_a_configuration_error():
    """A device whose layers leave less than the headroom free cannot serve a request: exit 78."""
    with pytest.raises(ConfigError, match="no room for KV caches"):
        memory.default_kv_budget(2 * GIB, 16 * GIB, "cuda:1")


def loaded_bytes(weights) -> int:
    return sum(w.nbytes for w in weights.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_load_size_estimate_is_what_loading_allocates(tmp_path, dtype):
    """The estimate read from the shards' headers equals the bytes of the loaded weights."""
    path = make_checkpoint(tmp_path, "qwen2", shards=2)
    config = ModelConfig.from_dir(path)
    checkpoint = Checkpoint(path, config)
    groups = {key: [f"model.layers.1.{name}" for name in members]
              for key, members in DecoderBlock.weight_groups(config, 0, lambda name: True).items()}
    assert checkpoint.nbytes(groups, dtype) == loaded_bytes(checkpoint.load(groups, torch.device("cpu"), dtype))


def test_fp8_groups_in_128_blocks_stay_fp8_and_are_counted_at_a_byte(tmp_path):
    """Kept for the fp8 kernel, matrices in 128x128 blocks stay e4m3 (an Fp8Weight over the stored bytes
    and scales) and count one byte per element and their scales; q/k/v, whose k and v have 64 rows, is
    dequantized."""
    path = make_checkpoint(tmp_path, "llama", fp8_block=(128, 128), hidden_size=128, intermediate_size=256)
    config = ModelConfig.from_dir(path)
    checkpoint = Checkpoint(path, config)
    groups = {key: [f"model.layers.0.{name}" for name in members]
              for key, members in DecoderBlock.weight_groups(config, 0, lambda name: True).items()}
    weights = checkpoint.load(groups, torch.device("cpu"), torch.bfloat16, kernels=frozenset({fp8.KERNEL}))
    kept = {key for key, w in weights.items() if isinstance(w, fp8.Fp8Weight)}
    assert kept == {"w_o", "w_gate_up", "w_down"}
    dequantized = checkpoint.load(groups, torch.device("cpu"), torch.float32)
    for key in kept:
        w = weights[key]
        assert w.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(fp8.dequantize(w.weight, w.scale_inv, (128, 128)), dequantized[key])
    assert checkpoint.nbytes(groups, torch.bfloat16, kernels=frozenset({fp8.KERNEL})) == loaded_bytes(weights)


@pytest.mark.gpu
def test_cuda_load_that_cannot_fit_is_a_configuration_error(tmp_path):
    """With all but 32 MiB of the GPU taken, loading two 54 MiB layers is refused by ConfigError naming the sizes."""
    path = make_checkpoint(tmp_path, "llama", hidden_size=1024, intermediate_size=8192)  # 54 MiB a layer in bf16
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (32 << 20), dtype=torch.uint8, device="cuda")  # leaves 32 MiB
    try:
        with pytest.raises(ConfigError, match=r"the layers need \d+ bytes .* on cuda:0 but \d+ bytes"):
            BlockRunner.load(path, ["model.layers.0", "model.layers.1"], "cuda", torch.bfloat16)
    finally:
        del hog
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_cuda_runner_gets_a_kv_budget_from_free_memory(checkpoint):
    """A GPU runner given no budget has one, below what was free after loading."""
    runner = BlockRunner.load(checkpoint, LAYERS, "cuda", torch.bfloat16)
    free, total = torch.cuda.mem_get_info()
    assert 0 < runner.cache.budget_bytes <= free - memory.headroom(total) + runner.cache.nbytes() + (64 << 20)
