"""f32 weight matrices packed once for MKL's GEMM, so that a batch of decode steps costs little more than one.

A step of B sessions multiplies [B, H] activations by each weight. For small B (3 to ~16),
MKL's sgemm spends most of a call packing the weight into its blocked layout (a full read
and write of the matrix) before it computes: on this project's 2-core Xeon, [8, 2048] x
[2048, 11264] takes 2.9x the time of one row, though the weight is read once either way.
Packed once at load (cblas_sgemm_pack, reached through the mkl linear ops torch's inductor
uses when it freezes a CPU model), the same product costs 1.6-2x one row, and one row costs
no more than before (bench/batching.py measures the node; docs/benchmarks.md has figures).

torch's op is made for one batch size and falls back to the unpacked weight for any other;
MKL's packed layout of the weight does not depend on the batch size, so each call names its
own. That is checked, not assumed: `packing_works` compares packed products of several batch
sizes with F.linear once per process, and weights stay plain if it ever disagrees (or where
torch has no MKL: ARM, non-f32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The batch size the packing is made for (any other is then named per call; see above).
_PACKED_FOR = 16


class PackedWeight:
    """A [N, K] f32 CPU matrix in MKL's packed GEMM layout (the plain copy is not kept)."""

    def __init__(self, packed: torch.Tensor, shape: torch.Size):
        self.packed = packed
        # torch's op reads only the shape of the plain weight it would fall back to: a zero-stride stand-in.
        self._shape_only = torch.empty(1, 1).expand(shape)

    @classmethod
    def create(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACKED_FOR), weight.shape)

    @property
    def shape(self) -> torch.Size:
        return self._shape_only.shape

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        rows = x.numel() // x.shape[-1]
        return torch.ops.mkl._mkl_linear(x, self.packed, self._shape_only, bias, rows)


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
