"""GPTQ weights (AutoGPTQ, GPTQModel), torch-free: config.json's quantization_config {quant_method
"gptq", bits, group_size, desc_act, sym, checkpoint_format}; a weight P.weight stored as P.qweight,
P.qzeros, P.scales (and P.g_idx for act-order). Kept int4 for 4 bits in groups torch's int4 matmul
takes, int8 for 8 bits in one group (checkpoint/resident.py's bytes), else dequantized. Refused by
name: bit widths but 2, 3, 4 and 8, packings but the continuous v1 and v2 (marlin, bitblas, planar
gptq_p), GPTQModel's per-module `dynamic` overrides, words but int32. Its torch side:
model/weights/gptq.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from cakemp.checkpoint.resident import INT4, INT8, KeptForm, int4_unfit_reason
from cakemp.checkpoint.stored import Method, Shape, expect, module_of, named_by, ranked
from cakemp.checkpoint.values import shown, whole

GPTQ_BITS = frozenset({2, 3, 4, 8})
_MAX_GROUP = 1 << 20
# GPTQ checkpoint formats: "gptq" stores each zero point minus 1 (AutoGPTQ's v1), "gptq_v2" as is.
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}


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
        module = module_of(weight)
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
        scales = ranked(self.scales, shape(self.scales), 2)
        groups, out_features = scales
        if self.g_idx is not None:  # act-order: g_idx names each input's group, of as many groups
            in_features = math.prod(shape(self.g_idx))
        else:
            in_features = ranked(self.qweight, shape(self.qweight), 2)[0] * 32 // spec.bits
        size = in_features if spec.group_size == -1 else spec.group_size
        if groups != -(-in_features // size):
            raise ValueError(f"{self.scales}: {groups} groups of scales for {in_features} inputs in groups of {size} "
                             f"(expected {-(-in_features // size)})")
        expect(self.qweight, shape(self.qweight), (-(-in_features * spec.bits // 32), out_features))
        expect(self.qzeros, shape(self.qzeros), (groups, -(-out_features * spec.bits // 32)))
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


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"gptq {name} {shown(value)} is not true or false")
    return value


METHOD = Method("gptq", named_by("gptq"), _gptq, Gptq, "cakemp.model.weights.gptq:GptqWeight")
