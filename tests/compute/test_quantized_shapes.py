"""Quantized weights whose parts claim a matrix config.json does not imply: refused by name from the
shards' headers, before any value is dequantized.

Dequantized first, such a weight would cost its matrix in f32 (8 times the bytes of its 4-bit codes)
before the check after loading saw it. Each load runs in a process of its own, whose peak resident
memory (ru_maxrss) is read before and after: the claimed matrix, 256 MiB in f32, never appears.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import make_checkpoint
from tests.support.quantized import GptqSpec, gptq_part_shapes, gptq_shaped, mlx_checkpoint, needs_mlx

HUGE = 8192  # the claimed matrix: [8192, 8192], 256 MiB in f32, 32 MiB of 4-bit codes
LAYER = "model.layers.1"
MODULE = f"{LAYER}.mlp.down_proj"  # config.json implies [64, 128]
LOAD = """
import json, resource, sys
import torch
from cakemp.compute.runner import BlockRunner
from cakemp.errors import CheckpointError
layer = sys.argv[1]
for path in sys.argv[2:]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        BlockRunner.load(path, [layer], "cpu", torch.float32)
        error = None
    except CheckpointError as e:
        error = str(e)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print("outcome", json.dumps({"error": error, "grown": grown}), flush=True)
"""


def load_in_a_process(*paths):
    """Load LAYER of each of `paths` in turn, in one fresh process: per path (its CheckpointError's text or
    None, the growth of the process's peak RSS during that load, in bytes). The peak only rises, so a path
    whose growth matters goes first."""
    result = subprocess.run([sys.executable, "-c", LOAD, LAYER, *map(str, paths)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # The loader may log to stdout too: the outcomes are the lines the script marked.
    outcomes = [json.loads(line.removeprefix("outcome ")) for line in result.stdout.splitlines()
                if line.startswith("outcome ")]
    assert len(outcomes) == len(paths), result.stdout[-3000:]
    return [(outcome["error"], outcome["grown"]) for outcome in outcomes]


def rewritten(path, replace):
    """`path`'s one model.safetensors with `replace(tensors)`'s tensors written over it."""
    tensors = load_file(path / "model.safetensors")
    save_file(tensors | replace(tensors), path / "model.safetensors")
    return path


@pytest.mark.parametrize("desc_act", [False, True])
def test_a_gptq_weight_claiming_a_huge_matrix_is_refused_by_name_before_it_is_dequantized(tmp_path, desc_act):
    """down_proj's qweight, qzeros, scales (and g_idx) agree with each other on [8192, 8192]; config.json
    implies [64, 128]: a CheckpointError naming the weight and both shapes, and the process's peak memory
    grows by far less than the matrix's 256 MiB. The same checkpoint with the config's shape loads."""
    spec = GptqSpec("llama", bits=4, group_size=32, desc_act=desc_act)
    path = gptq_shaped(tmp_path / "bad", "llama", spec, shapes={MODULE: (HUGE, HUGE)})
    (error, grown), (good, _) = load_in_a_process(path, gptq_shaped(tmp_path / "good", "llama", spec))
    assert good is None
    assert error is not None and f"{MODULE}.weight ({HUGE}, {HUGE})" in error and "(64, 128)" in error
    assert grown < (HUGE * HUGE * 4) // 8


def test_gptq_scales_that_claim_more_than_the_qweight_holds_are_refused_naming_the_qweight(tmp_path):
    """scales and g_idx claim [8192, 8192] over the config's qweight: the qweight is named, nothing read."""
    spec = GptqSpec("llama", bits=4, group_size=32, desc_act=True)
    claimed = gptq_part_shapes(HUGE, HUGE, 4, 32, desc_act=True)
    path = rewritten(gptq_shaped(tmp_path, "llama", spec), lambda _: {
        f"{MODULE}.scales": torch.ones(claimed["scales"], dtype=torch.float16),
        f"{MODULE}.g_idx": torch.zeros(claimed["g_idx"], dtype=torch.int32)})
    [(error, grown)] = load_in_a_process(path)
    assert error is not None and error.startswith(f"{MODULE}.qweight has shape")
    assert grown < (HUGE * HUGE * 4) // 8


@needs_mlx
def test_an_mlx_weight_claiming_a_huge_matrix_is_refused_by_name_before_it_is_dequantized(tmp_path):
    """An MLX checkpoint (mx.quantize's) whose down_proj weight, scales and biases agree on [8192, 8192]:
    refused naming the weight, the peak memory far below the matrix's; scales alone claiming more rows
    than the weight has: refused naming the scales."""
    path, _ = mlx_checkpoint(tmp_path / "huge", "llama", bits=4, group_size=32)
    rewritten(path, lambda t: {f"{MODULE}.weight": torch.zeros(HUGE, HUGE * 4 // 32, dtype=torch.uint32),
                               **{f"{MODULE}.{p}": torch.ones(HUGE, HUGE // 32, dtype=torch.bfloat16)
                                  for p in ("scales", "biases")}})
    scales, _ = mlx_checkpoint(tmp_path / "scales", "llama", bits=4, group_size=32)
    rewritten(scales, lambda t: {f"{MODULE}.scales": torch.ones(HUGE, 4, dtype=torch.bfloat16)})
    (error, grown), (scales_error, _) = load_in_a_process(path, scales)
    assert error is not None and f"{MODULE}.weight ({HUGE}, {HUGE})" in error and "(64, 128)" in error
    assert grown < (HUGE * HUGE * 4) // 8
    assert scales_error is not None and scales_error.startswith(f"{MODULE}.scales has shape")


def test_an_fp8_weight_claiming_a_huge_matrix_is_refused_by_name_before_it_is_dequantized(tmp_path):
    """An FP8 checkpoint (e4m3 in 128x128 blocks, f32 scales) whose down_proj weight is [8192, 8192]
    with scales to match (64 MiB stored), config.json implying [64, 128]: refused naming the weight and
    both shapes before dequantization (which costs 12 bytes per stored byte), the process's peak memory
    far below the stored weight's f32 matrix. The honest checkpoint loads."""
    good = make_checkpoint(tmp_path / "good", "llama", fp8_block=(128, 128))
    path = make_checkpoint(tmp_path / "bad", "llama", fp8_block=(128, 128))
    rewritten(path, lambda _: {f"{MODULE}.weight": torch.zeros(HUGE, HUGE, dtype=torch.float8_e4m3fn),
                               f"{MODULE}.weight_scale_inv": torch.ones(HUGE // 128, HUGE // 128)})
    (error, grown), (good_error, _) = load_in_a_process(path, good)
    assert good_error is None
    assert error is not None and f"{MODULE}.weight ({HUGE}, {HUGE})" in error and "(64, 128)" in error
    assert "\n" not in error and grown < HUGE * HUGE * 4 // 4


def test_an_act_order_gptq_weight_of_more_groups_than_its_inputs_make_is_refused_naming_the_scales(tmp_path):
    """A 2-bit act-order down_proj (128 inputs in groups of 32: 4 groups) whose scales and qzeros carry
    2^20 groups (u8 would do; here f16, 80 MiB of parts) with every g_idx 0: the matrix has the config's
    shape, so only the group count tells. Refused naming the scales, before the zero points are unpacked."""
    spec = GptqSpec("llama", bits=2, group_size=32, desc_act=True)
    good = gptq_shaped(tmp_path / "good", "llama", spec)
    path = gptq_shaped(tmp_path / "bad", "llama", spec)
    groups = 1 << 20
    rewritten(path, lambda tensors: {
        f"{MODULE}.scales": torch.ones(groups, 64, dtype=torch.float16),
        f"{MODULE}.qzeros": torch.zeros(groups, tensors[f"{MODULE}.qzeros"].shape[1], dtype=torch.int32)})
    (error, grown), (good_error, _) = load_in_a_process(path, good)
    assert good_error is None
    assert error is not None and error.startswith(f"{MODULE}.scales: {groups} groups of scales for 128 inputs")
    assert "\n" not in error and grown < groups * 64 * 4
