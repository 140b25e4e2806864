"""How close an output must be to its oracle, and why: bounds that come from an error analysis,
not from one CPU's rounding.

u is the unit roundoff of a dtype (half its machine epsilon): 2^-24 for f32, 2^-8 for bf16,
2^-11 for f16. Every computed result carries some multiple of it, and which multiple depends on
the summation order of each reduction: the BLAS kernel, its blocking, the thread count, the
fusion. A bound set at one machine's observed error plus a margin bounds that machine's
rounding, not the code: the old f32 bound, 2e-6 between cakemp and HF, was reported failing on
an EPYC at 2.7e-6, and here checkpoint seed 4 instead of 0 puts the two 4.4e-6 apart with no
bug at all. So there are two kinds of bound.

**Parity with HF transformers** (tests/compute/test_runner_parity.py, test_hybrid_parity.py,
tests/model/test_head.py): cakemp and HF, both in the test's dtype, are each compared with a
float64 evaluation of the same layers (HF's, in f64 throughout: `float64_throughout`), and
cakemp's error must be within a fixed multiple of HF's own (`Accuracy`, `PARITY`):

    err(cakemp) <= C * err(HF) + floor * u

Two evaluations of the same function in the same dtype have errors of the same order (the
standard rounding-error model: each reduction of length K contributes ~sqrt(K) u whatever its
order), so the ratio is O(1) on any CPU and BLAS, and a different rounding moves both sides; a
real bug (a wrong epsilon, scale, rope theta, weight, a dropped term) is an error of cakemp's
alone. The floor, one u (the rounding of the output itself), keeps the bound from collapsing
should HF's error happen to be tiny. The reference is exact for this purpose: cakemp's own code
run in f64 under float64_throughout (its weights widened, the (1 + w) and exp(A_log) it folds
in f32 at load made exact) agrees with it to <= 4e-15 in every parity family, where HF's f64
layers without float64_throughout are 1e-7..5e-6 off.

The error is measured two ways over all of a test's outputs, and both must hold:
* typical: the median over tokens of ||ours_t - exact_t|| / ||exact_t|| (one hidden state per
  token). Insensitive to the few ill-conditioned tokens of these tiny random models (peaked
  attention, steep Qwen3.5 decays, an expert picked by a near-tie), where any evaluation, HF's
  included, can end 10-80 u from exact depending on its rounding; a bug that touches most
  tokens moves it.
* overall: the RMS error over all outputs relative to the reference's RMS. Catches a bug
  confined to a few tokens or steps (one decode step, a cache offset), which the median skips.
The per-element maximum is not used: it is the largest of a few hundred errors dominated by
those ill-conditioned tokens, so cakemp's over HF's swings from 0.2 to 8 per chunk with the
rounding alone (over checkpoint seeds 0-5).

Factors, and what was observed on this machine (AMD EPYC, AVX-512, MKL; checkpoint seeds 0-2
for the 10 dense cases x 2 chunkings, 0-5 (f32) and 0-7 (bf16) for the 3 hybrid ones, 1 and 2
threads):
* f32: C = 3. Typical ratio 0.87-1.53, overall 0.87-1.65 (at most 0.53 of the bound). The
  3-token chunks sit at 1.2-1.5 because MKL's packed GEMM (cakemp's, for f32 CPU matrices)
  rounds less well than the plain one for 3 rows (1.0 with packing off): a kernel choice that
  another CPU or BLAS makes differently, which is what the factor has to absorb. A 10x rms_norm
  epsilon gives ratios of 13-57 (4-18x past the bound, every family), a 1% rope theta 38-6000,
  a 0.1% attention scale 120-1900; a 2x epsilon (1.7-5.4) fails 4 cases of 13.
* bf16 / f16: C = 2. The error is dominated by rounding every activation to the dtype at each
  op boundary, which both implementations do in about the same places (cakemp keeps attention,
  the delta rule and the norms' reductions in f32, so it is mostly a little more accurate):
  typical 0.81-1.05, overall 0.78-1.34. Only bugs well above 2 u of the dtype show: a 10x
  epsilon, a 1% scale or theta are invisible in bf16 (a 1% scale fails every dense case in
  f16); the f32 tests are the sensitive ones.
* bf16 / f16 with MoE routing: C = 2, overall floor 16 u. Router logits rounded to the dtype
  that nearly tie pick another expert in one implementation and not the other: a jump of up to
  ~0.5 of that token's norm, no multiple of u. One such token among a test's 87 is
  0.5 / sqrt(87) = 5.4% RMS = 14 u of bf16, so the floor allows about one flip more in cakemp
  than in HF; the typical error ignores flips and keeps the factor (typical 0.77-1.35 over
  seeds 0-7, where the overall ratio alone reached 6.3; at most 0.61 of the bound).

**Two f32 evaluations of the same layers, no f64 reference** (live nodes against HF's f32
layers or an in-process BlockRunner, batched against alone, chunked against whole, packed
against plain products): `F32_REL`, relative to the largest magnitude of the reference output
(`rel_error`, `assert_close`). These tests look for a wrong layer, position, session, state or
dtype, which moves outputs by 1e-3 or more; the arithmetic is the parity tests' job.
* F32_REL = 2 K u with K = 128, the longest reduction in the tiny checkpoints' layers (TINY's
  intermediate_size; hidden 64, head_dim <= 32, attention over <= 60 keys in those tests): the
  classical worst-case bound of a length-K dot product is gamma_K ~ K u (Higham, Accuracy and
  Stability of Numerical Algorithms, 3.1); two evaluations each within it of the exact result
  differ by at most twice that, 1.53e-5. Well-conditioned inputs stay far below (observed:
  <= 12 u for the node tests' Llama over 42 random requests, < 25 u for the Qwen3.5-MoE node
  test's inputs). On ill-conditioned inputs of these random models (one or two prompts in ten
  for the Qwen3.5-MoE node's layers here; HF itself ends ~80 u from exact) nothing short of an f64
  reference tells rounding from a bug, which is why the parity tests have one.
* half_bound(dtype) = 8 u of the dtype, for a bf16 / f16 node (or f16 on the wire into an f32
  node) against HF's f32 layers: the residual stream of the node tests' 4 layers is rounded to
  the dtype twice per layer (8 roundings of at most u of its largest element: 8 u if all fell
  the same way, ~3 u typically), and the sublayers' own errors add about as much again in the
  typical case (observed for the node tests' Llama: <= 4.8 u bf16, <= 5.3 u f16 over 42
  requests; the f16 wire <= 1.2 u). A value rounded to a coarser dtype than asked (bf16 for
  f16: 8 u of f16 per rounding) or computed in the wrong one is past it.

**A node keeping 4-bit weights int4** (model/weights/int4.py) against the same node dequantizing
them (whose own error against HF's f32 layers is F32_REL): `INT4_KEPT_REL`. The codes are the
same on both paths; what the kept path adds is rounding to bf16, in each product y = x W^T:
* the input x (u of bf16 per element, the kernels take bf16 activations);
* each group's scale and zero (W = (q - 8) s + z with s and z held in bf16: u each);
* the output y (the kernels return bf16);
* past 63 rows, W itself (the tile dequantized to bf16 for the bf16 GEMM).
That is at most INT4_ROUNDINGS = 5 roundings of u per product, each perturbing every term of
the sum by at most u relatively, so y by at most 5 u of its largest magnitude where the terms do
not cancel (these tests' random, well-conditioned layers; see F32_REL for the same assumption).
A sublayer (attention, MLP) chains two such products, separated by a norm-free rotation or an
activation that does not amplify a relative error by more than 1 here, so its output carries
2 x 5 u; the node tests serve 3 layers, 2 sublayers each, whose outputs are added to the f32
residual stream: 3 x 2 x 2 x 5 = 60 u of bf16 if all fell the same way, relative to the largest
element of the output, on top of F32_REL. A wrong code, group, scale or zero point, a row order
or a dropped zero moves outputs by O(1) of a sublayer's output and is past it; the products'
own rounding is checked tightly, per product, in tests/model/test_int4.py.

**A node keeping 8-bit weights int8** (model/weights/int8.py) likewise: `INT8_KEPT_REL`. The int8
codes are the stored ones shifted by 128 (exact), and the scale and the zero point's correction
are applied in f32 after the kernel; what the kept path adds per product is rounding to bf16:
* the input x (u of bf16 per element);
* the kernel's sum of codes times x (it returns bf16; past 19 rows the bf16 GEMM over the codes
  widened to bf16, exact, returns it rounded the same once).
INT8_ROUNDINGS = 2 roundings of u per product, chained as above: 3 x 2 x 2 x 2 = 24 u of bf16 on
top of F32_REL. Again the terms are assumed not to cancel: here the kernel's sum and the zero
point's correction, each rounded relatively to itself, are of the size of the output in these
tests' random layers; the per-product rounding is checked tightly in tests/model/test_int8.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff
LONGEST_REDUCTION = 128  # K: TINY's intermediate_size (tests/support/checkpoints.py), the longest dot product in a layer
F32_REL = 2 * LONGEST_REDUCTION * U[torch.float32]  # two f32 evaluations of the same layers (1.53e-5)
HALF_EPS = 8  # a bf16 / f16 output within this many u of its dtype of HF's f32 layers
INT4_ROUNDINGS = 5  # per kept-int4 product: its input, scales, zeros, output, and (past 63 rows) its tile
NODE_LAYERS, PRODUCTS_PER_LAYER = 3, 4  # the node tests' layers 1-3; two sublayers of two products each
INT4_KEPT_REL = F32_REL + NODE_LAYERS * PRODUCTS_PER_LAYER * INT4_ROUNDINGS * U[torch.bfloat16]
INT8_ROUNDINGS = 2  # per kept-int8 product: its input and the kernel's output
INT8_KEPT_REL = F32_REL + NODE_LAYERS * PRODUCTS_PER_LAYER * INT8_ROUNDINGS * U[torch.bfloat16]


@dataclass(frozen=True)
class Bound:
    """err(cakemp) <= factor * err(HF) + floor * u, for the typical and the overall error."""

    factor: float
    typical_floor: float = 1.0  # in u of the dtype
    overall_floor: float = 1.0


PARITY = {
    torch.float32: Bound(3),
    torch.bfloat16: Bound(2),
    torch.float16: Bound(2),
}
PARITY_MOE = {  # bf16 / f16 with MoE routing: near-tie expert flips (module docstring)
    torch.bfloat16: Bound(2, overall_floor=16),
    torch.float16: Bound(2, overall_floor=16),
}


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|, in f64."""
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def half_bound(dtype: torch.dtype) -> float:
    """The relative bound for a bf16 / f16 output against HF's f32 layers: HALF_EPS u of `dtype`."""
    return HALF_EPS * U[dtype]


