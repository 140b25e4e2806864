"""The Triton block-scaled FP8 matmul computes the emulation's block formula: on a GPU compiled, on a
CPU through Triton's interpreter (skipped where triton is not installed)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from cakemp.model.weights import fp8, fp8_gemm  # noqa: E402
from tests.support.tolerance import fp8_matmul_bound  # noqa: E402
from tests.support.triton_compile import compile_kernels, require_nvidia_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (tests/conftest.py sets it)", allow_module_level=True)


def fp8_weight(rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(rows // 128, cols // 128, generator=generator) / 64 + 1e-3
    return fp8.Fp8Weight.create(weight.to(DEVICE), scale_inv.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 5, 20, 70], ids=["decode", "ragged", "two-row-tiles", "wide-tiles"])
def test_kernel_matches_the_emulation(rows, dtype):
    """Every output is the emulation's, within the reordering of its f32 sums and one rounding to
    the activation's dtype: the activation is quantized exactly as quantize_activation does."""
    weight = fp8_weight(256, 384, seed=rows)
    x = (torch.randn(rows, 384, generator=torch.Generator().manual_seed(7)) * torch.logspace(-2, 2, 384)).to(
        DEVICE, dtype)
    got = fp8_gemm.matmul(x, weight.weight, weight.scale_inv)
    assert got.dtype == dtype and got.shape == (rows, 256)
    expected, tolerance = fp8_matmul_bound(x, weight, dtype)
    assert ((got.float() - expected).abs() <= tolerance).all()


def test_kernel_reads_strided_scales():
    """The scales may be a view of a wider grid (Fp8Weight pads K/128 to 4 for cuBLAS): the kernel
    steps over the padding rather than reading it."""
    weight = fp8_weight(128, 640, seed=3)  # K/128 = 5 -> rows of 8 in the padded grid
    assert weight.scale_inv.shape == (1, 5) and weight.scale_inv.stride(0) == 8
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    expected, tolerance = fp8_matmul_bound(x, weight, torch.float32)
    got = fp8_gemm.matmul(x, weight.weight, weight.scale_inv)
    assert ((got - expected).abs() <= tolerance).all()


def test_fp8_checkpoint_kept_fp8_multiplies_through_the_kernel_picked(tmp_path, monkeypatch):
    """Where start-up picks the Triton kernel, an FP8 checkpoint's matrices in 128x128 blocks load kept
    (Fp8Weight) and `linear` multiplies by them through it: each product within the kernel's bound of
    the emulation. (On a CPU the pick is forced: a CPU never keeps FP8.)"""
    from cakemp.checkpoint.config import ModelConfig
    from cakemp.model.block import DecoderBlock
    from cakemp.model.linear import linear
    from cakemp.model.weights.safetensors import Checkpoint
    from tests.support.checkpoints import make_checkpoint

    monkeypatch.setattr(fp8, "_gemm", lambda device, dtype: fp8.TRITON)
    path = make_checkpoint(tmp_path, "llama", fp8_block=(128, 128), hidden_size=128, intermediate_size=256)
    config = ModelConfig.from_dir(path)
    groups = {key: [f"model.layers.0.{name}" for name in members]
              for key, members in DecoderBlock.weight_groups(config, 0, lambda name: True).items()}
    weights = Checkpoint(path, config).load(groups, DEVICE, torch.float32, kernels=frozenset({fp8.KERNEL}))
    kept = {key: w for key, w in weights.items() if isinstance(w, fp8.Fp8Weight)}
    assert set(kept) == {"w_o", "w_gate_up", "w_down"}  # q/k/v: k and v have 64 rows, dequantized
    for w in kept.values():
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(9)).to(DEVICE)
        expected, tolerance = fp8_matmul_bound(x, w, torch.float32)
        assert ((linear(x, w) - expected).abs() <= tolerance).all()


def test_the_kernel_compiles_for_hopper_as_a_gpu_compiles_it():
    """The interpreter above runs the kernel's Python; a GPU compiles it, which refuses what the interpreter
    takes (a global that is not a constexpr, say). So each tile shape `matmul` picks, for each activation
    dtype, is compiled here by Triton's own compiler for sm_90 (an H200: where cuBLAS refuses the
    block-scaled product), as far as the GPU's binary (tests/support/triton_compile.py); skipped where
    Triton has no NVIDIA backend."""
    require_nvidia_backend()
    failed = compile_kernels([f"fp8:{rows}:{out}" for rows in (1, 20, 70) for out in ("bf16", "fp16", "fp32")])
    assert not failed, failed
