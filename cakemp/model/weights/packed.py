"""f32 weight matrices kept also packed for MKL's GEMM, so that a batch of decode steps costs little more than one.

A step of B sessions multiplies [B, H] activations by each weight. For small B (3 to ~16),
MKL's sgemm spends most of a call packing the weight into its blocked layout (a full read
and write of the matrix) before it computes: on this project's 2-core Xeon (one thread),
[8, 2048] by TinyLlama's four matrices takes 3x the time of one row, though the weights are
read once either way. Packed once at load (cblas_sgemm_pack, reached through the mkl linear
ops torch's inductor uses when it freezes a CPU model), the same products cost 1.6-1.8x one
row, and a 128-token prompt chunk 0.8x its plain time. One row (a lone decode step) is
faster through the plain GEMV, 5-20% over these runs, so both copies are kept: rows <= 2 go
to the plain weight, more to the packed one. That doubles a CPU device's weight memory,
which is why `--max-batch 1` (no batching) packs nothing. bench/batching.py measures the
node; docs/benchmarks.md has the figures.

torch's op is made for one batch size and falls back to the unpacked weight for any other;
MKL's packed layout of the weight does not depend on the batch size, so each call names its
own. That is checked, not assumed: `packing_works` compares packed products of several batch
sizes with F.linear once per process, and weights stay plain if it ever disagrees (or where
torch has no MKL: ARM; or for other dtypes than f32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The batch size the packing is made for (any other is then named per call; see above): the
# default prompt chunk, where packing for fewer rows makes a chunk slower than plain (1.8x at 16).
_PACKED_FOR = 128
# Products of at most this many rows take the plain weight (a GEMV beats the packed GEMM there).
_PLAIN_ROWS = 2


class PackedWeight:
    """A [N, K] f32 CPU matrix, plain and in MKL's packed GEMM layout."""

    def __init__(self, plain: torch.Tensor, packed: torch.Tensor):
        self.plain = plain
        self.packed = packed

    @classmethod
    def create(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACKED_FOR))

    @property
    def shape(self) -> torch.Size:
        return self.plain.shape

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        rows = x.numel() // x.shape[-1]
        if rows <= _PLAIN_ROWS:
            return F.linear(x, self.plain, bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.plain, bias, rows)


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
        for rows in (_PLAIN_ROWS + 1, 8, _PACKED_FOR, 2 * _PACKED_FOR + 1):
            x = torch.randn(1, rows, 80, generator=generator)
            if not torch.allclose(packed.matmul(x), F.linear(x, weight), rtol=1e-5, atol=1e-5):
                return False
    except (RuntimeError, AttributeError):
        return False
    return True
