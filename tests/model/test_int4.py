"""4-bit weights kept int4 (model/weights/int4.py): each format's codes, scales and zeros rewritten into
torch's int4 convention, checked with torch's own CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
which takes the CUDA kernel's scales_and_zeros convention) against x @ W^T with W the project's
dequantization of the same stored tensors (itself checked against GPTQModel, MLX and gguf-py:
tests/model/test_gptq.py, test_mlx.py, test_ggml.py). The activations are bf16 and the kernel
rounds its scales and zeros to bf16, so the bound is bf16's: eps times the largest output.

Which matrices stay int4 (4-bit, equal groups of 32..256 inputs; GPTQ act-order's by sorting its
inputs by group) and which are dequantized; the loaders' int4 path on the CPU's kernel; on a GPU (pytest -m gpu), the CUDA
kernel through the same conversions and a BlockRunner that keeps them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.quantization import Gptq, MlxParts
from cakemp.checkpoint.resident import KeptForm
from cakemp.compute.runner import BlockRunner
from cakemp.model.linear import linear
from cakemp.model.weights import ggml, gptq, int4, int8, mlx
from cakemp.model.weights.gguf import GgufCheckpoint
from cakemp.model.weights.safetensors import Checkpoint
from tests.support.gguf_files import RANDOM_BLOCKS, GgufSpec, needs_gguf, random_blocks, write_gguf
from tests.support.int4_checkpoints import GROUPS, LAYER, random_gptq, random_mlx

OUT, IN = 96, 512
BF16_EPS = torch.finfo(torch.bfloat16).eps
KERNELS = frozenset({int4.KERNEL, int8.KERNEL})  # what a CPU keeps (compute/loading.kept_kernels)


def _words(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64).to(torch.int32)


def assert_product_matches(parts: int4.Int4Parts, weight: torch.Tensor, device: str = "cpu") -> None:
    """The int4 kernel on `parts` against x @ weight^T in f32 (x bf16): within bf16's eps of the largest output."""
    order = None if parts.order is None else parts.order.to(device)
    kept = int4.Int4Weight.create(int4.Int4Parts(parts.codes.to(device), parts.scales.to(device),
                                                 parts.zeros.to(device), parts.group_size, order))
    for rows in (1, 7):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        expected = x.float() @ weight.float().t()
        got = linear(x.to(device), kept).float().cpu()
        assert (got - expected).abs().max() <= BF16_EPS * expected.abs().max()


