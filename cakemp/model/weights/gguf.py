"""A GGUF file read as a checkpoint: the tensors asked for, under their HF names, dequantized
into the compute dtype, and nothing else.

The file is memory-mapped for each load and only the byte ranges of the tensors asked for are
read (checkpoint/gguf.py says where each lies; the kernel's read-around is switched off for the
map and each range asked for ahead), so a node serving 4 layers of 80 reads 4 layers' bytes;
Cake dequantizes every tensor of the file to f32 on every node. Each tensor's
bytes go to the device as they are stored (a quarter of their f32 size or less for the
quantized types) and are dequantized there in f32 (model/weights/ggml.py), then cast; llama.cpp's Q/K
row permutation (Llama family) is undone on the f32 rows, which quantization leaves whole
(its blocks run along a row). Where the device keeps int4 (compute/loading.kept_kernels), Q4_0, Q4_1
and Q4_K matrices stay 4-bit instead, repacked for torch's int4 matmul (model/weights/int4.py; their 32-value blocks, Q4_K's
sub-blocks, are its groups of 32), the permutation undone on their code and scale rows alike. Q8_0's blocks
of 32 have no exact form for torch's int8 matmul (one scale a row: model/weights/int8.py): dequantized.

A WeightSource (source.py), whose group loop it shares with the safetensors Checkpoint, so the
loaders take either (readers.py: open_checkpoint).
"""

from __future__ import annotations

import mmap
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import GGUF
from cakemp.checkpoint.gguf import GgufFile
from cakemp.checkpoint.gguf_model import hf_names, permuted_heads
from cakemp.errors import CheckpointError
from cakemp.model.weights import ggml, int4, kept
from cakemp.model.weights.source import Reader

_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
K = TypeVar("K")


