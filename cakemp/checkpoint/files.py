"""A Hugging Face checkpoint directory's files, named once: which files there are, which tensors
belong to a layer, what a layer is called, and a safetensors file's header (read without torch).

The front (setup, admission), the master (pushes, assignment) and the torch loader
(`model/weights/safetensors.py`) all ask these questions; this is the one place each is answered.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cakemp.checkpoint.gguf import GgufFile
from cakemp.checkpoint.gguf_model import hf_config, hf_names
from cakemp.errors import CheckpointError

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Cake pushes files in chunks of at most this many bytes before compression (MODEL_DATA_CHUNK_SIZE).
PUSH_CHUNK_BYTES = 128 << 20

# A layer's name: dotted identifiers, then the layer's number ("model.layers.7").
_LAYER_NAME = re.compile(r"(?P<prefix>[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)\.(?P<index>[0-9]+)")
# A layer's tensor: "<prefix>.layers.<N>.<rest>".
_LAYER_TENSOR = re.compile(r"(?P<prefix>(?:[A-Za-z0-9_]+\.)*layers)\.[0-9]+\.")
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


@dataclass(frozen=True)
class Container:
    """What holds a checkpoint on disk: one row of CONTAINERS, picked by `container_of`. A file
    container carries its config and its tensors' sizes in its own header (`hf_config`,
    `tensor_bytes`: what a directory's config.json and safetensors headers say); a directory
    (`suffix` "") has config.json and safetensors files."""

    name: str  # as a message names it
    suffix: str  # a `--model` whose name ends so is one; "": any other (a directory)
    pushable: bool  # zero-config setup may push it to workers (Cake serves a GGUF file in topology mode only)
    hf_config: Callable[[Path], dict[str, Any]] | None = None  # a file's config, as config.json would hold it
    tensor_bytes: Callable[[Path], dict[str, int]] | None = None  # a file's tensors (HF names) -> bytes stored

    @property
    def is_file(self) -> bool:
        return bool(self.suffix)


def _gguf_tensor_bytes(path: Path) -> dict[str, int]:
    gguf = GgufFile(path)
    return {name: gguf.tensors[stored].nbytes for name, stored in hf_names(gguf.tensors).items()}


DIRECTORY = Container("safetensors", "", pushable=True)
GGUF = Container(".gguf", ".gguf", pushable=False, hf_config=lambda path: hf_config(GgufFile(path)),
                 tensor_bytes=_gguf_tensor_bytes)
CONTAINERS = (GGUF, DIRECTORY)  # the first whose suffix `--model` ends with; the directory last


def container_of(model: str | Path) -> Container:
    """What holds the checkpoint `--model` names: a GGUF file (checkpoint/gguf.py) when its name ends
    in .gguf, as Cake decides it, else a checkpoint directory. The one place `--model` is told apart."""
    return next(container for container in CONTAINERS if str(model).endswith(container.suffix))


def split_layer(name: str) -> tuple[str, int] | None:
    """"model.layers.7" -> ("model.layers", 7); None when `name` is not a layer's name."""
    match = _LAYER_NAME.fullmatch(name)
    return (match["prefix"], int(match["index"])) if match else None


def layer_prefix(names: Iterable[str], default: str) -> str:
    """The prefix the decoder layers are stored under: `default` (the family's) when some name
    is one of its layers' tensors, else, as Cake detects it, that of the first name in sorted
    order that is a layer's tensor (Cake asks for layer 0's; a push of later layers holds none),
    e.g. "language_model.model.layers" in mlx-lm's Qwen3.5 conversions. A multi-token-prediction
    head's layers ("mtp.layers.0.", beside Qwen3.5's decoder) are never the decoder's."""
    found = {match["prefix"] for name in names if (match := _LAYER_TENSOR.match(name))}
    if default in found:
        return default
    found = {prefix for prefix in found if prefix.rpartition(".")[0].rpartition(".")[2] != "mtp"}
    return min(found, default=default)


