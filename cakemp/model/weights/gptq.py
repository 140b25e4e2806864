"""GPTQ weights (AutoGPTQ, GPTQModel) dequantized into a plain [out, in] matrix.

    W[o, i] = scales[g(i), o] * (q[i, o] - z[g(i), o])

q: the code of input i for output o, `bits` wide, packed along the inputs (qweight [in * bits
/ 32, out]); z: the zero point of group g for output o, packed along the outputs (qzeros
[groups, out * bits / 32]); g(i) = g_idx[i] where the checkpoint stores it (act-order,
`desc_act`, puts inputs in groups out of order), else i // group_size (group_size -1: one
group). Symmetric checkpoints store their constant zero points like any others. Kept int4
(model/weights/int4.py), an act-order weight's columns are sorted by group and its inputs
gathered in that order at each product; 8-bit weights of one group (group_size -1) are kept int8
on a CPU (int8.py), grouped ones dequantized.

checkpoint_format "gptq" (v1, AutoGPTQ's and what Cake assumes) stores each zero point minus
1; "gptq_v2" as it is. v1's 1 is added back as GPTQModel loads v1: for 2, 4 and 8 bits by one
integer addition per 32-bit word (so a field stored as all ones, a zero point of 0 that the
writer's subtraction borrowed across, is restored with its neighbour), for 3 bits field by
field, modulo 8. Cake adds 1 to each field (for 4 bits only), which differs only for those
all-ones fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from cakemp.checkpoint.gptq import Gptq, GptqParts
from cakemp.checkpoint.stored import Shape
from cakemp.model.weights import bitfields, int4, int8, kept

_VALUES_PER_STEP = 1 << 20


@dataclass(frozen=True)
class GptqWeight:
    """One GPTQ weight read from its stored parts (a model/weights/quantized.QuantizedParts)."""

    parts: GptqParts

    def dequantize(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        p = self.parts
        return dequantize(stored[p.qweight], stored[p.qzeros], stored[p.scales],
                          None if p.g_idx is None else stored[p.g_idx], p.spec)

    def kept_shape(self, shape: Callable[[str], Shape],
                   tensor: Callable[[str], torch.Tensor]) -> kept.KeptShape | str:
        """Its int8.Int8Shape (8 bits, one group) or int4.Int4Shape from the headers (the parts'
        kept_form: checkpoint/resident.py) and the g_idx ([in] int32: act-order's groups and input order)."""
        p = self.parts
        form = p.kept_form(shape)
        if isinstance(form, str):
            return form
        if form.kernel == int8.KERNEL:
            return int8.Int8Shape(form.rows, form.cols)
        g_idx = None if p.g_idx is None else tensor(p.g_idx)
        reason = _uneven_reason(g_idx, form.cols, form.group_size)
        if reason is not None:
            return reason
        return int4.Int4Shape(form.rows, form.cols, form.group_size,
                              None if g_idx is None else input_order(g_idx, form.group_size))

    def kept_parts(self, stored: Mapping[str, torch.Tensor]) -> kept.KeptParts:
        p = self.parts
        if p.spec.bits == 8:
            return int8_parts(stored[p.qweight], stored[p.qzeros], stored[p.scales], p.spec)
        groups, in_features = stored[p.scales].shape[0], stored[p.qweight].shape[0] * 32 // 4
        return int4_parts(stored[p.qweight], stored[p.qzeros], stored[p.scales],
                          None if p.g_idx is None else stored[p.g_idx], p.spec, in_features // groups)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               spec: Gptq) -> torch.Tensor:
    """The stored tensors (GptqParts' shapes) -> W: [out, in] f32; ValueError if they do not fit together."""
    bits = spec.bits
    stored = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    parts = GptqParts("qweight", "qzeros", "scales", None if g_idx is None else "g_idx", spec)
    out_features, in_features = parts.matrix_shape(lambda part: tuple(stored[part].shape))
    groups = scales.shape[0]
    group = _groups(g_idx, in_features, groups, spec.group_size).to(qweight.device)
    zeros = _zero_points(qzeros, bits, out_features, spec.v1)  # [groups, out]
    words = qweight.t().contiguous()  # [out, in * bits / 32]: each output's codes, row by row
    zeros, scales = zeros.t().float(), scales.t().float()  # [out, groups] each
    weight = torch.empty(out_features, in_features, dtype=torch.float32, device=qweight.device)
    # In input order, with groups of one size (no act-order): each group's zero point and scale
    # broadcast over its inputs, no gather.
    size = in_features // groups if in_features % groups == 0 else 0
    in_order = size and torch.equal(group, torch.arange(in_features, device=group.device) // size)
    # A few output rows at a time: the temporaries stay small (in cache, no fresh pages to fault in).
    step = max(1, _VALUES_PER_STEP // max(in_features, 1))
    for rows in (slice(start, start + step) for start in range(0, out_features, step)):
        # Codes and zero points are small integers, exact in f32, so W rounds once, in the product.
        codes = bitfields.unpack(words[rows], bits, in_features).float()  # [r, in]
        if in_order:
            codes.view(-1, groups, size).sub_(zeros[rows, :, None]).mul_(scales[rows, :, None])
        else:
            codes.sub_(zeros[rows].index_select(1, group)).mul_(scales[rows].index_select(1, group))
        weight[rows] = codes
    return weight


def int4_group(spec: Gptq, out_features: int, in_features: int, groups: int, g_idx: torch.Tensor | None) -> int | str:
    """The group size torch's int4 matmul can take this weight in (model/weights/int4.py), or why not:
    4 bits, groups of one size (act-order's, out of input order, once its inputs are sorted by group)."""
    size = spec.int4_group(out_features, in_features, groups)
    return size if isinstance(size, str) else _uneven_reason(g_idx, in_features, size) or size


def _uneven_reason(g_idx: torch.Tensor | None, in_features: int, size: int) -> str | None:
    """Why a g_idx does not put `size` inputs in each group (sorted, it must be 0 0 .. 1 1 ..), or None."""
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64).reshape(-1).cpu().sort(stable=True).values,
                                             torch.arange(in_features) // size):
        return f"GPTQ g_idx groups of unequal size (not {size} inputs each)"
    return None


def input_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The inputs sorted by group (stable: [in] int64), so that each group is `group_size` consecutive
    columns; None where g_idx has them in input order already (no gather needed)."""
    group = g_idx.to(torch.int64).reshape(-1)
    if torch.equal(group, torch.arange(group.numel(), device=group.device) // group_size):
        return None
    return torch.sort(group, stable=True).indices


def int4_parts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               spec: Gptq, group_size: int) -> int4.Int4Parts:
    """A 4-bit GPTQ weight whose groups `int4_group` accepted, in torch's int4 convention:
    s * (q - z) = (q - 8) * s + s * (8 - z), the codes as stored, their columns sorted by group
    for act-order (int4.Int4Parts.order)."""
    groups, out_features = scales.shape
    in_features = groups * group_size
    _check_shape("qweight", qweight, (in_features * 4 // 32, out_features))
    _check_shape("qzeros", qzeros, (groups, -(-out_features * 4 // 32)))
    codes = bitfields.unpack(qweight.t().contiguous(), 4, in_features).to(torch.uint8)  # [out, in]
    order = None if g_idx is None else input_order(g_idx, group_size)
    if order is not None:
        codes = codes.index_select(1, order)  # [out, in]: column j holds input order[j], of group j // size
    zeros = _zero_points(qzeros, 4, out_features, spec.v1).t().float()  # [out, groups]
    scale = scales.t().float()  # [out, groups]
    return int4.Int4Parts(codes, scale, scale * (8 - zeros), group_size, order)


def int8_parts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, spec: Gptq) -> int8.Int8Parts:
    """An 8-bit GPTQ weight of one group (its g_idx, all 0, changes nothing), in torch's int8 convention:
    s * (q - z) = s * (q - 128) + s * (128 - z)."""
    out_features = scales.shape[1]
    in_features = qweight.shape[0] * 32 // 8
    _check_shape("scales", scales, (1, out_features))
    _check_shape("qzeros", qzeros, (1, -(-out_features * 8 // 32)))
    codes = bitfields.unpack(qweight.t().contiguous(), 8, in_features) - int8.OFFSET  # [out, in], -128..127
    zeros = _zero_points(qzeros, 8, out_features, spec.v1)[0].float()  # [out]
    scale = scales[0].float()  # [out]
    return int8.Int8Parts(codes.to(torch.int8), scale, scale * (int8.OFFSET - zeros))


def _zero_points(qzeros: torch.Tensor, bits: int, count: int, v1: bool) -> torch.Tensor:
    """qzeros [groups, W] -> the zero points [groups, count] int32, v1's stored minus 1 undone."""
    if not v1:
        return bitfields.unpack(qzeros, bits, count)
    if 32 % bits == 0:
        return bitfields.unpack(bitfields.add_to_each(qzeros, bits, 1), bits, count)
    return (bitfields.unpack(qzeros, bits, count) + 1) & ((1 << bits) - 1)


def _groups(g_idx: torch.Tensor | None, in_features: int, groups: int, group_size: int) -> torch.Tensor:
    """Each input's group: [in] int64, checked to index the scales' `groups` rows (their count
    checked against the inputs without g_idx: GptqParts.matrix_shape)."""
    if g_idx is None:
        return torch.arange(in_features) // (in_features if group_size == -1 else group_size)
    group = g_idx.to(torch.int64).reshape(-1)
    if group.numel() and (group.min() < 0 or group.max() >= groups):
        raise ValueError(f"g_idx names groups outside 0..{groups - 1}")
    return group


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")
