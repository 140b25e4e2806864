"""How close an output must be to its oracle: bounds set from the observed error, with a stated margin.

Every bound is relative to the largest magnitude of the reference output (`rel_error`), so it
does not depend on how large the hidden state happens to grow over a few random layers.

* f32: 2e-6. cakemp and HF transformers do the same arithmetic, differently fused; the
  observed error is 3-6e-7 over the families of tests/compute/test_runner_parity.py, so this
  leaves a ~3x margin and no room for a real bug: a 10x larger rms_norm epsilon already moves
  the output by ~5e-6.
* f32 through Qwen3.5's linear-attention layers, a prompt of more than a few tokens: 1e-5. The
  chunked delta rule multiplies by exponentials of decays cumulated over up to 64 tokens, which
  the tests' random weights make steep: one linear layer alone is then ~5e-6 from the f64 result
  in HF's f32 and in cakemp's alike (observed 2.5e-6 .. 6.6e-6 over 70 tokens, and the same prompt
  sent in chunks differs from it at once by as much: tests/compute/test_hybrid_parity.py).
* bf16 / f16: 8 eps (eps = the unit roundoff, 2^-8 for bf16, 2^-11 for f16). Both sides round
  every matmul, norm and residual to the dtype, in different places; each ends ~3 eps from
  the exact result, so they may differ by ~6 eps (the argument in test_runner_parity.py).
  The same 8 eps bound a half-precision node against HF's f32 layers.
"""

from __future__ import annotations

import torch

F32_REL = 2e-6
F32_DELTA_RULE_REL = 1e-5
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
HALF_EPS = 8  # bf16 / f16 outputs within this many eps of the oracle


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|, in f32."""
    ours, reference = ours.float(), reference.float()
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def half_bound(dtype: torch.dtype) -> float:
    """The relative bound for a bf16 / f16 output: HALF_EPS eps of `dtype`."""
    return HALF_EPS * EPS[dtype]


def assert_close(ours: torch.Tensor, reference: torch.Tensor, bound: float = F32_REL) -> None:
    """Same shape, and within `bound` of the reference, relative to its largest magnitude."""
    assert ours.shape == reference.shape, f"shape {tuple(ours.shape)} != {tuple(reference.shape)}"
    error = rel_error(ours, reference)
    assert error <= bound, f"relative error {error:.3g} > bound {bound:.3g}"
