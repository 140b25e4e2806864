"""The block-scaled FP8 matmul as a Triton kernel, for GPUs whose cuBLAS refuses `F.scaled_mm`'s
block-wise scaling (an H200 with torch 2.11+cu130 does: CUBLAS_STATUS_NOT_SUPPORTED).

It computes what `fp8.emulated_matmul` spells out, out[m, n] = sum over K blocks b of
(x_q[m, b] . w[n, b]) * x_scale[m, b] * scale_inv[n // 128, b]: each K block's e4m3 x e4m3 dot
accumulated in f32, scaled by both blocks' scales, summed in f32, rounded once to the output
dtype. The activation is quantized first by `fp8.quantize_activation` (torch ops: the same
rounding as the emulation's and cuBLAS's path). Nothing in a product syncs with the host or
depends on values, so a captured CUDA graph replays it as it is; its buffers (x_q, x_scale and the
output) come from the graph's pool there. Quantizing the activation inside the kernel, in
registers, would save those two buffers; Triton's interpreter does not compute a dot over e4m3
made in registers as a GPU does (it does over e4m3 loaded from memory), so the kernel that the
CPU tests check is this one.

Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported) runs it on a CPU,
which is how the test suite checks it against the emulation (tests/model/test_fp8_gemm.py); the
interpreter takes Python the compiler refuses, so the suite also compiles it for sm_90 there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakemp.model.weights.fp8 import BLOCK, quantize_activation

# The weight's scale grid's block (128 x 128) inside the kernel: Triton's compiler reads a global in a
# kernel only as a constexpr (its interpreter, the CPU tests', reads any).
_SCALE_BLOCK = tl.constexpr(BLOCK)


@triton.jit
def _kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_xsm, stride_wn, stride_sn, stride_om,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x: [M, K] e4m3, xs: [M, K/128] f32; w: [N, K] e4m3, s: [N/128, K/128] f32; out: [M, N].
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]: N is a multiple of BLOCK_N
    ks = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // BLOCK_K):  # K is a multiple of 128
        k = b * BLOCK_K + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BK]
        x_scale = tl.load(xs_ptr + rows * stride_xsm + b, mask=row_ok, other=0.0)  # [BM]
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None])  # [BK, BN]: W^T's tile
        w_scale = tl.load(s_ptr + (cols // _SCALE_BLOCK) * stride_sn + b)  # [BN]
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x: [M, K] -> x @ W^T: [M, N] in x's dtype; weight: [N, K] e4m3 (N, K multiples of 128),
    scale_inv: [N/128, K/128] f32 (its rows may be strided: a view of a wider grid)."""
    M, K = x.shape
    N = weight.shape[0]
    x_q, x_scale = quantize_activation(x)  # [M, K] e4m3, [M, K/128] f32
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m, block_n = tiles(M)
    grid = (triton.cdiv(M, block_m), N // block_n)
    _kernel[grid](x_q, x_scale, weight, scale_inv, out, M, N, K, x_q.stride(0), x_scale.stride(0), weight.stride(0),
                  scale_inv.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK)
    return out


def tiles(rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a product of `rows` rows: tl.dot takes 16 rows at least (a decode step's one
    row is masked in); narrower tiles along N for few rows, so a weight-bound product spreads over more
    programs."""
    return (16 if rows <= 16 else 64), (64 if rows <= 64 else BLOCK)