class GgufCheckpoint(Reader):
    container = GGUF
    # No family read from GGUF stores (1 + w) norms (checkpoint/gguf_model.py: llama, qwen2, qwen3, qwen3moe).
    norms_need_one = False

    @classmethod
    def open(cls, path: str | Path, config: ModelConfig | None = None) -> GgufCheckpoint:
        """The GGUF file at `path`, its config read unless given from the same parse of its header
        as the checkpoint's (tenths of a second for a vocabulary of 152k tokens)."""
        file = GgufFile(path)
        return cls(path, ModelConfig.from_gguf(file) if config is None else config, file)

    def __init__(self, path: str | Path, config: ModelConfig, file: GgufFile | None = None):
        """`file`: the file at `path` already parsed, else parsed here."""
        self.path = Path(path)
        self.config = config
        self.file = GgufFile(self.path) if file is None else file
        self.names = hf_names(self.file.tensors)  # HF name -> GGUF name

    @property
    def stores_kept(self) -> bool:
        """Whether the file holds matrices of ggml.INT4_TYPES, which may stay int4."""
        return any(info.type.name in ggml.INT4_TYPES for info in self.file.tensors.values())

    @property
    def quantized(self) -> bool:
        """Whether the file holds any tensor of a quantized ggml type (anything but F32, F16, BF16, F64)."""
        return any(info.type.name not in _FLOAT_TYPES for info in self.file.tensors.values())

    def has(self, name: str) -> bool:
        return name in self.names

    def dequantized_shapes(self, groups: dict[K, list[str]]) -> dict[K, list[tuple[int, ...]]]:
        """None: a GGUF file is never pushed (it is the operator's own), so its tensors' shapes are
        checked once loaded only."""
        return {}

    def _headers(self, stack: ExitStack, groups: dict[K, list[str]]) -> None:
        for name in (name for members in groups.values() for name in members):
            self._gguf_name(name)  # every name checked before the file is mapped

    def _opened(self, stack: ExitStack, groups: dict[K, list[str]]) -> mmap.mmap:
        """The file mapped for reading the groups' tensors, unmapped as `stack` closes."""
        self._headers(stack, groups)
        with open(self.path, "rb") as f:
            # A private (copy-on-write) map: torch takes only writable buffers, and nothing writes to it.
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        # No read-around: the kernel would read up to read_ahead_kb (MiBs) about each page touched,
        # other layers' bytes included; each tensor's own range is asked for ahead instead (_raw).
        data.madvise(mmap.MADV_RANDOM)
        stack.callback(_unmap, data)
        return data

    def _kept_shapes(self, data: mmap.mmap | None, members: list[str], index: int | None) -> list[int4.Int4Shape] | None:
        infos = [self.file.tensors[self._gguf_name(name)] for name in members]
        return _kept_shapes([(info.type.name, _matrix_shape(info.shape, index)) for info in infos])

    def _numel(self, data: mmap.mmap | None, name: str) -> int:
        return self.file.tensors[self._gguf_name(name)].numel

    def _stored_nbytes(self, data: mmap.mmap | None, name: str) -> int:
        return self.file.tensors[self._gguf_name(name)].nbytes

    def _gguf_name(self, name: str) -> str:
        if name not in self.names:
            raise CheckpointError(f"{self.path} has no tensor for {name}")
        return self.names[name]

    def _source(self, data: mmap.mmap, name: str, device: torch.device, index: int | None) -> torch.Tensor:
        """HF tensor `name` (`index`: its matrix `index`, stacked experts') in f32 on `device`, from its stored bytes."""
        info, raw = self._raw(data, name, device, index)
        tensor = ggml.dequantize(raw, info.type.name, _matrix_shape(info.shape, index))
        heads = permuted_heads(self.file, info.name, self.config.num_attention_heads, self.config.num_key_value_heads)
        return tensor if heads is None else unpermute(tensor, heads)

    def _kept_parts(self, data: mmap.mmap, name: str, device: torch.device, index: int | None) -> int4.Int4Parts:
        """HF matrix `name` (of ggml.INT4_TYPES; `index`: its matrix `index`) in torch's int4 convention on
        `device`, rows in HF's order."""
        info, raw = self._raw(data, name, device, index)
        parts = ggml.int4_parts(raw, info.type.name, _matrix_shape(info.shape, index))
        heads = permuted_heads(self.file, info.name, self.config.num_attention_heads, self.config.num_key_value_heads)
        return parts if heads is None else parts.rows(lambda rows: unpermute(rows, heads))

    def _raw(self, data: mmap.mmap, name: str, device: torch.device, index: int | None = None):
        """(its TensorInfo, its stored bytes: uint8 [nbytes] on `device`) of HF tensor `name`; with `index`,
        the bytes of its matrix `index` alone (a stacked tensor's matrices lie one after another, in
        whole blocks: ggml's blocks run along a row)."""
        info = self.file.tensors[self._gguf_name(name)]
        start, nbytes = info.start, info.nbytes
        if index is not None:
            nbytes //= info.shape[0]
            start += index * nbytes
        first_page = start // mmap.PAGESIZE * mmap.PAGESIZE
        data.madvise(mmap.MADV_WILLNEED, first_page, start + nbytes - first_page)  # one read of the range
        return info, torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start).to(device)


def _unmap(data: mmap.mmap) -> None:
    try:
        data.close()  # the views of it are gone: each was copied into its group's tensor
    except BufferError:  # an error's traceback still holds one: the map goes with it
        pass


def _kept_shapes(matrices: list[tuple[str, tuple[int, ...]]]) -> list[int4.Int4Shape] | None:
    """Each (ggml type, shape)'s int4.Int4Shape if the group can stay int4: every one a ggml.INT4_TYPES
    matrix torch's int4 matmul takes; else None (logged once why, for a group of quantized matrices)."""
    shapes = []
    for kind, shape in matrices:
        size = ggml.int4_group(kind, shape)
        if isinstance(size, str):
            if kind not in ("F32", "F16", "BF16"):  # a plain tensor (a norm) is no 4-bit one
                kept.dequantized(size)
            return None
        shapes.append(int4.Int4Shape(*shape, size))
    return shapes


def _matrix_shape(shape: tuple[int, ...], index: int | None) -> tuple[int, ...]:
    """A tensor's shape, or (`index`) that of one of its stacked matrices."""
    return shape if index is None else tuple(shape[1:])


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter's reordering of q/k rows. HF's rotary pairs dimension i with
    i + D/2 of each head; llama.cpp's rotates adjacent pairs (2i, 2i + 1), so its converter
    stores each head's rows as [r0, r_{D/2}, r1, r_{D/2+1}, ...]. w: [heads * D, ...] in that
    order -> HF's [heads * D, ...] (a weight [rows, H] or a bias [rows])."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
