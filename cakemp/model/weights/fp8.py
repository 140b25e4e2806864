"""Block-wise FP8 (e4m3) weights, as DeepSeek-V3 / Qwen3-FP8 checkpoints store them: the stored
form (`StoredFp8`, a model/weights/quantized.QuantizedParts: P.weight e4m3 beside P.weight_scale_inv,
checkpoint/quantization.Fp8Parts) and the kept one ("fp8", beside int4 and int8: model/weights/kept.py).

Two ways to compute with them:
* kept as FP8 (`Fp8Weight`, half the bytes of bf16) where a GPU multiplies e4m3: each product
  quantizes the activation per token and 128 columns (DeepSeek's recipe) and runs a block-scaled
  matmul (1x128 activation blocks by 128x128 weight blocks, f32 accumulation): cuBLAS's
  (`F.scaled_mm`), or where cuBLAS refuses it the Triton kernel (fp8_gemm.py). `gemm` picks one per
  device and compute dtype at start-up, by trying each on the device against `emulated_matmul`,
  and logs its choice; with neither, the weights are dequantized;
* dequantized on load (`dequantize`) to the compute dtype everywhere else.
`emulated_matmul` is the scaled matmul's arithmetic in plain f32, the reference both for the
CPU tests and for the GPU check. Kept, a product is within the activation's e4m3 rounding of the
dequantized one: sum_k |x_k - q(x_k)| |w_k|, each |x - q(x)| at most 2^-4 |x| (3 mantissa bits)
or 2^-10 of its group's scale among e4m3's subnormals (tests/model/test_fp8.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cakemp import log
from cakemp.checkpoint import resident
from cakemp.checkpoint.fp8 import Fp8Parts
from cakemp.checkpoint.stored import Shape

KERNEL = resident.FP8
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = resident.FP8_BLOCK  # the only block size the scaled matmuls take (weights 128x128, activations 1x128)
SCALED_MM = "cuBLAS scaled_mm"
TRITON = "Triton block-scaled kernel"


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight: [..., M, N] float8_e4m3fn, scale_inv: [..., ceil(M/bm), ceil(N/bn)] -> [..., M, N] f32.

    Element (i, j) is weight[i, j] * scale_inv[i // bm, j // bn], in f32 (leading dims, such as
    the expert axis of fused MoE weights, index matrices scaled on their own). Sides that are not
    multiples of the block size end in a partial block that uses its block's scale (Cake's
    reshape-based dequant refuses those matrices).
    """
    *lead, rows, cols = weight.shape
    bm, bn = block
    scale = scale_inv.float()
    if scale.shape != (*lead, -(-rows // bm), -(-cols // bn)):
        raise ValueError(f"scale_inv shape {tuple(scale.shape)} does not cover a {rows}x{cols} weight in {bm}x{bn} blocks")
    # Expand each scale over its block, then cut the partial last blocks to the weight's sides.
    scale = scale.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return weight.float() * scale


@dataclass(frozen=True)
class Fp8Weight:
    """An [N, K] e4m3 weight kept as stored, multiplied by the block-scaled matmul.

    N and K are multiples of 128. Its scales are held once, as [N/128, L] f32 with L = K/128 rounded
    up to 4: `scale_b` is that grid transposed, as cuBLAS's matmul takes it, `scale_inv` its first
    K/128 columns, the stored grid, as the Triton kernel and the emulation read it.
    """

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [N/128, K/128] f32, a view (rows L apart)
    scale_b: torch.Tensor  # [L, N/128] f32, a transposed view

    @classmethod
    def create(cls, weight: torch.Tensor, scale_inv: torch.Tensor) -> Fp8Weight:
        rows, cols = weight.shape
        if rows % BLOCK or cols % BLOCK or scale_inv.shape != (rows // BLOCK, cols // BLOCK):
            raise ValueError(
                f"a {rows}x{cols} weight with scales {tuple(scale_inv.shape)} is not in {BLOCK}x{BLOCK} blocks"
            )
        padded = -(-scale_inv.shape[1] // 4) * 4
        grid = F.pad(scale_inv.float(), (0, padded - scale_inv.shape[1]))  # [N/128, L]
        return cls(weight.contiguous(), grid[:, :scale_inv.shape[1]], grid.t())

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """The e4m3 codes and the one padded scale grid (checkpoint/resident.fp8_bytes)."""
        return self.weight.nbytes + self.scale_b.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> x @ W^T: [..., N] in x's dtype, by the block-scaled matmul `gemm` picked for
        this device and dtype (the loader keeps a weight FP8 only where it picked one)."""
        flat = x.reshape(-1, x.shape[-1])
        if gemm(x.device, x.dtype) == TRITON:
            out = _triton().matmul(flat, self.weight, self.scale_inv)
        else:
            out = self._scaled_mm(flat)
        return out.view(*x.shape[:-1], self.weight.shape[0])

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] -> [M, N] by cuBLAS's block-scaled matmul."""
        x_q, x_scale = quantize_activation(x)
        return F.scaled_mm(
            x_q, self.weight.t(),
            x_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,  # [M, K/128], column-major
            self.scale_b, F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        )


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (K a multiple of 128) -> (x_q [M, K] e4m3, scale [M, K/128] f32), x ~ x_q * scale
    per 128-column group: each group's largest magnitude maps to 448."""
    M, K = x.shape
    groups = x.float().view(M, K // BLOCK, BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, K/128]
    x_q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_q.view(M, K), scale


def emulated_matmul(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """What `Fp8Weight.matmul` computes, in f32: x: [M, K] -> [M, N].

    out[m, n] = sum over K blocks b of (x_q[m, b] . w[n, b]) * x_scale[m, b] * scale_inv[n // 128, b].
    """
    x_q, x_scale = quantize_activation(x)
    w_scale = weight.scale_inv.repeat_interleave(BLOCK, dim=0)  # [N, K/128]
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for b in range(x_scale.shape[1]):
        columns = slice(b * BLOCK, (b + 1) * BLOCK)
        partial = x_q[:, columns].float() @ weight.weight[:, columns].float().t()  # [M, N]
        out += partial * x_scale[:, b, None] * w_scale[None, :, b]
    return out


def scaled_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device runs cuBLAS's block-scaled FP8 matmul with `dtype` output and matches its
    emulation (tried, not inferred from the compute capability: torch builds and cuBLAS versions
    differ; an H200 with torch 2.11+cu130 refuses it). Never on a CPU."""
    return device.type == "cuda" and hasattr(F, "scaled_mm") and _works(SCALED_MM, device, dtype)


def gemm(device: torch.device, dtype: torch.dtype) -> str | None:
    """The block-scaled matmul FP8 weights are kept for on `device` computing in `dtype`: cuBLAS's
    where it works, else the Triton kernel where it does, else None (they are dequantized); each tried
    on the device, the choice logged once. Never on a CPU (Triton's interpreter is for tests)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _gemm(device, dtype)


@functools.cache
def _gemm(device: torch.device, dtype: torch.dtype) -> str | None:
    chosen = None
    if device.type == "cuda":
        chosen = SCALED_MM if scaled_mm_works(device, dtype) else TRITON if _works(TRITON, device, dtype) else None
    if device.type != "cpu":
        # None on a GPU doubles FP8 weights' memory: a warning (each kernel's reason was logged as it was tried).
        logger = log.get_logger()
        (logger.info if chosen else logger.warning)("fp8 matmul", device=str(device), dtype=str(dtype).removeprefix(
            "torch."), kernel=chosen or "none: FP8 weights dequantized")
    return chosen


@functools.cache
def _works(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `kernel` runs on this device with `dtype` activations and matches the emulation, for a
    decode step and a ragged prefill (any failure to import, compile or run it is a no)."""
    generator = torch.Generator().manual_seed(0)
    weight = Fp8Weight.create(
        (torch.randn(256, 384, generator=generator) * 64).to(torch.float8_e4m3fn).to(device),
        (torch.rand(2, 3, generator=generator) / 64 + 1e-3).to(device),
    )
    try:
        for rows in (1, 5):
            x = torch.randn(rows, 384, generator=generator).to(device, dtype)
            got = (weight._scaled_mm(x) if kernel == SCALED_MM else
                   _triton().matmul(x, weight.weight, weight.scale_inv)).float()
            expected = emulated_matmul(x, weight)
            tolerance = dict(rtol=16 * torch.finfo(dtype).eps, atol=1e-3 * expected.abs().max().item())
            if not torch.allclose(got, expected, **tolerance):
                return False
    except Exception as exc:  # a kernel that cannot be imported, compiled or run here, for any reason, is not used
        log.get_logger().info("fp8 matmul unavailable", kernel=kernel, device=str(device),
                              reason=f"{type(exc).__name__}: {str(exc)[:200]}")
        return False
    return True


def _triton():
    """The Triton kernel's module, imported only where it is tried (a GPU device): Triton's import is slow."""
    from cakemp.model.weights import fp8_gemm

    return fp8_gemm


class StoredFp8(NamedTuple):
    """One FP8 weight read from its stored parts (a model/weights/quantized.QuantizedParts)."""

    parts: Fp8Parts

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return dequantize(stored[self.parts.weight], stored[self.parts.scale_inv], self.parts.block)

    def kept_shape(self, shape: Callable[[str], Shape], tensor: Callable[[str], torch.Tensor]) -> Fp8Shape | str:
        """Its Fp8Shape where the FP8 matmuls take it (the parts' kept_form: 128x128 blocks), else why not."""
        form = self.parts.kept_form(shape)
        return form if isinstance(form, str) else Fp8Shape(form.rows, form.cols)

    def kept_parts(self, stored: Mapping[str, torch.Tensor]) -> Fp8Codes:
        weight = stored[self.parts.weight]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"stored as {weight.dtype}, not float8_e4m3fn (the FP8 matmuls' input)")
        return Fp8Codes(weight, stored[self.parts.scale_inv].float())


class Fp8Shape(NamedTuple):
    """What a matrix kept FP8 is, known from a checkpoint's headers: [rows, cols], in 128x128 blocks."""

    rows: int
    cols: int

    kernel = KERNEL
    order = None  # FP8 keeps the inputs in their order

    @property
    def nbytes(self) -> int:
        return resident.fp8_bytes(self.rows, self.cols)

    @staticmethod
    def fuse_reason(shapes: list[Fp8Shape]) -> str | None:
        """None: matrices in whole 128-row blocks stack along the outputs, their scale grids with them."""
        return None


@dataclass(frozen=True)
class Fp8Codes:
    """An [N, K] FP8 weight as stored (e4m3 and its [N/128, K/128] block scales), not yet laid out."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [N/128, K/128] f32

    @staticmethod
    def cat(parts: list[Fp8Codes]) -> Fp8Codes:
        """Matrices of one K, each of whole 128-row blocks, stacked along the outputs (fused q/k/v, gate/up)."""
        if len({p.weight.shape[1] for p in parts}) != 1:
            raise ValueError("FP8 matrices stacked together need one input size")
        return Fp8Codes(torch.cat([p.weight for p in parts]), torch.cat([p.scale_inv for p in parts]))

    def kept(self) -> Fp8Weight:
        return Fp8Weight.create(self.weight, self.scale_inv)
