"""A safetensors checkpoint directory, read one layer span at a time."""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open

from cakemp.checkpoint.files import INDEX, SINGLE, read_weight_map
from cakemp.errors import CheckpointError
from cakemp.model import fp8
from cakemp.checkpoint.config import ModelConfig


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
    ) -> dict[K, torch.Tensor | fp8.Fp8Weight]:
        """One `dtype` tensor on `device` per group: its tensors concatenated along dim 0.

        Groups in `plus_one` are norm weights stored as w - 1 (Qwen3.5, Gemma 3): 1 is added
        here, in f32, and they stay f32, so their norm is an ordinary RMSNorm with weight 1 + w,
        as HF computes it (1 + w in f32 on every call). Rounded to bf16, 1 + w would scale each
        channel by up to 2^-9 off, the same way at every position, and such systematic errors
        add up over layers (Cake at the seed adds the 1 in f16).

        Each shard holding one of the names is opened once (memory-mapped); other shards are
        never opened. Every destination is allocated once and filled by one copy_ per source
        tensor, which casts on the way, so fused weights (q/k/v) cost no extra pass over the
        bytes. FP8 weights are dequantized (in f32, on `device`) first, unless `keep_fp8` and
        the group is FP8 in 128x128 blocks: then it stays FP8, an `fp8.Fp8Weight`.
        """
        with ExitStack() as stack:
            files = self._open(stack, groups)
            out = {}
            for key, members in groups.items():
                handles = [files[self.file_of(name)] for name in members]
                if keep_fp8 and self._kept_fp8(handles, members):
                    stored = [(f.get_tensor(name), f.get_tensor(name + "_scale_inv"))
                              for (f, _), name in zip(handles, members)]
                    out[key] = fp8.Fp8Weight.create(torch.cat([w.to(device) for w, _ in stored]),
                                                    torch.cat([s.to(device) for _, s in stored]))
                    continue
                sources = [self._source(*handle, name, device) for handle, name in zip(handles, members)]
                if len({t.shape[1:] for t in sources}) > 1:
                    shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(members, sources))
                    raise CheckpointError(f"tensors that should stack along dim 0 do not: {shapes}")
                shape = (sum(t.shape[0] for t in sources), *sources[0].shape[1:])
                out[key] = torch.empty(shape, dtype=torch.float32 if key in plus_one else dtype, device=device)
                row = 0
                for t in sources:
                    if key in plus_one:
                        t = t.to(device=device, dtype=torch.float32) + 1
                    if t.device != device and t.dtype != dtype:
                        t = t.to(device)  # cast on the accelerator, not in torch's slow CPU cast
                    out[key][row : row + t.shape[0]].copy_(t)
                    row += t.shape[0]
            return out

    def nbytes(self, groups: dict[K, list[str]], dtype: torch.dtype, keep_fp8: bool = False) -> int:
        """Bytes `load` would allocate for these groups on the device (read from the shards' headers)."""
        with ExitStack() as stack:
            files = self._open(stack, groups)
            total = 0
            for members in groups.values():
                handles = [files[self.file_of(name)] for name in members]
                kept = keep_fp8 and self._kept_fp8(handles, members)
                for (f, present), name in zip(handles, members):
                    if name not in present:
                        raise CheckpointError(f"tensor {name} is missing from {self.dir / self.file_of(name)}")
                    numel = math.prod(f.get_slice(name).get_shape())
                    total += numel * (1 if kept else dtype.itemsize)
            return total

    def _open(self, stack: ExitStack, groups: dict[K, list[str]]) -> dict[str, tuple]:
        """file -> (open handle, names it holds), for each file holding one of the groups' tensors."""
        names = [name for members in groups.values() for name in members]
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

    def _kept_fp8(self, handles: list[tuple], members: list[str]) -> bool:
        """Whether a group can stay FP8: every member stored e4m3 with its scales, in 128x128 blocks."""
        if self.config.fp8_block != (fp8.BLOCK, fp8.BLOCK):
            return False
        for (f, present), name in zip(handles, members):
            if name not in present or name + "_scale_inv" not in present:
                return False
            stored = f.get_slice(name)
            if stored.get_dtype() != "F8_E4M3" or any(side % fp8.BLOCK for side in stored.get_shape()):
                return False
        return True

    def _source(self, f, present: set[str], name: str, device: torch.device) -> torch.Tensor:
        """The stored tensor (a view of the mapped file), or its f32 dequantization on `device`."""
        if name not in present:
            raise CheckpointError(f"tensor {name} is missing from {self.dir / self.file_of(name)}")
        tensor = f.get_tensor(name)
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