def gptq_tensors(group_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    groups = IN // group_size
    return (_words(generator, IN // 8, OUT), _words(generator, groups, OUT // 8),
            (torch.rand(groups, OUT, generator=generator) / 64 + 1e-3).half())


def mlx_tensors(group_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scales = (torch.rand(OUT, IN // group_size, generator=generator) / 64).bfloat16()
    biases = (torch.randn(OUT, IN // group_size, generator=generator) / 8).bfloat16()
    return _words(generator, OUT, IN // 8).view(torch.uint32), scales, biases


def ggml_bytes(kind: str) -> torch.Tensor:
    """[OUT, IN] of `kind` as stored: quantized by gguf-py where it can (Q4_0, Q4_1), else random
    blocks with finite scales (Q4_K: tests/support/gguf_files.py)."""
    import gguf

    rng = np.random.default_rng(1)
    if kind in RANDOM_BLOCKS:
        raw = random_blocks(rng, kind, (OUT, IN))
    else:
        values = (0.05 * rng.standard_normal((OUT, IN))).astype(np.float32)
        values[0, :64] = 0  # all-zero blocks (scale 0)
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(raw.view(np.uint8).reshape(-1).copy())


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_gptq_codes_through_the_int4_kernel_give_the_dequantized_product(group_size, v1):
    spec = Gptq(4, group_size, False, False, v1)
    qweight, qzeros, scales = gptq_tensors(group_size)
    assert gptq.int4_group(spec, OUT, IN, IN // group_size, torch.arange(IN) // group_size) == group_size
    assert_product_matches(gptq.int4_parts(qweight, qzeros, scales, None, spec, group_size),
                           gptq.dequantize(qweight, qzeros, scales, None, spec))


@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_act_order_codes_sorted_by_group_give_the_dequantized_product(group_size):
    """g_idx puts the inputs in groups out of order: the kept weight's columns are sorted by group
    and each product gathers x's inputs in that order (its `order`), against x @ W^T of W
    dequantized through g_idx."""
    spec = Gptq(4, group_size, True, False, True)
    qweight, qzeros, scales = gptq_tensors(group_size)
    g_idx = (torch.randperm(IN, generator=torch.Generator().manual_seed(3)) // group_size).to(torch.int32)
    assert gptq.int4_group(spec, OUT, IN, IN // group_size, g_idx) == group_size
    parts = gptq.int4_parts(qweight, qzeros, scales, g_idx, spec, group_size)
    assert parts.order is not None and torch.equal(g_idx[parts.order].long(), torch.arange(IN) // group_size)
    assert_product_matches(parts, gptq.dequantize(qweight, qzeros, scales, g_idx, spec))
    in_order = gptq.int4_parts(qweight, qzeros, scales, torch.arange(IN) // group_size, spec, group_size)
    assert in_order.order is None  # a g_idx in input order needs no gather


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_mlx_codes_through_the_int4_kernel_give_the_dequantized_product(group_size):
    weight, scales, biases = mlx_tensors(group_size)
    assert MlxParts("w", "s", "b", 4, group_size).kept_form({"w": tuple(weight.shape)}.__getitem__) == \
        KeptForm("int4", OUT, IN, group_size)
    assert_product_matches(mlx.int4_parts(weight, scales, biases, group_size),
                           mlx.dequantize(weight, scales, biases, 4, group_size))


@needs_gguf
@pytest.mark.parametrize("kind", ggml.INT4_TYPES)
def test_gguf_4_bit_blocks_through_the_int4_kernel_give_the_dequantized_product(kind):
    raw = ggml_bytes(kind)
    assert ggml.int4_group(kind, (OUT, IN)) == 32
    assert_product_matches(ggml.int4_parts(raw, kind, (OUT, IN)), ggml.dequantize(raw, kind, (OUT, IN)))


def test_what_torch_s_int4_kernel_cannot_take_is_dequantized():
    """A g_idx whose groups differ in size, other widths, one group over all inputs or groups of
    other sizes, stacked experts, other ggml types: each answered with the reason, never converted."""
    in_order = torch.arange(IN) // 128
    uneven = in_order.clone()
    uneven[127] = 1  # groups of 127, 129, 128, 128 inputs
    assert "unequal size (not 128" in gptq.int4_group(Gptq(4, 128, True, True, True), OUT, IN, 4, uneven)
    assert "8-bit" in gptq.int4_group(Gptq(8, 128, False, True, True), OUT, IN, 4, in_order)
    assert "groups of 512" in gptq.int4_group(Gptq(4, -1, False, True, True), OUT, IN, 1, None)
    assert "groups of 16" in gptq.int4_group(Gptq(4, 16, False, True, True), OUT, IN, 32, None)
    assert "unequal" in gptq.int4_group(Gptq(4, 128, False, True, True), OUT, 320, 3, None)  # 128 + 128 + 64
    assert "no multiple of 16" in gptq.int4_group(Gptq(4, 128, False, True, True), 100, IN, 4, None)
    assert "8-bit" in MlxParts("w", "s", "b", 8, 64).kept_form({"w": (OUT, IN // 4)}.__getitem__)
    assert "stacked" in MlxParts("w", "s", "b", 4, 64).kept_form({"w": (4, OUT, IN // 8)}.__getitem__)
    for kind in ("Q5_K", "Q8_0", "IQ4_NL"):  # IQ4_NL: 4-bit codes, but into a table of 16 levels, not affine
        assert kind in ggml.int4_group(kind, (OUT, IN))
    with pytest.raises(ValueError, match="groups of 16"):
        int4.Int4Weight.create(int4.Int4Parts(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 4),
                                              torch.zeros(8, 4), 16))


def test_the_kernel_check_passes_on_the_cpu_s_own_kernel():
    assert int4.kernel_works(torch.device("cpu"))


def assert_loaded_int4(checkpoint, kept_keys: set[str], form: type = int4.Int4Weight) -> None:
    """`load(kernels=KERNELS)` (a CPU's) keeps exactly `kept_keys` quantized, as `form`, each multiplying
    as its dequantized load does, and `nbytes` counts what it holds."""
    kept = checkpoint.load(GROUPS, torch.device("cpu"), torch.bfloat16, kernels=KERNELS)
    plain = checkpoint.load(GROUPS, torch.device("cpu"), torch.float32)
    assert {key for key, w in kept.items() if not isinstance(w, torch.Tensor)} == kept_keys
    for key in kept_keys:
        assert isinstance(kept[key], form), key
        x = torch.randn(3, plain[key].shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        expected = x.float() @ plain[key].t()
        assert (linear(x, kept[key]).float() - expected).abs().max() <= BF16_EPS * expected.abs().max(), key
    held = sum(w.nbytes for w in kept.values())
    assert checkpoint.nbytes(GROUPS, torch.bfloat16, kernels=KERNELS) == held
    assert checkpoint.nbytes(GROUPS, torch.bfloat16) == sum(w.numel() * 2 for w in plain.values())


@pytest.mark.parametrize("group_size", [32, 64])
def test_a_gptq_checkpoint_keeps_its_fused_matrices_int4(tmp_path, plain, group_size):
    path = random_gptq(tmp_path / "gptq", plain, group_size)
    assert_loaded_int4(Checkpoint(path, ModelConfig.from_dir(path)), {"w_qkv", "w_gate_up", "w_down"})


def test_an_act_order_gptq_checkpoint_keeps_its_matrices_int4_with_their_input_order(tmp_path, plain):
    """q/k/v and gate/up share their layer input's order (as GPTQ's act-order gives them): each fused
    weight is kept with that one order, and counted with it."""
    path = random_gptq(tmp_path / "gptq", plain, 32, desc_act=True)
    checkpoint = Checkpoint(path, ModelConfig.from_dir(path))
    assert_loaded_int4(checkpoint, {"w_qkv", "w_gate_up", "w_down"})
    kept = checkpoint.load(GROUPS, torch.device("cpu"), torch.bfloat16, kernels=KERNELS)
    assert all(kept[key].order is not None for key in ("w_qkv", "w_gate_up", "w_down"))


def test_act_order_matrices_fused_in_different_input_orders_are_dequantized(tmp_path, plain):
    """One gather cannot serve q, k and v in three orders: the fused groups are dequantized, down_proj
    (alone in its group) kept."""
    path = random_gptq(tmp_path / "gptq", plain, 32, desc_act=True, order_per_matrix=True)
    assert_loaded_int4(Checkpoint(path, ModelConfig.from_dir(path)), {"w_down"})


def test_an_mlx_checkpoint_keeps_4_bit_matrices_int4_and_8_bit_ones_of_one_group_a_row_int8(tmp_path, plain):
    """In groups of 64, the 8-bit q/k/v and gate/up (64 inputs) are one group a row: kept int8;
    down_proj (128 inputs, two groups a row) is dequantized."""
    four = random_mlx(tmp_path / "mlx4", plain, 64)
    assert_loaded_int4(Checkpoint(four, ModelConfig.from_dir(four)), {"w_qkv", "w_gate_up", "w_down"})
    eight = random_mlx(tmp_path / "mlx8", plain, 64, bits=8)
    assert_loaded_int4(Checkpoint(eight, ModelConfig.from_dir(eight)), {"w_qkv", "w_gate_up"}, int8.Int8Weight)


@needs_gguf
def test_a_gguf_file_keeps_q4_0_and_q4_1_int4_with_llama_s_rows_unpermuted(tmp_path):
    """attn_q and attn_k are stored in llama.cpp's row order: kept int4, their rows are HF's.
    A group with one Q8_0 member (v) is dequantized whole."""
    spec = GgufSpec("llama", types={"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0",
                                    "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1"})
    path = write_gguf(tmp_path / "llama.gguf", spec)
    checkpoint = GgufCheckpoint(path, ModelConfig.from_dir(path))
    assert_loaded_int4(checkpoint, {"w_gate_up", "w_down"})
    q_and_k = {"w_qk": GROUPS["w_qkv"][:2]}
    kept = checkpoint.load(q_and_k, torch.device("cpu"), torch.bfloat16, kernels=KERNELS)["w_qk"]
    weight = checkpoint.load(q_and_k, torch.device("cpu"), torch.float32)["w_qk"]
    assert isinstance(kept, int4.Int4Weight)
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = x.float() @ weight.t()
    assert (linear(x, kept).float() - expected).abs().max() <= BF16_EPS * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_runner_keeps_4_bit_weights_int4_unless_told_to_dequantize(tmp_path, plain, dtype):
    path = random_gptq(tmp_path / "gptq", plain, 32)
    kept = BlockRunner.load(path, [LAYER], "cpu", dtype)
    block = kept.blocks[0]
    assert all(isinstance(w, int4.Int4Weight) for w in (block.w_qkv, block.w_o, block.mlp.w_gate_up, block.mlp.w_down))
    dequantized = BlockRunner.load(path, [LAYER], "cpu", dtype, keep_int4=False)
    assert not isinstance(dequantized.blocks[0].w_qkv, int4.Int4Weight)


@pytest.mark.parametrize("rows", [1, 63, 64, 200])
def test_a_cpu_product_takes_bf16_in_and_gives_the_input_s_dtype_back_through_either_path(rows):
    """Below 64 rows the int4 kernel, from 64 on the tiles dequantized to bf16 (model/weights/int4.py):
    both within bf16's eps of the largest output of the bf16-rounded input times the kernel's weight."""
    generator = torch.Generator().manual_seed(rows)
    parts = int4.Int4Parts(torch.randint(0, 16, (320, IN), generator=generator, dtype=torch.uint8),
                           torch.rand(320, IN // 64, generator=generator) / 64 + 1e-3,
                           torch.randn(320, IN // 64, generator=generator) / 16, 64)
    x = torch.randn(2, rows, IN, generator=generator)
    got = linear(x, int4.Int4Weight.create(parts))
    expected = x.bfloat16().float() @ int4.reference_weight(parts).t()
    assert got.dtype == torch.float32 and got.shape == (2, rows, 320)
    assert (got - expected).abs().max() <= BF16_EPS * expected.abs().max()


@pytest.mark.gpu
def test_torch_s_cuda_int4_kernel_passes_the_check():
    assert int4.kernel_works(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_on_a_gpu_each_format_s_codes_give_the_dequantized_product(group_size):
    spec = Gptq(4, group_size, False, False, True)
    qweight, qzeros, scales = gptq_tensors(group_size)
    assert_product_matches(gptq.int4_parts(qweight, qzeros, scales, None, spec, group_size),
                           gptq.dequantize(qweight, qzeros, scales, None, spec), "cuda")
    weight, scales, biases = mlx_tensors(group_size)
    assert_product_matches(mlx.int4_parts(weight, scales, biases, group_size),
                           mlx.dequantize(weight, scales, biases, 4, group_size), "cuda")


@needs_gguf
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ggml.INT4_TYPES)
def test_on_a_gpu_gguf_4_bit_blocks_give_the_dequantized_product(kind):
    raw = ggml_bytes(kind)
    assert_product_matches(ggml.int4_parts(raw.cuda(), kind, (OUT, IN)), ggml.dequantize(raw, kind, (OUT, IN)), "cuda")


@pytest.mark.gpu
def test_a_gpu_runner_keeps_gptq_int4_and_computes_what_the_dequantized_one_does(tmp_path, plain):
    path = random_gptq(tmp_path / "gptq", plain, 32)
    layers = ["model.layers.0", LAYER]
    kept = BlockRunner.load(path, layers, "cuda", torch.bfloat16)
    dequantized = BlockRunner.load(path, layers, "cuda", torch.bfloat16, keep_int4=False)
    assert isinstance(kept.blocks[0].w_qkv, int4.Int4Weight)
    assert isinstance(dequantized.blocks[0].w_qkv, torch.Tensor)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    ops = [(layer, 0, i) for i, layer in enumerate(layers)]
    ours, theirs = (r.run(1, x, r.ops(ops)).float() for r in (kept, dequantized))
    assert ((ours - theirs).norm() / theirs.norm()).item() < 4 * BF16_EPS


def test_from_64_rows_a_cpu_product_multiplies_the_weight_rounded_to_bf16_and_below_the_kernel_s_exact_one():
    """Which path a CPU product took shows in its result where W = (q - 8) + 1/128 (scale 1, zero
    1/128) is not a bf16 value for |q - 8| >= 2, and x is ones: every sum is exact in f32 (multiples
    of 2^-7 below 2^12), so the kernel (below 64 rows) returns the sum over the f32 W rounded once to
    bf16, and the tiles (from 64 rows) the sum over bf16(W) (their dequantized values) rounded once."""
    generator = torch.Generator().manual_seed(0)
    rows, group = 1088, 64  # 17 blocks of 64 outputs: a full tile and a ragged one
    parts = int4.Int4Parts(torch.randint(0, 16, (rows, IN), generator=generator, dtype=torch.uint8),
                           torch.ones(rows, IN // group), torch.full((rows, IN // group), 2.0**-7), group)
    weight = int4.Int4Weight.create(parts)
    exact = int4.reference_weight(parts)
    for count in (1, 63, 64, 130):
        ones = torch.ones(count, IN)
        got = linear(ones, weight)
        through = exact if count < 64 else exact.bfloat16().float()
        assert torch.equal(got, (ones @ through.t()).bfloat16().float()), count
    assert not torch.equal(exact.sum(1).bfloat16(), exact.bfloat16().float().sum(1).bfloat16())
