"""A safetensors checkpoint directory, read one layer span at a time.

A weight is read as stored, or dequantized into the compute dtype where the checkpoint is
quantized (checkpoint/quantization.py names the stored parts: FP8 e4m3 with block scales,
GPTQ's qweight/qzeros/scales/g_idx, MLX's packed weight/scales/biases). FP8 may stay quantized
on a GPU that multiplies it (model/fp8.py), and so may 4-bit GPTQ and MLX matrices whose groups
torch's int4 matmul takes (model/int4.py); everything else is dequantized where it goes, in f32
on the device, then cast.
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
from cakemp.checkpoint.files import INDEX, SINGLE, is_gguf, read_weight_map
from cakemp.checkpoint.gguf import GgufFile
from cakemp.checkpoint.layout import LINEAR_CONV
from cakemp.checkpoint.quantization import Gptq, GptqParts, MlxAffine, MlxParts, dequantized_shape, norms_carry_one
from cakemp.errors import CheckpointError
from cakemp.model import fp8, gptq, int4, mlx
from cakemp.model.gguf_checkpoint import GgufCheckpoint
from cakemp.model.stacking import stack_rows


K = TypeVar("K")


class Checkpoint:
    """Where each tensor lives: the sharded index's weight_map, or the one model.safetensors."""

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

    def load(
        self,
        groups: dict[K, list[str]],
        device: torch.device,
        dtype: torch.dtype,
        keep_fp8: bool = False,
        plus_one: frozenset[K] = frozenset(),
        keep_int4: bool = False,
    ) -> dict[K, torch.Tensor | fp8.Fp8Weight | int4.Int4Weight]:
        """One `dtype` tensor on `device` per group: its tensors concatenated along dim 0.

        Groups in `plus_one` are norm weights stored as w - 1 (Qwen3.5, Gemma 3): 1 is added
        here, in f32, and they stay f32, so their norm is an ordinary RMSNorm with weight 1 + w,
        as HF computes it (1 + w in f32 on every call). Rounded to bf16, 1 + w would scale each
        channel by up to 2^-9 off, the same way at every position, and such systematic errors
        add up over layers (Cake at fa7d08a adds the 1 in f16).

        Each shard holding one of the names is opened once (memory-mapped); other shards are
        never opened. Every destination is allocated once and filled by one copy_ per source
        tensor, which casts on the way, so fused weights (q/k/v) cost no extra pass over the
        bytes. FP8 weights are dequantized (in f32, on `device`) first, unless `keep_fp8` and
        the group is FP8 in 128x128 blocks: then it stays FP8, an `fp8.Fp8Weight`. Likewise with
        `keep_int4`, a group of 4-bit matrices torch's int4 matmul takes stays 4-bit, an
        `int4.Int4Weight` (others are dequantized, and why is logged once).
        """
        with ExitStack() as stack:
            files = self._open(stack, groups)
            out = {}
            for key, members in groups.items():
                if keep_fp8 and self._kept_fp8(files, members):
                    stored = [(files[self.file_of(name)][0].get_tensor(name),
                               files[self.file_of(name)][0].get_tensor(name + "_scale_inv")) for name in members]
                    out[key] = fp8.Fp8Weight.create(torch.cat([w.to(device) for w, _ in stored]),
                                                    torch.cat([s.to(device) for _, s in stored]))
                    continue
                if keep_int4 and self._int4_shapes(files, members):
                    parts = [self._int4_parts(files, name, device) for name in members]
                    out[key] = int4.Int4Weight.create(int4.Int4Parts.cat(parts))
                    continue
                sources = [self._source(files, name, device) for name in members]
                out[key] = stack_rows(members, sources, dtype, device, plus_one=key in plus_one)
            return out

    def nbytes(self, groups: dict[K, list[str]], dtype: torch.dtype, keep_fp8: bool = False,
               keep_int4: bool = False) -> int:
        """Bytes `load` would allocate for these groups on the device (read from the shards' headers):
        a GPTQ or MLX weight counts as what it is loaded as: int4 codes and scales where kept, else
        the plain matrix it is dequantized into."""
        with ExitStack() as stack:
            files = self._open(stack, groups)
            total = 0
            for members in groups.values():
                shapes = keep_int4 and self._int4_shapes(files, members)
                if shapes:
                    total += sum(int4.resident_bytes(*shape) for shape in shapes)
                    continue
                kept = keep_fp8 and self._kept_fp8(files, members)
                total += sum(self._numel(files, name) for name in members) * (1 if kept else dtype.itemsize)
            return total

    def quantized(self, name: str) -> bool:
        """Whether `name` is stored as GPTQ or MLX parts (read dequantized)."""
        return self._parts(name) is not None

    def shapes(self, groups: dict[K, list[str]]) -> dict[K, list[tuple[int, ...]]]:
        """The shape each group's tensors have once read, from the shards' headers alone, no value read:
        a GPTQ or MLX weight's is the matrix it is dequantized into (the parts checked to fit)."""
        with ExitStack() as stack:
            files = self._open(stack, groups)
            return {key: [self._shape(files, name) for name in members] for key, members in groups.items()}

    @property
    def stores_4bit(self) -> bool:
        """Whether the checkpoint may hold matrices of 4-bit codes (GPTQ, MLX) to keep int4 on a GPU."""
        return isinstance(self.config.quantization, Gptq | MlxAffine)

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
            f, _ = self._open(stack, {conv: [conv]})[self.file_of(conv)]
            return not norms_carry_one(tuple(f.get_slice(conv).get_shape()))

    def _parts(self, name: str) -> GptqParts | MlxParts | None:
        """The quantized parts `name` is stored as (GPTQ, MLX affine), or None for a tensor read as stored."""
        quantization = self.config.quantization
        if not isinstance(quantization, Gptq | MlxAffine):
            return None
        try:
            return quantization.parts(name, self.has)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def _stored(self, name: str) -> list[str]:
        """The stored tensors that make `name`."""
        parts = self._parts(name)
        if isinstance(parts, GptqParts):
            return [part for part in parts if part is not None]
        if isinstance(parts, MlxParts):
            return [parts.weight, parts.scales, parts.biases]
        return [name]

    def _open(self, stack: ExitStack, groups: dict[K, list[str]]) -> dict[str, tuple]:
        """file -> (open handle, names it holds), for each file holding one of the groups' tensors."""
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
            return dequantized_shape(parts, stored, self.config.quantization)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def _int4_shapes(self, files: dict[str, tuple], members: list[str]) -> list[tuple[int, int, int]] | None:
        """(rows, cols, group size) of each member if the group can stay int4: every member a 4-bit
        GPTQ or MLX matrix torch's int4 matmul takes, all in one group size; else None (logged
        once why, for a quantized group)."""
        shapes = []
        for name in members:
            parts = self._parts(name)
            if parts is None:
                return None
            shape = self._int4_shape(files, parts)
            if isinstance(shape, str):
                int4.dequantized(shape)
                return None
            shapes.append(shape)
        if len({shape[2] for shape in shapes}) != 1:
            int4.dequantized("matrices fused together in different group sizes")
            return None
        return shapes

    def _int4_shape(self, files: dict[str, tuple], parts: GptqParts | MlxParts) -> tuple[int, int, int] | str:
        """(rows, cols, group size) of a quantized matrix torch's int4 matmul takes, or why not (headers only,
        and a GPTQ g_idx, [in] int32, to see its groups are in input order)."""
        def shape(name: str) -> list[int]:
            return self._get(files, name).get_slice(name).get_shape()

        if isinstance(parts, MlxParts):
            stored = tuple(shape(parts.weight))
            size = mlx.int4_group(stored, parts.bits, parts.group_size)
            return size if isinstance(size, str) else (stored[0], stored[-1] * 32 // parts.bits, size)
        spec = self.config.quantization
        try:
            out_features, in_features = parts.matrix_shape(lambda part: tuple(shape(part)), spec)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        g_idx = self._get(files, parts.g_idx).get_tensor(parts.g_idx) if parts.g_idx else None
        size = gptq.int4_group(spec, out_features, in_features, shape(parts.scales)[0], g_idx)
        return size if isinstance(size, str) else (out_features, in_features, size)

    def _int4_parts(self, files: dict[str, tuple], name: str, device: torch.device) -> int4.Int4Parts:
        """A matrix `_int4_shapes` accepted, as torch's int4 convention on `device`."""
        parts = self._parts(name)
        stored = self._stored_on(files, name, device)
        try:
            if isinstance(parts, GptqParts):
                groups = stored[parts.scales].shape[0]
                in_features = stored[parts.qweight].shape[0] * 32 // 4
                return gptq.int4_parts(stored[parts.qweight], stored[parts.qzeros], stored[parts.scales],
                                       self.config.quantization, in_features // groups)
            return mlx.int4_parts(stored[parts.weight], stored[parts.scales], stored[parts.biases], parts.group_size)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from None

    def _stored_on(self, files: dict[str, tuple], name: str, device: torch.device) -> dict[str, torch.Tensor]:
        """The stored tensors that make quantized `name`, on `device`: the packed codes are a quarter
        (or less) of its f32 size, so they are dequantized or repacked there."""
        return {part: self._get(files, part).get_tensor(part).to(device) for part in self._stored(name)}

    def _kept_fp8(self, files: dict[str, tuple], members: list[str]) -> bool:
        """Whether a group can stay FP8: every member stored e4m3 with its scales, in 128x128 blocks."""
        if self.config.fp8_block != (fp8.BLOCK, fp8.BLOCK):
            return False
        for name in members:
            f, present = files[self.file_of(name)]
            if name not in present or name + "_scale_inv" not in present:
                return False
            stored = f.get_slice(name)
            if stored.get_dtype() != "F8_E4M3" or any(side % fp8.BLOCK for side in stored.get_shape()):
                return False
        return True

    def _source(self, files: dict[str, tuple], name: str, device: torch.device) -> torch.Tensor:
        """The stored tensor (a view of the mapped file), or its f32 dequantization on `device`."""
        parts = self._parts(name)
        if parts is not None:
            stored = self._stored_on(files, name, device)
            try:
                if isinstance(parts, GptqParts):
                    return gptq.dequantize(*(stored.get(part) for part in parts), self.config.quantization)
                return mlx.dequantize(stored[parts.weight], stored[parts.scales], stored[parts.biases],
                                      parts.bits, parts.group_size)
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
        f, present = files[self.file_of(name)]
        tensor = self._get(files, name).get_tensor(name)
        if name.endswith(LINEAR_CONV) and tensor.dim() == 3 and tensor.shape[1] > 1 and tensor.shape[2] == 1:
            return tensor.transpose(1, 2)  # MLX's depthwise conv layout [C, K, 1] -> HF's [C, 1, K]
        scale_name = name + "_scale_inv"
        if tensor.dtype != torch.float8_e4m3fn or scale_name not in present:
            return tensor
        if self.config.fp8_block is None:
            raise CheckpointError(f"{name} has a {scale_name} but config.json declares no fp8 quantization")
        try:
            # Dequantize where the weight goes: the e4m3 bytes are a quarter of its f32 size.
            return fp8.dequantize(tensor.to(device), f.get_tensor(scale_name).to(device), self.config.fp8_block)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from None


AnyCheckpoint = Checkpoint | GgufCheckpoint


def open_checkpoint(model: str | Path, config: ModelConfig | None = None) -> AnyCheckpoint:
    """The checkpoint `--model` names: a safetensors directory, or a GGUF file. Without `config`
    (the model's, where the caller has it) it is read here, a GGUF file's from the same parse of
    its header as the checkpoint's (tenths of a second for a vocabulary of 152k tokens)."""
    if not is_gguf(model):
        return Checkpoint(model, ModelConfig.from_dir(model) if config is None else config)
    gguf = GgufFile(model)
    return GgufCheckpoint(model, ModelConfig.from_gguf(gguf) if config is None else config, gguf)
