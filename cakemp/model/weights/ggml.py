"""ggml's tensor types dequantized in torch, in f32, on whatever device the bytes are on, and the
4-bit ones kept for torch's int4 matmul: the one door to the ggml families.

Each quantized type stores a row as blocks of values (checkpoint/gguf.py: GGML_TYPES gives their
sizes); a block holds f16 scales and packed integer codes. Each family of types is a module of its
own (ggml_legacy.py, ggml_k.py, ggml_iq4.py, ggml_ternary.py: each declares its blocks' layout, its
dequantizers and the types it keeps int4) and one row of checkpoint/gguf_model.GGML_FAMILIES, the
torch-free table by which the front refuses any other type (Q8_1, Q8_K, the lattice IQ types
IQ1_S..IQ3_S, MXFP4) by name before a device starts. DEQUANTIZERS and INT4_TYPES gather the
families' rows, so that a family is one file and one row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from cakemp.checkpoint import resident
from cakemp.checkpoint.gguf import GGML_TYPES
from cakemp.checkpoint.gguf_model import GGML_FAMILIES
from cakemp.model.weights import int4

_FAMILIES = [importlib.import_module(family.module) for family in GGML_FAMILIES]
_BLOCK_BYTES = {kind.name: kind.block_bytes for kind in GGML_TYPES.values()}
# type name -> (bytes of one block, its dequantizer: uint8 [n, bytes] -> f32 [n, values]).
DEQUANTIZERS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    kind: (_BLOCK_BYTES[kind], dequantize_blocks) for family in _FAMILIES
    for kind, dequantize_blocks in family.DEQUANTIZERS.items()
}
# Affine 4-bit codes in groups of 32 (Q4_K: the sub-blocks of its 256-value blocks): torch's int4 matmul takes them.
_INT4 = {kind: parts for family in _FAMILIES for kind, parts in family.INT4.items()}
INT4_TYPES = tuple(_INT4)
_INT4_BLOCK = 32


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """raw: uint8 [nbytes], a tensor's bytes as stored -> f32 `shape` (a view of `raw` for F32)."""
    if kind == "F32":
        return raw.view(torch.float32).view(shape)
    if kind in ("F16", "BF16"):
        return raw.view(torch.float16 if kind == "F16" else torch.bfloat16).float().view(shape)
    block_bytes, dequantize_blocks = DEQUANTIZERS[kind]
    return dequantize_blocks(raw.view(-1, block_bytes)).view(shape)


def int4_group(kind: str, shape: tuple[int, ...]) -> int | str:
    """The group size torch's int4 matmul can take a tensor of `kind` and `shape` in, or why not."""
    if kind not in INT4_TYPES:
        return f"GGUF {kind} tensors (torch's int4 matmul takes {', '.join(INT4_TYPES)})"
    if len(shape) != 2:
        return f"GGUF {kind} tensors of shape {shape}"
    return resident.int4_unfit_reason(shape[0], shape[1], _INT4_BLOCK) or _INT4_BLOCK


def int4_parts(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> int4.Int4Parts:
    """A matrix of an INT4_TYPES type `int4_group` accepted, in torch's int4 convention, group by
    group of 32 (each family's module says how its values map onto it)."""
    rows, cols = shape
    return _INT4[kind](raw.view(-1, _BLOCK_BYTES[kind]), rows, cols)
