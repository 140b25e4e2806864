"""What a layer's weights are read from, declared once: `WeightSource`, the surface the loaders
(compute/loading.py, model/head.py, master/generator.py) call, and `Reader`, the one loop over
weight groups both readers (safetensors.py, gguf.py) share, each supplying how it opens its
files and reads one stored tensor.

A group is one weight made of several stored tensors stacked along dim 0 (q/k/v, gate/up,
experts): it stays quantized (4-bit, 8-bit or FP8) where one of the device's kept kernels (int4.py,
int8.py, fp8.py: kept.py) takes every member, and is otherwise stacked into one plain tensor
(stacking.py).

`WeightSource.mapped` keeps a checkpoint's files open for reads repeated while a node serves
(an offloaded MoE's routed experts, model/weights/experts.py): `Mapped.load` reads groups as
`load` does or, given an `index`, only matrix `index` of each member stored stacked [E, ...],
its bytes alone read from the mapped file, in its stored form (4-bit codes stay 4-bit), and its
kept groups made, by default, the weights that multiply or (`fuse`) their parts stacked, for a read
that goes on to another device (model/weights/expert_transfer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import Container
from cakemp.model.weights import kept
from cakemp.model.weights.stacking import stack_rows

K = TypeVar("K")
Shape = tuple[int, ...]
Loaded = torch.Tensor | kept.KeptWeight
# What a kept group's members' parts become: the weight that multiplies (kept.weight), or (a read that
# goes on to another device first, model/weights/expert_transfer.py) the parts stacked (KeptParts.cat).
Fuse = Callable[[list[kept.KeptParts]], kept.KeptWeight | kept.KeptParts]


class WeightSource(Protocol):
    """A checkpoint a node reads layers of, whatever holds it (model/weights/readers.py picks one)."""

    container: ClassVar[Container]  # what holds it (checkpoint/files.py)
    config: ModelConfig

    @property
    def stores_kept(self) -> bool:
        """Whether it may hold quantized matrices, which may stay so (compute/loading.kept_kernels)."""

    @property
    def quantized(self) -> bool:
        """Whether it stores any matrix quantized (which `--quantize` would quantize twice)."""

    @property
    def norms_need_one(self) -> bool:
        """Whether a (1 + w) family's norms are stored as w, so that loading adds the 1."""

    def has(self, name: str) -> bool:
        """Whether it holds tensor `name` (HF's name), to tell one storage layout from another."""

    def load(self, groups: dict[K, list[str]], device: torch.device, dtype: torch.dtype,
             plus_one: frozenset[K] = frozenset(), kernels: frozenset[str] = frozenset()) -> dict[K, Loaded]:
        """One `dtype` tensor on `device` per group (or one kept int4, int8 or FP8 weight: `Reader.load`)."""

    def nbytes(self, groups: dict[K, list[str]], dtype: torch.dtype, kernels: frozenset[str] = frozenset()) -> int:
        """Bytes `load` would allocate for these groups on the device, from headers alone."""

    def dequantized_shapes(self, groups: dict[K, list[str]]) -> dict[K, list[Shape]]:
        """The groups holding a weight dequantized from parts whose stored shapes are checked before
        any value is read (a push's weights), each member's shape once read; other groups left out."""

    def mapped(self, groups: dict[K, list[str]]) -> Mapped:
        """The files holding these groups' tensors, opened (memory-mapped) once and kept open for
        repeated reads until `Mapped.close`."""


