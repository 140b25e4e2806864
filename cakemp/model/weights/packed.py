"""f32 weight matrices kept in MKL's packed GEMM layout instead of plain, where that layout costs
little more memory, so that a batch of decode steps costs little more than one.

A step of B sessions multiplies [B, H] activations by each weight. For small B, MKL's sgemm
spends much of a call packing the weight into its blocked layout (a full read and write of the
matrix) before it computes. Packed once at load (cblas_sgemm_pack, reached through the mkl
linear ops torch's inductor uses when it freezes a CPU model), it skips that; one row goes
through the packed GEMM too, so the plain matrix is not kept. Four TinyLlama-shaped layers in
one process (one thread) took, packed against plain, 0.90x the time of a decode step alone,
0.85x that of a step of 8 sessions and 0.82x that of a 128-token chunk (docs/benchmarks.md,
Packed weights).

MKL's packed buffer holds a part of its own of about 5.3 MiB whatever the matrix's size, plus
padding: 22x a [256, 256] matrix's bytes, 1.12-1.38x TinyLlama's, 1.05-1.13x Llama-3-8B's. So a
matrix is kept packed only where that is at most MAX_GROWTH times its plain bytes, and plain
otherwise: a node's f32 weights never hold more than 1.1x their plain bytes.

torch's op is made for one batch size and falls back to the plain weight for any other; MKL's
packed layout of the weight does not depend on the batch size, so each call names its own and
the fallback is never taken. That is checked, not assumed: `packing_works` compares packed
products of several batch sizes with F.linear once per process, and weights stay plain if it
ever disagrees (or where torch has no MKL: ARM; or for other dtypes than f32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The batch size the packing is made for (any other is then named per call; see above).
_PACKED_FOR = 128
# A matrix is kept packed where its packed buffer holds at most this many times its plain bytes.
MAX_GROWTH = 1.1


class PackedWeight:
    """A [N, K] f32 CPU matrix in MKL's packed GEMM layout (the plain matrix is not kept)."""

    def __init__(self, packed: torch.Tensor, shape: torch.Size):
        self.packed = packed
        self.shape = shape

    @classmethod
    def create(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACKED_FOR), weight.shape)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        rows = x.numel() // x.shape[-1]
        return torch.ops.mkl._mkl_linear(x, self.packed, _unread_weight(*self.shape), bias, rows)


@functools.cache
def _unread_weight(rows: int, cols: int) -> torch.Tensor:
    """What _mkl_linear takes as the plain weight, which it reads only for a batch size other than the
    one it is told (never, here): a [rows, cols] view of one zero, 4 bytes."""
    return torch.zeros(()).expand(rows, cols)


def packed_or_plain(weight: torch.Tensor) -> PackedWeight | torch.Tensor:
    """`weight` (a packable matrix) packed, where that costs at most MAX_GROWTH times its bytes; else itself."""
    packed = PackedWeight.create(weight)
    return packed if packed.packed.nbytes <= MAX_GROWTH * weight.nbytes else weight


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed here: an f32 matrix on the CPU, where packing works."""
    return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu" and packing_works()


@functools.cache
def packing_works() -> bool:
    """MKL is there, and packed products of several batch sizes equal F.linear's (to f32 rounding)."""
    if not torch.backends.mkl.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=generator)
    try:
        packed = PackedWeight.create(weight)
        for rows in (1, 3, 8, _PACKED_FOR, 2 * _PACKED_FOR + 1):
            x = torch.randn(1, rows, 80, generator=generator)
            if not torch.allclose(packed.matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5):
                return False
    except (RuntimeError, AttributeError):
        return False
    return True
