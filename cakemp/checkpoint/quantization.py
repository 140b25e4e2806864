"""How a checkpoint's weights are quantized, read from its config.json, and which stored
tensors make each quantized weight. No torch: the front refuses a format here, before any
device starts; model/weights/fp8.py, model/weights/gptq.py and model/weights/mlx.py dequantize
(model/weights/quantized.py imports the one each METHODS row names).

Each format is one METHODS row (the settings of config.json that declare it, and their parse into
one frozen config, a `Quantization`: what `parse` returns) whose
`parts` names the stored tensors of a weight as a `Parts` (their names, and the shape rule of
the matrix they make, and `kept_form`: how one of the kept kernels takes it, checkpoint/resident.py),
so the readers and the sizing never ask which format it is.

| format     | config.json                                            | a weight `P.weight` is stored as          |
|------------|--------------------------------------------------------|-------------------------------------------|
| FP8        | quantization_config: quant_method "fp8", weight_block_size | P.weight (e4m3), P.weight_scale_inv   |
| GPTQ       | quantization_config: quant_method "gptq", bits, group_size, desc_act, sym, checkpoint_format | P.qweight, P.qzeros, P.scales (P.g_idx) |
| MLX affine | quantization (mlx-lm copies it to quantization_config): bits, group_size, mode, per-module overrides | P.weight (u32), P.scales, P.biases |

In a quantized checkpoint only some weights are quantized (FP8 releases keep norms in 16 bits,
GPTQ releases attention, routers or shared experts; mlx-lm skips matrices whose width its group
size does not divide): a weight is read quantized exactly when its quantized parts are stored.

A new form is one file (its config, its Parts and its torch side) and one METHODS row
(tests/model/test_new_form.py shows one); the readers, the loader and the sizing are unchanged.

Anything else is refused by name (a CheckpointError, exit 78), never loaded as if plain: AWQ,
bitsandbytes, compressed-tensors and the rest; GPTQ bit widths but 2, 3, 4 and 8, packings but
the continuous v1 and v2 (marlin, bitblas, planar gptq_p), GPTQModel's per-module `dynamic`
overrides, words but int32; MLX modes but affine (mxfp4, mxfp8, nvfp4), group sizes but 32, 64
and 128 (what mx.quantize takes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from cakemp.checkpoint.resident import FP8, FP8_BLOCK, INT4, INT8, KeptForm, fp8_unfit_reason, int4_unfit_reason
from cakemp.checkpoint.values import as_list, mapping, shown, whole

Shape = tuple[int, ...]
GPTQ_BITS = frozenset({2, 3, 4, 8})
MLX_BITS = frozenset({2, 3, 4, 5, 6, 8})
MLX_GROUP_SIZES = frozenset({32, 64, 128})
_DEFAULT_FP8_BLOCK = (128, 128)
_MAX_FP8_BLOCK = 1 << 16
_MAX_GROUP = 1 << 20
# GPTQ checkpoint formats: "gptq" stores each zero point minus 1 (AutoGPTQ's v1), "gptq_v2" as is.
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}


class Parts(Protocol):
    """The stored tensors that make one quantized weight, whatever its format: what the readers
    and the sizing (through the readers: compute/loading.LoadPlan.nbytes) ask of it before any value is read."""

    @property
    def stored(self) -> tuple[str, ...]:
        """The names of the stored tensors that make the weight."""

    def matrix_shape(self, shape: Callable[[str], Shape]) -> Shape:
        """The shape of the matrix the parts dequantize into, from their stored shapes (`shape(part)`);
        ValueError naming the part whose shape does not fit the others'."""

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm | str:
        """How one of torch's kept kernels takes the matrix with its codes unchanged (checkpoint/resident.py),
        or why none does, from the parts' stored shapes alone."""


class Quantization(Protocol):
    """A checkpoint's quantization, as config.json declares it (one frozen config per format)."""

    def parts(self, weight: str, stored: Callable[[str], bool]) -> Parts | None:
        """The stored tensors of `weight` ("P.weight") if it is stored as several parts, else None
        (`stored(name)`: whether the checkpoint holds tensor `name`)."""


@dataclass(frozen=True)
class Fp8:
    """Block-wise e4m3 weights: one scale per (rows, cols) block."""

    block: tuple[int, int]

    def parts(self, weight: str, stored: Callable[[str], bool]) -> Fp8Parts | None:
        """The weight and its scales (P.weight_scale_inv, stored beside it) if it is stored so, else None."""
        scale_inv = f"{weight}_scale_inv"
        return Fp8Parts(weight, scale_inv, self.block) if stored(scale_inv) else None