class Reader:
    """`load` and `nbytes` over weight groups, once for every reader. A subclass says how its files
    are opened (`_headers`, `_opened`, entered on an ExitStack) and how one stored tensor is read."""

    def load(self, groups: dict[K, list[str]], device: torch.device, dtype: torch.dtype,
             plus_one: frozenset[K] = frozenset(), kernels: frozenset[str] = frozenset()) -> dict[K, Loaded]:
        """One `dtype` tensor on `device` per group: its tensors concatenated along dim 0.

        Groups in `plus_one` are norm weights stored as w - 1 (Qwen3.5, Gemma 3): 1 is added
        here, in f32, and they stay f32, so their norm is an ordinary RMSNorm with weight 1 + w,
        as HF computes it (1 + w in f32 on every call). Rounded to bf16, 1 + w would scale each
        channel by up to 2^-9 off, the same way at every position, and such systematic errors
        add up over layers (Cake at fa7d08a adds the 1 in f16).

        Every destination is allocated once and filled by one copy_ per source tensor, which
        casts on the way, so fused weights (q/k/v) cost no extra pass over the bytes. Quantized
        weights are dequantized (in f32, on `device`) first, unless one of `kernels`
        (compute/loading.kept_kernels: "int4", "int8", "fp8") takes every matrix of the group: then
        it stays quantized, a kept.KeptWeight (others are dequantized, and why is logged once).
        """
        with ExitStack() as stack:
            return self._load(self._opened(stack, groups), groups, device, dtype, plus_one, kernels)

    def mapped(self, groups: dict[K, list[str]]) -> Mapped:
        return Mapped(self, groups)

    def _load(self, store: Any, groups: dict[K, list[str]], device: torch.device, dtype: torch.dtype,
              plus_one: frozenset[K] = frozenset(), kernels: frozenset[str] = frozenset(),
              index: int | None = None, fuse: Fuse = kept.weight) -> dict[K, Loaded]:
        """`load` over an opened store; with `index`, matrix `index` of each (stacked) member alone; a
        kept group's members' parts made one by `fuse`."""
        out = {}
        for key, members in groups.items():
            if self._kept(store, members, kernels, index):
                out[key] = fuse([self._kept_parts(store, name, device, index) for name in members])
            else:
                sources = [self._source(store, name, device, index) for name in members]
                out[key] = stack_rows(members, sources, dtype, device, plus_one=key in plus_one)
        return out

    def nbytes(self, groups: dict[K, list[str]], dtype: torch.dtype, kernels: frozenset[str] = frozenset()) -> int:
        """Bytes `load` would allocate for these groups on the device (from the headers): a quantized
        weight counts as what it is loaded as: its kept form's codes and scales where kept, else the
        plain matrix it is dequantized into."""
        with ExitStack() as stack:
            store = self._headers(stack, groups)
            total = 0
            for members in groups.values():
                shapes = self._kept(store, members, kernels)
                if shapes:
                    total += kept.resident_bytes(shapes)
                    continue
                total += sum(self._numel(store, name) for name in members) * dtype.itemsize
            return total

    def _kept(self, store: Any, members: list[str], kernels: frozenset[str],
              index: int | None = None) -> list[kept.KeptShape] | None:
        """The one decision per weight group, for `load` and `nbytes` alike: kept quantized (each
        member's kept.KeptShape) where one of the device's `kernels` (compute/loading.kept_kernels)
        takes every member and they fuse into one weight, else None: dequantized. `index`: of the
        members' matrix `index` (each stored stacked [E, ...])."""
        shapes = self._kept_shapes(store, members, index) if kernels else None
        if shapes is None:
            return None
        reason = kept.fuse_reason(shapes)
        if reason is None and shapes[0].kernel not in kernels:
            reason = f"the {shapes[0].kernel} matmul is not used on this device (compute/loading.kept_kernels)"
        if reason is not None:
            kept.dequantized(reason)
            return None
        return shapes

    def _headers(self, stack: ExitStack, groups: dict[K, list[str]]) -> Any:
        """What reading the groups' headers needs (every name checked to be stored)."""
        raise NotImplementedError

    def _opened(self, stack: ExitStack, groups: dict[K, list[str]]) -> Any:
        """What reading the groups' values needs (every name checked before any file is read)."""
        raise NotImplementedError

    def _kept_shapes(self, store: Any, members: list[str], index: int | None) -> list[kept.KeptShape] | None:
        """Each member's kept.KeptShape (of its matrix `index`, for a stacked one) if a kernel takes each,
        else None (logged once why)."""
        raise NotImplementedError

    def _kept_parts(self, store: Any, name: str, device: torch.device, index: int | None) -> kept.KeptParts:
        """A matrix `_kept_shapes` accepted (`index`: of stacked `name`), in its kernel's convention on `device`."""
        raise NotImplementedError

    def _source(self, store: Any, name: str, device: torch.device, index: int | None) -> torch.Tensor:
        """Tensor `name` (`index`: its matrix `index`, stored stacked [E, ...]) as stored (a view of the
        mapped file) or dequantized in f32 on `device`."""
        raise NotImplementedError

    def _numel(self, store: Any, name: str) -> int:
        """How many values `name` has once read (dequantized where it is quantized)."""
        raise NotImplementedError

    def _stored_nbytes(self, store: Any, name: str) -> int:
        """The bytes `name` is stored in (a quantized weight's parts together), from the headers."""
        raise NotImplementedError


class Mapped:
    """A Reader's files opened once for reads repeated until `close` (an offloaded MoE's experts):
    the group loop of `Reader.load`, over handles that stay mapped, so a read costs its bytes alone."""

    def __init__(self, reader: Reader, groups: dict[K, list[str]]):
        self._reader = reader
        self._stack = ExitStack()
        self._store = reader._opened(self._stack, groups)

    def load(self, groups: dict[K, list[str]], device: torch.device, dtype: torch.dtype,
             kernels: frozenset[str] = frozenset(), index: int | None = None, fuse: Fuse = kept.weight) -> dict[K, Loaded]:
        """As `Reader.load`; with `index`, only matrix `index` of each member (stored stacked [E, ...]) is read;
        `fuse`: what a kept group's parts become (`Fuse`)."""
        return self._reader._load(self._store, groups, device, dtype, kernels=kernels, index=index, fuse=fuse)

    def stored_nbytes(self, names: list[str]) -> int:
        """The bytes these tensors are stored in, their quantized parts' together (headers alone)."""
        return sum(self._reader._stored_nbytes(self._store, name) for name in names)

    def close(self) -> None:
        self._stack.close()
