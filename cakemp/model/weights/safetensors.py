"""A safetensors checkpoint directory, read one layer span at a time.

A weight is read as stored, or where the checkpoint is quantized as the parts it is stored as
(FP8's e4m3 beside its block scales, GPTQ's qweight/qzeros/scales/g_idx, MLX's packed
weight/scales/biases), which model/weights/quantized.py picks the format's QuantizedParts for, so
nothing here asks which format it is: the parts say whether a kept kernel takes them
(model/weights/kept.py: int4, int8, fp8) and how they dequantize, in f32 on the device, then cast.
A WeightSource (source.py), whose group loop it shares with the GGUF reader; how a shard is opened
and a stored tensor read is its own.
"""

from __future__ import annotations

import functools
import math
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import DIRECTORY, INDEX, SINGLE, read_weight_map
from cakemp.checkpoint.layout import LINEAR_CONV
from cakemp.checkpoint.quantization import norms_carry_one
from cakemp.errors import CheckpointError
from cakemp.model.weights import kept, quantized
from cakemp.model.weights.quantized import QuantizedParts
from cakemp.model.weights.source import Reader

K = TypeVar("K")
_SCALED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Bytes per value of each safetensors dtype a checkpoint may store.
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class Checkpoint(Reader):
    """Where each tensor lives: the sharded index's weight_map, or the one model.safetensors."""

    container = DIRECTORY

    @classmethod
    def open(cls, model_dir: str | Path, config: ModelConfig | None = None) -> Checkpoint:
        """The checkpoint directory `model_dir`, its config.json read unless given."""
        return cls(model_dir, ModelConfig.from_dir(model_dir) if config is None else config)

    def __init__(self, model_dir: str | Path, config: ModelConfig):
        self.dir = Path(model_dir)
        self.config = config
        index = self.dir / INDEX
        if index.exists():
            self.weight_map: dict[str, str] | None = read_weight_map(index)
        elif (self.dir / SINGLE).exists():
            self.weight_map = None
            self._single_names: frozenset[str] | None = None
        else:
            raise CheckpointError(f"{self.dir} has neither {INDEX} nor {SINGLE}")

    def file_of(self, name: str) -> str:
        """The file a tensor is expected in (for a sharded checkpoint, the index when unlisted)."""
        if self.weight_map is None:
            return SINGLE
        return self.weight_map.get(name, INDEX)

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor `name` (to tell one storage layout from another)."""
        if self.weight_map is not None:
            return name in self.weight_map
        if self._single_names is None:
            try:
                with safe_open(self.dir / SINGLE, framework="pt", device="cpu") as f:
                    self._single_names = frozenset(f.keys())
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {self.dir / SINGLE}: {exc}") from None
        return name in self._single_names

    def dequantized_shapes(self, groups: dict[K, list[str]]) -> dict[K, list[tuple[int, ...]]]:
        """The groups holding a quantized weight, each member's shape once read, from the shards' headers
        alone, no value read: a quantized weight's is the matrix it is dequantized into (the parts
        checked to fit)."""
        quantized = {key: names for key, names in groups.items() if any(self._parts(name) for name in names)}
        with ExitStack() as stack:
            files = self._headers(stack, quantized)
            return {key: [self._shape(files, name) for name in members] for key, members in quantized.items()}

    @property
    def stores_kept(self) -> bool:
        """Whether the checkpoint may hold weights stored as quantized parts, which may stay quantized."""
        return quantized.stores_parts(self.config.quantization)

    @property
    def quantized(self) -> bool:
        """Whether config.json declares a quantization (FP8, GPTQ, MLX affine)."""
        return self.config.quantization is not None

    @functools.cached_property
    def norms_need_one(self) -> bool:
        """Whether a (1 + w) family's norms are stored as w (HF's way), so that loading adds the 1;
        False where they carry it already (mlx-lm's Qwen3.5 conversions, told apart by their
        conv1d layout: checkpoint/quantization.norms_carry_one)."""
        if not self.config.layout.norm_plus_one:
            return False
        # Any linear-attention layer's convolution tells; a zero-config cache holds only the
        # shards of the layers it was assigned, so the first one whose shard is here.
        convs = (f"{self.config.layer_name(i)}.{LINEAR_CONV}" for i in sorted(self.config.linear_layers))
        conv = next((name for name in convs if self.has(name) and (self.dir / self.file_of(name)).exists()), None)
        if conv is None:
            return True
        with ExitStack() as stack:
            f, _ = self._headers(stack, {conv: [conv]})[self.file_of(conv)]
            return not norms_carry_one(tuple(f.get_slice(conv).get_shape()))

    def _parts(self, name: str) -> QuantizedParts | None:
        """The quantized parts `name` is stored as, or None for a tensor read as stored."""
        try:
            return quantized.parts_of(self.config.quantization, name, self.has)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def _stored(self, name: str) -> list[str]:
        """The stored tensors that make `name`."""
        parts = self._parts(name)
        return [name] if parts is None else list(parts.parts.stored)

    def _headers(self, stack: ExitStack, groups: dict[K, list[str]]) -> dict[str, tuple]:
        """file -> (open handle, names it holds), for each file holding one of the groups' tensors:
        each shard holding one of the names is opened once (memory-mapped), other shards never."""
        names = [stored for members in groups.values() for name in members for stored in self._stored(name)]
        missing = [name for name in names if self.file_of(name) == INDEX]
        if missing:
            raise CheckpointError(f"tensor {missing[0]} is missing from {self.dir / INDEX}")
        files = {}
        for file in dict.fromkeys(self.file_of(name) for name in names):
            path = self.dir / file
            try:
                handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {path}: {exc}") from None
            files[file] = (handle, set(handle.keys()))
        return files

    _opened = _headers  # the values are read through the same mapped handles

    def _get(self, files: dict[str, tuple], name: str):
        """The open handle holding `name` (CheckpointError if its file lacks it)."""
        f, present = files[self.file_of(name)]
        if name not in present:
            raise CheckpointError(f"tensor {name} is missing from {self.dir / self.file_of(name)}")
        return f

    def _numel(self, files: dict[str, tuple], name: str) -> int:
        """How many values `name` has once read (dequantized where it is quantized)."""
        return math.prod(self._shape(files, name))

    def _shape(self, files: dict[str, tuple], name: str) -> tuple[int, ...]:
        """The shape `name` has once read, from the shards' headers: a quantized weight's is the matrix
        it is dequantized into, its parts' shapes checked to fit (CheckpointError naming the one that does not)."""
        def stored(part: str) -> tuple[int, ...]:
            return tuple(self._get(files, part).get_slice(part).get_shape())

        parts = self._parts(name)
        if parts is None:
            return stored(name)
        try:
            return parts.parts.matrix_shape(stored)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def _kept_shapes(self, files: dict[str, tuple], members: list[str],
                     index: int | None) -> list[kept.KeptShape] | None:
        """Each member's kept.KeptShape (of its matrix `index`, for a stacked one) if every member is a
        quantized matrix one of the kept kernels takes; else None (logged once why, for a quantized group)."""
        shapes = []
        for name in members:
            parts = self._parts(name)
            if parts is None:
                return None
            shape = self._kept_shape(files, parts, index)
            if isinstance(shape, str):
                kept.dequantized(shape)
                return None
            shapes.append(shape)
        return shapes

    def _kept_shape(self, files: dict[str, tuple], parts: QuantizedParts, index: int | None) -> kept.KeptShape | str:
        """The kept.KeptShape of a quantized matrix (`index`: of a stacked one's) one of the kept
        kernels takes, or why not (headers, and what small part a format reads to tell: GPTQ's g_idx)."""
        def shape(name: str) -> tuple[int, ...]:
            stored = tuple(self._get(files, name).get_slice(name).get_shape())
            return stored if index is None else stored[1:]

        try:
            return parts.kept_shape(shape, lambda name: self._read(files, name, index))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def _kept_parts(self, files: dict[str, tuple], name: str, device: torch.device, index: int | None) -> kept.KeptParts:
        """A matrix `_kept_shapes` accepted (`index`: of stacked `name`), in its kernel's convention on `device`."""
        try:
            return self._parts(name).kept_parts(self._stored_on(files, name, device, index))
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from None

    def _stored_on(self, files: dict[str, tuple], name: str, device: torch.device,
                   index: int | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors that make quantized `name` (`index`: their matrix `index`), on `device`: the
        packed codes are a quarter (or less) of its f32 size, so they are dequantized or repacked there."""
        return {part: self._read(files, part, index).to(device) for part in self._stored(name)}

    def _read(self, files: dict[str, tuple], name: str, index: int | None) -> torch.Tensor:
        """Stored tensor `name`, or (`index`) its matrix `index` alone, only those bytes read from the map."""
        f = self._get(files, name)
        return f.get_tensor(name) if index is None else f.get_slice(name)[index]

    def _stored_nbytes(self, files: dict[str, tuple], name: str) -> int:
        total = 0
        for part in self._stored(name):
            stored = self._get(files, part).get_slice(part)
            total += math.prod(stored.get_shape()) * _ITEMSIZE[stored.get_dtype()]
        return total

    def _source(self, files: dict[str, tuple], name: str, device: torch.device, index: int | None) -> torch.Tensor:
        """The stored tensor (`index`: its matrix `index`), a view of the mapped file, or its f32
        dequantization on `device`."""
        parts = self._parts(name)
        if parts is not None:
            try:
                return parts.dequantize(self._stored_on(files, name, device, index))
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
        tensor = self._read(files, name, index)
        if tensor.dtype in _SCALED_DTYPES:  # 8-bit floats mean nothing without the scales a form declares
            raise CheckpointError(f"{name} is stored as {tensor.dtype}, but config.json declares no quantization "
                                  "whose scales it is read with")
        if name.endswith(LINEAR_CONV) and tensor.dim() == 3 and tensor.shape[1] > 1 and tensor.shape[2] == 1:
            return tensor.transpose(1, 2)  # MLX's depthwise conv layout [C, K, 1] -> HF's [C, 1, K]
        return tensor
