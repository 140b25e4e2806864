"""The one place a checkpoint's reader is picked: `open_checkpoint`, by what holds it (the
torch-free `checkpoint.files.container_of`), one row of READERS per container."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import DIRECTORY, GGUF, Container, container_of
from cakemp.model.weights.gguf import GgufCheckpoint
from cakemp.model.weights.safetensors import Checkpoint
from cakemp.model.weights.source import WeightSource

READERS: dict[Container, Callable[[str | Path, ModelConfig | None], WeightSource]] = {
    DIRECTORY: Checkpoint.open,
    GGUF: GgufCheckpoint.open,
}


def open_checkpoint(model: str | Path, config: ModelConfig | None = None) -> WeightSource:
    """The checkpoint `--model` names: a safetensors directory, or a GGUF file. Without `config`
    (the model's, where the caller has it) it is read here, by the reader, once with the weights'
    index (a GGUF file's header is parsed once for both)."""
    return READERS[container_of(model)](model, config)
