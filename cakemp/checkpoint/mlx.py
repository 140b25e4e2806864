"""MLX affine weights (mx.quantize, mlx-lm's conversions), torch-free: config.json's `quantization`
(mlx-lm copies it to quantization_config) {bits, group_size, mode, per-module overrides}; a weight
P.weight stored as packed u32 codes beside P.scales and P.biases. Kept int4 for 4-bit matrices in
groups torch's int4 matmul takes, int8 for 8-bit ones of one group a row (checkpoint/resident.py's
bytes), else dequantized. Refused by name: modes but affine (mxfp4, mxfp8, nvfp4), group sizes but
32, 64 and 128 (what mx.quantize takes). Its torch side: model/weights/mlx.py. mlx-lm's conversions
also store Qwen3.5's (1 + w) norms with their 1 added (`norms_carry_one`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from cakemp.checkpoint.resident import INT4, INT8, KeptForm, int4_unfit_reason
from cakemp.checkpoint.stored import Method, Shape, module_of, ranked
from cakemp.checkpoint.values import mapping, shown, whole

MLX_BITS = frozenset({2, 3, 4, 5, 6, 8})
MLX_GROUP_SIZES = frozenset({32, 64, 128})
_MAX_GROUP = 1 << 20


@dataclass(frozen=True)
class MlxAffine:
    bits: int
    group_size: int
    # Per-module overrides, as mlx-lm writes them beside bits and group_size (routers at 8 bits):
    # (module path, (bits, group_size)), or (module path, None) for a module left unquantized.
    overrides: tuple[tuple[str, tuple[int, int] | None], ...] = ()

    def parts(self, weight: str, stored: Callable[[str], bool]) -> MlxParts | None:
        """The stored tensors of `weight` ("P.weight") and their bits and group size if it is
        quantized here, else None; CheckpointError-worthy ValueError if the config says otherwise."""
        module = module_of(weight)
        if module is None or not stored(f"{module}.scales"):
            return None
        params = dict(self.overrides).get(module, (self.bits, self.group_size))
        if params is None:
            raise ValueError(f"{module} has scales but config.json's quantization leaves it unquantized")
        return MlxParts(weight, f"{module}.scales", f"{module}.biases", *params)


class MlxParts(NamedTuple):
    weight: str  # u32 [..., rows, cols * bits / 32]: each row's codes packed along the columns
    scales: str  # [..., rows, cols / group_size]
    biases: str  # [..., rows, cols / group_size]: w = code * scale + bias
    bits: int
    group_size: int

    @property
    def stored(self) -> tuple[str, ...]:
        return self.weight, self.scales, self.biases

    def matrix_shape(self, shape: Callable[[str], Shape]) -> Shape:
        """[..., rows, cols] of the matrices the parts dequantize into, from their stored shapes
        (`shape(part)`), read before any value is; ValueError naming the part that does not fit."""
        weight = shape(self.weight)
        *lead, words = ranked(self.weight, weight, 2, at_least=True)
        cols = words * 32 // self.bits
        if words * 32 % self.bits or cols % self.group_size:
            raise ValueError(f"{self.weight}: a row of {words} words is no whole number of {self.group_size}-column "
                             f"groups of {self.bits}-bit codes")
        groups = (*lead, cols // self.group_size)
        for part in (self.scales, self.biases):
            if tuple(shape(part)) != groups:
                raise ValueError(f"{part} has shape {tuple(shape(part))}, expected {groups} for a weight of {weight}")
        return (*lead, cols)

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm | str:
        """int8 for one 8-bit matrix in one group a row, int4 for one 4-bit matrix in groups the kernel
        takes, else why not (from the packed weight's stored shape alone)."""
        stored = tuple(shape(self.weight))
        cols = stored[-1] * 32 // self.bits
        if self.bits == 8 and len(stored) == 2 and self.group_size == cols:
            return KeptForm(INT8, stored[0], cols, cols)
        if self.bits != 4:
            return f"MLX {self.bits}-bit weights"
        if len(stored) != 2:
            return f"MLX stacked weights of shape {stored}"
        return int4_unfit_reason(stored[0], cols, self.group_size) or KeptForm(INT4, stored[0], cols, self.group_size)


def _mlx_settings(d: dict[str, Any]) -> dict[str, Any] | None:
    """MLX's own `quantization` key (mlx-lm copies it to quantization_config), or a conversion that kept
    only quantization_config: bits and group_size with no quant_method."""
    if d.get("quantization") is not None:
        return mapping("quantization", d["quantization"])
    quant = mapping("quantization_config", d.get("quantization_config") or None)
    return quant if quant and quant.get("quant_method") is None and "bits" in quant and "group_size" in quant else None


def _mlx(quant: dict[str, Any]) -> MlxAffine:
    bits, group_size = _mlx_params("quantization", quant)
    overrides = []
    for key, value in quant.items():
        if key in ("bits", "group_size", "mode", "quant_method"):
            continue
        if value is False:
            overrides.append((key, None))
        elif isinstance(value, dict):
            overrides.append((key, _mlx_params(f"quantization[{shown(key)}]", value)))
        else:
            raise ValueError(f"quantization[{shown(key)}] {shown(value)} is neither bits and group_size nor false")
    return MlxAffine(bits, group_size, tuple(overrides))
def _mlx_params(name: str, quant: dict[str, Any]) -> tuple[int, int]:
    mode = quant.get("mode", "affine")
    if mode != "affine":
        raise ValueError(f"MLX quantization mode {shown(mode)} is not supported (only affine)")
    bits = whole(f"{name} bits", quant.get("bits"), 1, 64)
    group_size = whole(f"{name} group_size", quant.get("group_size"), 1, _MAX_GROUP)
    if bits not in MLX_BITS:
        raise ValueError(f"MLX affine with {bits} bits is not supported (only {', '.join(map(str, sorted(MLX_BITS)))})")
    if group_size not in MLX_GROUP_SIZES:
        raise ValueError(f"MLX affine group_size {group_size} is not supported (only 32, 64 and 128)")
    return bits, group_size


def norms_carry_one(conv_shape: tuple[int, ...] | None) -> bool:
    """Whether a Qwen3.5 checkpoint's (1 + w) norms are stored with their 1 already added: the
    layout mlx-lm's conversion writes, told apart by what the same conversion does to the
    depthwise convolution (`conv1d.weight` [C, K, 1], MLX's layout, against HF's [C, 1, K]),
    as mlx-lm itself tells a converted checkpoint from an HF one. `conv_shape`: a
    linear-attention layer's conv1d weight as stored (None: the checkpoint has none)."""
    return conv_shape is not None and len(conv_shape) == 3 and conv_shape[1] > 1 and conv_shape[2] == 1


METHOD = Method("MLX affine", _mlx_settings, _mlx, MlxAffine, "cakemp.model.weights.mlx:MlxWeight")