def assert_close(ours: torch.Tensor, reference: torch.Tensor, bound: float = F32_REL) -> None:
    """Same shape, and within `bound` of the reference, relative to its largest magnitude."""
    assert ours.shape == reference.shape, f"shape {tuple(ours.shape)} != {tuple(reference.shape)}"
    error = rel_error(ours, reference)
    assert error <= bound, f"relative error {error:.3g} > bound {bound:.3g}"


class _KeepFloat64(TorchFunctionMode):
    """A float64 tensor asked to become float32 stays float64, and a dtype=float32 argument beside
    a float64 tensor becomes float64; nothing else changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        if _any_float64(args) or _any_float64(kwargs.values()):
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _any_float64(values) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
            return True
        if isinstance(value, (list, tuple)) and _any_float64(value):
            return True
    return False


@contextmanager
def float64_throughout():
    """HF's layers loaded in float64 (HFLayers(path, layers, torch.float64)) and called inside
    this compute in float64 throughout: their norms, softmax, MoE router, gated norm and delta
    rule upcast to f32 explicitly (`x.float()`, `.to(torch.float32)`, `softmax(dtype=float32)`),
    which would round the reference to f32 in exactly the places that matter.

    The rotary tables stay as HF and cakemp both compute them: f32 angles from an f32 inv_freq
    buffer (integer positions times it), cast to f64. That table is the same computation in
    HF's f32 run, in cakemp (cakemp/model/rotary.py) and in the reference, so its rounding is
    common to all three and not counted against either; a wrong theta or scaling still differs.
    """
    with _KeepFloat64():
        yield


@dataclass
class Accuracy:
    """cakemp's and HF's errors against the f64 reference, gathered over a test's outputs."""

    dtype: torch.dtype
    ours_tokens: list[torch.Tensor]
    hf_tokens: list[torch.Tensor]
    squares: torch.Tensor  # sum of squares: ours - exact, hf - exact, exact

    @classmethod
    def of(cls, outputs: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> Accuracy:
        """outputs: (cakemp's, HF's in `dtype`, the f64 reference), each [..., H]."""
        accuracy = cls(dtype, [], [], torch.zeros(3, dtype=torch.float64))
        for ours, hf, exact in outputs:
            accuracy.add(ours, hf, exact)
        return accuracy

    def add(self, ours: torch.Tensor, hf: torch.Tensor, exact: torch.Tensor) -> None:
        assert ours.shape == hf.shape == exact.shape, f"shapes {ours.shape}, {hf.shape}, {exact.shape}"
        ours, hf, exact = ours.double(), hf.double(), exact.double()
        norms = exact.norm(dim=-1).flatten()
        self.ours_tokens.append((ours - exact).norm(dim=-1).flatten() / norms)
        self.hf_tokens.append((hf - exact).norm(dim=-1).flatten() / norms)
        self.squares += torch.stack([((ours - exact) ** 2).sum(), ((hf - exact) ** 2).sum(), (exact**2).sum()])

    def typical(self) -> tuple[float, float]:
        """(cakemp's, HF's) median per-token relative error."""
        return torch.cat(self.ours_tokens).median().item(), torch.cat(self.hf_tokens).median().item()

    def overall(self) -> tuple[float, float]:
        """(cakemp's, HF's) RMS error over all outputs, relative to the reference's RMS."""
        ours, hf, exact = self.squares.tolist()
        return (ours / exact) ** 0.5, (hf / exact) ** 0.5

    def assert_within(self, bound: Bound) -> None:
        """cakemp's typical and overall errors are each within `bound` of HF's."""
        u = U[self.dtype]
        for name, (ours, hf), floor in (("typical", self.typical(), bound.typical_floor),
                                        ("overall", self.overall(), bound.overall_floor)):
            limit = bound.factor * hf + floor * u
            assert ours <= limit, (f"{name} error {ours:.3g} ({ours / u:.1f} u) > {bound.factor:g} x HF's "
                                   f"{hf:.3g} + {floor:g} u = {limit:.3g}")


def fp8_matmul_bound(x: torch.Tensor, weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block-scaled FP8 emulation's x @ weight.T, the bound on a kernel's distance from it).
    Both sum the same f32 products x_q w * x_scale * w_scale, in different orders: a sum of K terms
    errs by at most K f32 steps of the sum of their magnitudes; then the output rounds once to
    `dtype` (no rounding for f32). x: [M, K]; weight: an fp8.Fp8Weight [N, K] with 128x128 blocks."""
    from cakemp.model.weights import fp8

    expected = fp8.emulated_matmul(x, weight)
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    return expected, x.shape[1] * torch.finfo(torch.float32).eps * fp8_magnitude(x, weight) + eps * expected.abs()


def fp8_magnitude(x: torch.Tensor, weight) -> torch.Tensor:
    """[M, N]: the sum of the magnitudes of the scaled products x_q w * x_scale * w_scale each output
    adds up, what any reordering or narrower accumulation of them errs in proportion to."""
    from cakemp.model.weights import fp8

    x_q, x_scale = fp8.quantize_activation(x.float())
    w_scale = weight.scale_inv.repeat_interleave(128, dim=0)  # [N, K/128]
    magnitude = torch.zeros(x.shape[0], weight.shape[0], device=x.device)
    for b in range(x_scale.shape[1]):
        columns = slice(b * 128, (b + 1) * 128)
        products = x_q[:, columns].float().abs() @ weight.weight[:, columns].float().abs().t()
        magnitude += products * x_scale[:, b, None] * w_scale[None, :, b]
    return magnitude


def decode_attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           dtype: torch.dtype) -> float:
    """The bound on a decode row's attention output, computed in f32 (model/paged_attention.py), against
    its exact value; q: [D], k, v: [S, D], the keys it sees, in `dtype`'s values. With u = 2^-24:
    * each score scale * q.k_i, a D-term f32 dot then a product, errs by at most (D + 1) u A, A the
      largest scale * sum |q_d k_id|;
    * a score error e moves each normalized weight by at most 2e relatively (its exp, and the sum's),
      and the weights' own exps, running sum and division add (S + 3) u;
    * the weighted sum of the S values, in f32, adds S u of sum p_i |v_i| <= max |v|; merging the
      splits' partial sums (exps of their log-sum-exps, O(A + log S) each) adds 4 (A + log S + 1) u;
    * a half dtype's probabilities enter the product with V in TF32 (a GPU's tensor cores keep 10 bits of
      their mantissas, truncating: 2^-10 each);
    * the output is rounded once to `dtype`: to nearest on a GPU (u of it), toward zero by Triton's
      interpreter (2 u).
    Returned as an absolute bound over the row's outputs: the terms above times max |v|, plus the
    output's rounding of max |exact| (<= max |v|)."""
    u = U[torch.float32]
    S, D = k.shape
    A = scale * (q.double().abs() @ k.double().abs().t()).max().item()
    relative = 2 * (D + 1) * u * A + (S + 3) * u + S * u + 4 * (A + math.log(S) + 1) * u
    if dtype != torch.float32:
        relative += 2.0**-10
    top = v.double().abs().max().item()
    return top * (relative + (2 * U[dtype] if dtype != torch.float32 else 0.0))
