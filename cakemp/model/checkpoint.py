"""A safetensors checkpoint directory, read one layer span at a time."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from cakemp.errors import CheckpointError
from cakemp.model import fp8
from cakemp.model.config import ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Checkpoint:
    """Where each tensor lives: the sharded index's weight_map, or the one model.safetensors."""

    def __init__(self, model_dir: str | Path, config: ModelConfig):
        self.dir = Path(model_dir)
        self.config = config
        index = self.dir / INDEX
        if index.exists():
            try:
                self.weight_map: dict[str, str] | None = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{index} has no readable weight_map: {exc}") from None
        elif (self.dir / SINGLE).exists():
            self.weight_map = None
        else:
            raise CheckpointError(f"{self.dir} has neither {INDEX} nor {SINGLE}")

    def file_of(self, name: str) -> str:
        """The file a tensor is expected in (for a sharded checkpoint, the index when unlisted)."""
        if self.weight_map is None:
            return SINGLE
        return self.weight_map.get(name, INDEX)

    def load(
        self, names: list[str], device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Read `names` straight onto `device`, cast to `dtype`; FP8 weights are dequantized first.

        Each shard holding one of them is opened once; other shards are never opened.
        """
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.file_of(name)].append(name)
        if INDEX in by_file:
            raise CheckpointError(f"tensor {by_file[INDEX][0]} is missing from {self.dir / INDEX}")
        tensors = {}
        for file, file_names in by_file.items():
            path = self.dir / file
            try:
                with safe_open(path, framework="pt", device=_safetensors_device(device)) as f:
                    present = set(f.keys())
                    for name in file_names:
                        if name not in present:
                            raise CheckpointError(f"tensor {name} is missing from {path}")
                        tensors[name] = self._read(f, present, name, dtype)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {path}: {exc}") from None
        return tensors

    def _read(self, f, present: set[str], name: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = f.get_tensor(name)
        scale_name = name + "_scale_inv"
        if tensor.dtype == torch.float8_e4m3fn and scale_name in present:
            if self.config.fp8_block is None:
                raise CheckpointError(f"{name} has a {scale_name} but config.json declares no fp8 quantization")
            try:
                tensor = fp8.dequantize(tensor, f.get_tensor(scale_name), self.config.fp8_block)
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
        return tensor.to(dtype)


def _safetensors_device(device: torch.device) -> str:
    """safetensors wants an indexed device name ("cuda:0"), never a bare "cuda"."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)