class Fp8Parts(NamedTuple):
    weight: str  # e4m3 [..., rows, cols]
    scale_inv: str  # f32 [..., ceil(rows / block[0]), ceil(cols / block[1])]: w = e4m3 * its block's scale
    block: tuple[int, int]

    @property
    def stored(self) -> tuple[str, ...]:
        return self.weight, self.scale_inv

    def matrix_shape(self, shape: Callable[[str], Shape]) -> Shape:
        """The weight's own stored shape, its scales checked to cover it in blocks (ValueError naming them)."""
        *lead, rows, cols = _ranked(self.weight, shape(self.weight), 2, at_least=True)
        bm, bn = self.block
        _expect(self.scale_inv, shape(self.scale_inv), (*lead, -(-rows // bm), -(-cols // bn)))
        return (*lead, rows, cols)

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm | str:
        """fp8 for one matrix in 128x128 blocks, each side a whole number of them, else why not."""
        stored = self.matrix_shape(shape)
        if len(stored) != 2:
            return f"FP8 stacked weights of shape {stored}"
        return fp8_unfit_reason(*stored, self.block) or KeptForm(FP8, *stored, FP8_BLOCK)


@dataclass(frozen=True)
class Gptq:
    bits: int
    group_size: int  # inputs per group; -1: one group over all of a matrix's inputs
    desc_act: bool  # act-order: groups follow g_idx, not the input order
    sym: bool  # informative only: symmetric checkpoints store their (constant) zero points too
    v1: bool  # zero points stored minus 1 (checkpoint_format "gptq"), else as they are ("gptq_v2")

    def int4_group(self, out_features: int, in_features: int, groups: int) -> int | str:
        """The group size torch's int4 matmul can take such a weight in, or why not: 4 bits, groups of one
        size (an act-order g_idx is checked to hold them so where its values are read: model/weights/gptq.py)."""
        if self.bits != 4:
            return f"GPTQ {self.bits}-bit weights"
        if groups == 0 or in_features % groups:
            return f"GPTQ groups of unequal size ({in_features} inputs in {groups} groups)"
        size = in_features // groups
        return int4_unfit_reason(out_features, in_features, size) or size

    def parts(self, weight: str, stored: Callable[[str], bool]) -> GptqParts | None:
        """The stored tensors of `weight` ("P.weight") if it is quantized here, else None."""
        module = _module(weight)
        if module is None or not stored(f"{module}.qweight"):
            return None
        g_idx = f"{module}.g_idx"
        return GptqParts(f"{module}.qweight", f"{module}.qzeros", f"{module}.scales", g_idx if stored(g_idx) else None,
                         self)


class GptqParts(NamedTuple):
    qweight: str  # int32 [ceil(in * bits / 32), out]: each column's codes packed along the inputs
    qzeros: str  # int32 [groups, ceil(out * bits / 32)]: each group's zero points packed along the outputs
    scales: str  # f16 [groups, out]
    g_idx: str | None  # int32 [in]: each input's group; None: input i is in group i // group_size
    spec: Gptq

    @property
    def stored(self) -> tuple[str, ...]:
        return tuple(part for part in (self.qweight, self.qzeros, self.scales, self.g_idx) if part is not None)

    def matrix_shape(self, shape: Callable[[str], Shape]) -> tuple[int, int]:
        """[out, in] of the matrix the parts dequantize into, from their stored shapes (`shape(part)`),
        read before any value is; ValueError naming the part whose shape does not fit the others'."""
        spec = self.spec
        scales = _ranked(self.scales, shape(self.scales), 2)
        groups, out_features = scales
        if self.g_idx is not None:  # act-order: g_idx names each input's group, of as many groups
            in_features = math.prod(shape(self.g_idx))
        else:
            in_features = _ranked(self.qweight, shape(self.qweight), 2)[0] * 32 // spec.bits
        size = in_features if spec.group_size == -1 else spec.group_size
        if groups != -(-in_features // size):
            raise ValueError(f"{self.scales}: {groups} groups of scales for {in_features} inputs in groups of {size} "
                             f"(expected {-(-in_features // size)})")
        _expect(self.qweight, shape(self.qweight), (-(-in_features * spec.bits // 32), out_features))
        _expect(self.qzeros, shape(self.qzeros), (groups, -(-out_features * spec.bits // 32)))
        return out_features, in_features

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm | str:
        """int8 for 8 bits in one group, int4 for 4 bits in groups the kernel takes (act-order: `desc_act`
        with a g_idx), else why not."""
        out_features, in_features = self.matrix_shape(shape)
        groups = shape(self.scales)[0]
        if self.spec.bits == 8:
            return KeptForm(INT8, out_features, in_features, in_features) if groups == 1 else \
                f"GPTQ 8-bit weights in {groups} groups a row (torch's int8 matmul takes one scale a row)"
        size = self.spec.int4_group(out_features, in_features, groups)
        return size if isinstance(size, str) else \
            KeptForm(INT4, out_features, in_features, size, self.g_idx is not None and self.spec.desc_act)


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
        module = _module(weight)
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
        *lead, words = _ranked(self.weight, weight, 2, at_least=True)
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


def parse(d: dict[str, Any]) -> Quantization | None:
    """The quantization a (text model's) config.json declares, or None: the first METHODS row whose
    settings it holds; ValueError naming what is refused."""
    for method in METHODS:
        settings = method.settings(d)
        if settings is not None:
            return method.parse(settings)
    quant = mapping("quantization_config", d.get("quantization_config") or None)
    if not quant:
        return None
    raise ValueError(f"quantization {shown(quant.get('quant_method'))} is not supported "
                     f"(only {', '.join(method.name for method in METHODS)})")


def norms_carry_one(conv_shape: tuple[int, ...] | None) -> bool:
    """Whether a Qwen3.5 checkpoint's (1 + w) norms are stored with their 1 already added: the
    layout mlx-lm's conversion writes, told apart by what the same conversion does to the
    depthwise convolution (`conv1d.weight` [C, K, 1], MLX's layout, against HF's [C, 1, K]),
    as mlx-lm itself tells a converted checkpoint from an HF one. `conv_shape`: a
    linear-attention layer's conv1d weight as stored (None: the checkpoint has none)."""
    return conv_shape is not None and len(conv_shape) == 3 and conv_shape[1] > 1 and conv_shape[2] == 1


def _fp8(quant: dict[str, Any]) -> Fp8:
    block = as_list("weight_block_size", quant.get("weight_block_size") or list(_DEFAULT_FP8_BLOCK))
    if len(block) != 2:
        raise ValueError(f"weight_block_size {shown(block)} is not [rows, cols]")
    return Fp8(tuple(whole("weight_block_size", n, 1, _MAX_FP8_BLOCK) for n in block))


def _gptq(quant: dict[str, Any]) -> Gptq:
    bits = whole("gptq bits", quant.get("bits", 4), 1, 64)
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ with {bits} bits is not supported (only {', '.join(map(str, sorted(GPTQ_BITS)))})")
    group_size = quant.get("group_size", 128)
    if group_size != -1:
        group_size = whole("gptq group_size", group_size, 1, _MAX_GROUP)
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"  # GPTQModel 4+ writes `format`
    if quant.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {shown(fmt)} is not supported (only gptq and gptq_v2)")
    if quant.get("dynamic"):
        raise ValueError("GPTQ per-module overrides (dynamic) are not supported")
    pack_dtype = quant.get("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32"):
        raise ValueError(f"GPTQ pack_dtype {shown(pack_dtype)} is not supported (only int32)")
    return Gptq(bits, group_size, _bool("desc_act", quant.get("desc_act", False)),
                _bool("sym", quant.get("sym", True)), _GPTQ_FORMATS[fmt])


class Method(NamedTuple):
    """One stored weight form as config.json declares it, declared once: the settings that name it,
    their parse into its frozen config, and its torch side, named by path so that this table imports
    no torch (model/weights/quantized.py imports it on a device: a QuantizedParts made from the
    config's parts, which dequantizes them or keeps them for a kernel)."""

    name: str
    settings: Callable[[dict[str, Any]], dict[str, Any] | None]  # config.json -> its settings, if it declares this form
    parse: Callable[[dict[str, Any]], Quantization]  # the settings -> the form's frozen config
    config: type  # the class `parse` returns
    weights: str  # "module:Class" of its torch side


def named_by(method: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """The settings of a form named by quantization_config's quant_method."""
    def settings(d: dict[str, Any]) -> dict[str, Any] | None:
        quant = mapping("quantization_config", d.get("quantization_config") or None)
        return quant if quant and quant.get("quant_method") == method else None
    return settings


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


# One row per stored form, tried in order (MLX first: its own key wins over the quantization_config it copies).
METHODS: tuple[Method, ...] = (
    Method("MLX affine", _mlx_settings, _mlx, MlxAffine, "cakemp.model.weights.mlx:MlxWeight"),
    Method("fp8", named_by("fp8"), _fp8, Fp8, "cakemp.model.weights.fp8:StoredFp8"),
    Method("gptq", named_by("gptq"), _gptq, Gptq, "cakemp.model.weights.gptq:GptqWeight"),
)


def _ranked(name: str, shape: Shape, rank: int, at_least: bool = False) -> Shape:
    """`shape` if it has `rank` dimensions (or more, `at_least`); else ValueError naming the tensor."""
    if len(shape) < rank or len(shape) > rank and not at_least:
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {rank}{' or more' if at_least else ''} dimensions")
    return tuple(shape)


def _expect(name: str, shape: Shape, expected: Shape) -> None:
    if tuple(shape) != expected:
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {expected}")


def _module(weight: str) -> str | None:
    module, dot, tail = weight.rpartition(".")
    return module if dot and tail == "weight" else None


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"gptq {name} {shown(value)} is not true or false")
    return value