def stored_names(model_dir: Path) -> list[str]:
    """The tensor names a checkpoint directory holds (its index's, or its one file's); [] for neither."""
    if (model_dir / INDEX).exists():
        return list(read_weight_map(model_dir / INDEX))
    if (model_dir / SINGLE).exists():
        return sorted(safetensors_names(model_dir / SINGLE))
    return []


def in_layer(tensor: str, layer: str) -> bool:
    """Whether `tensor` is one of `layer`'s weights (Cake's rule: its name starts with "<layer>.")."""
    return tensor.startswith(layer + ".")


def read_weight_map(index: Path, max_bytes: int | None = None) -> dict[str, str]:
    """An index's `weight_map` (tensor name -> shard file name), checked to be one; CheckpointError if not."""
    if max_bytes is not None and index.stat().st_size > max_bytes:
        raise CheckpointError(f"{index.name} is over {max_bytes} bytes")
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index.name} is not a safetensors index: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index.name}: weight_map must map tensor names to file names")
    return weight_map


def safetensors_header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header (u64 LE length, then JSON) and that length; CheckpointError if bad."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        if length > _MAX_HEADER_BYTES:
            raise CheckpointError(f"{path.name}: safetensors header of {length} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise CheckpointError(f"{path.name}: bad safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: bad safetensors header")
    return length, header


def safetensors_names(path: Path) -> set[str]:
    """The tensor names in a safetensors file."""
    return set(safetensors_header(path)[1]) - {"__metadata__"}


def safetensors_whole(path: Path) -> bool:
    """Whether the file is exactly as long as its header says: 8 + header + the last tensor's end."""
    length, header = safetensors_header(path)
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return os.lstat(path).st_size == 8 + length + max(ends, default=0)


def estimated_layer_bytes(model_dir: Path, num_layers: int, prefix: str) -> int:
    """One decoder layer's size as Cake estimates it (`estimate_layer_size`): the bytes of the
    tensors named "<prefix>.…" in the weight files' headers over `num_layers`; where a file named
    by the index is missing or its header unreadable, or no tensor is a layer's, the files' sizes
    over `num_layers`; 0 without weight files. A GGUF file: its layers' tensors as stored (so the
    same estimate as Cake's for any quantized checkpoint: the bytes on disk, not once dequantized)."""
    if num_layers <= 0:
        return 0
    tensor_bytes = container_of(model_dir).tensor_bytes
    if tensor_bytes is not None:
        return layer_bytes_of(tensor_bytes(model_dir), num_layers, prefix)
    try:
        names = weight_files(model_dir)
    except CheckpointError:
        names = [SINGLE]
    present = [model_dir / name for name in names if (model_dir / name).is_file()]
    try:
        headers = [safetensors_header(path)[1] for path in present] if len(present) == len(names) else []
    except (OSError, CheckpointError):
        headers = []
    in_layers = layer_bytes_of({name: _tensor_bytes(entry) for header in headers for name, entry in header.items()},
                               num_layers, prefix)
    return in_layers or sum(path.stat().st_size for path in present) // num_layers


def weight_files(model_dir: Path) -> list[str]:
    """The weight files of a checkpoint directory: those its index names, else the one model.safetensors."""
    return sorted(set(read_weight_map(model_dir / INDEX).values())) if (model_dir / INDEX).exists() else [SINGLE]


def layer_bytes_of(sizes: Mapping[str, int], num_layers: int, prefix: str) -> int:
    """The bytes of the tensors named "<prefix>.…" among `sizes` (tensor name -> bytes) over `num_layers`."""
    return sum(size for name, size in sizes.items() if name.startswith(prefix + ".")) // max(1, num_layers)


def _tensor_bytes(entry: object) -> int:
    """A header entry's size (its data_offsets' end less start); 0 for an entry without sound offsets."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return 0
    return max(0, offsets[1] - offsets[0])
