"""Block-wise FP8 (e4m3) weights, as DeepSeek-V3 / Qwen3-FP8 checkpoints store them.

Two ways to compute with them:
* kept as FP8 (`Fp8Weight`, half the bytes of bf16): each product quantizes the activation per
  token and 128 columns (DeepSeek's recipe) and runs torch's block-scaled matmul
  (`F.scaled_mm`, 1x128 activation blocks by 128x128 weight blocks, f32 accumulation), where
  the GPU and torch support it (`scaled_mm_works` tries it on the device);
* dequantized on load (`dequantize`) to the compute dtype everywhere else.
`emulated_matmul` is the scaled matmul's arithmetic in plain f32, the reference both for the
CPU tests and for the GPU check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # the only block size the scaled matmul takes (weights 128x128, activations 1x128)


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

    N and K are multiples of 128; `scale_b` is the weight's [N/128, K/128] scale_inv laid out
    as the matmul takes it: a transposed view of [N/128, L] with L = K/128 rounded up to 4.
    """

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [N/128, K/128] f32, as stored
    scale_b: torch.Tensor  # [L, N/128] f32, a transposed view

    @classmethod
    def create(cls, weight: torch.Tensor, scale_inv: torch.Tensor) -> Fp8Weight:
        rows, cols = weight.shape
        if rows % BLOCK or cols % BLOCK or scale_inv.shape != (rows // BLOCK, cols // BLOCK):
            raise ValueError(
                f"a {rows}x{cols} weight with scales {tuple(scale_inv.shape)} is not in {BLOCK}x{BLOCK} blocks"
            )
        scale_inv = scale_inv.float().contiguous()
        padded = -(-scale_inv.shape[1] // 4) * 4
        return cls(weight, scale_inv, F.pad(scale_inv, (0, padded - scale_inv.shape[1])).t())

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> x @ W^T: [..., N] in x's dtype, by the block-scaled matmul."""
        x_q, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]))
        out = F.scaled_mm(
            x_q, self.weight.t(),
            x_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,  # [M, K/128], column-major
            self.scale_b, F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        )
        return out.view(*x.shape[:-1], self.weight.shape[0])


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


@functools.cache
def scaled_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device runs the block-scaled FP8 matmul with `dtype` output and matches its
    emulation (tried, not inferred from the compute capability: torch builds and cuBLAS
    versions differ). Never on a CPU."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = Fp8Weight.create(
        (torch.randn(256, 384, generator=generator) * 64).to(torch.float8_e4m3fn).to(device),
        (torch.rand(2, 3, generator=generator) / 64 + 1e-3).to(device),
    )
    try:
        for rows in (1, 5):  # a decode step and a ragged prefill
            x = torch.randn(rows, 384, generator=generator).to(device, dtype)
            got = weight.matmul(x).float()
            expected = emulated_matmul(x, weight)
            tolerance = dict(rtol=16 * torch.finfo(dtype).eps, atol=1e-3 * expected.abs().max().item())
            if not torch.allclose(got, expected, **tolerance):
                return False
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True
