"""Activation bytes with a wire dtype tag ⇄ torch tensors: the one conversion the device
process, the master, the benchmarks and the tests use.

Wire tensors are little-endian, row-major and contiguous (docs/protocol.md, Tensors and
dtypes); only the floating dtypes a hidden state can have are accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cakemp.dtypes import COMPUTE_DTYPES
from cakemp.errors import BadTensor, ConfigError
from cakemp.wire import DType, RawTensor

_WIRE_TO_TORCH = {DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.F32: torch.float32}
_TORCH_TO_WIRE = {torch_dtype: wire for wire, torch_dtype in _WIRE_TO_TORCH.items()}
_NAME_TO_TORCH = {name: _WIRE_TO_TORCH[tag] for name, tag in COMPUTE_DTYPES.items()}


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype for a `--dtype` value (f16, bf16, f32)."""
    try:
        return _NAME_TO_TORCH[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}: expected one of {', '.join(COMPUTE_DTYPES)}") from None


def itemsize(dtype: int) -> int | None:
    """The bytes an element of wire `dtype` takes; None where it is not an activation's dtype."""
    torch_dtype = _WIRE_TO_TORCH.get(dtype)
    return None if torch_dtype is None else torch_dtype.itemsize


def to_tensor(data: bytes | bytearray | memoryview, dtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over `data` (no copy when the buffer is writable). Raises BadTensor."""
    torch_dtype = _WIRE_TO_TORCH.get(dtype)
    if torch_dtype is None:
        raise BadTensor(f"unsupported dtype {DType.describe(dtype)}: activations must be F16, BF16 or F32")
    expected = math.prod(shape) * torch_dtype.itemsize
    if (nbytes := memoryview(data).nbytes) != expected:
        raise BadTensor(f"tensor data is {nbytes} bytes but shape {list(shape)} of {DType(dtype).name} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(data, dtype=torch_dtype).view(shape)


def to_bytes(x: torch.Tensor, dtype: int) -> memoryview:
    """`x` cast to wire `dtype` as little-endian bytes on the CPU (a view of a fresh tensor, no extra copy).

    The cast runs where `x` is, before the copy to the host: one `to(device, dtype)` would cast
    inside the copy, on the CPU, single-threaded."""
    wire = _WIRE_TO_TORCH[dtype]
    # Each conversion only where it changes something: a decode step's output is mostly f32 on the CPU already.
    if x.dtype != wire:
        x = x.to(wire)
    if not x.is_cpu:
        x = x.cpu()
    # bf16 has no numpy dtype: reinterpret as bytes first.
    return memoryview(x.contiguous().reshape(-1).view(torch.uint8).numpy())


def to_bytes_each(xs: Sequence[torch.Tensor], dtype: int) -> list[memoryview]:
    """Each of `xs` as `to_bytes` gives it, all cast and copied to the host together (on a GPU one
    transfer, not one per tensor): views of one buffer, in order."""
    if len(xs) == 1:
        return [to_bytes(xs[0], dtype)]
    flat = to_bytes(torch.cat([x.reshape(-1) for x in xs]), dtype)
    views, at, itemsize = [], 0, _WIRE_TO_TORCH[dtype].itemsize
    for x in xs:
        end = at + x.numel() * itemsize
        views.append(flat[at:end])
        at = end
    return views


def wire_dtype(dtype: torch.dtype) -> DType:
    """The wire tag of a floating torch dtype (F16, BF16, F32)."""
    try:
        return _TORCH_TO_WIRE[dtype]
    except KeyError:
        raise BadTensor(f"unsupported dtype {dtype}: activations must be float16, bfloat16 or float32") from None


def to_raw(x: torch.Tensor, dtype: int) -> RawTensor:
    """`x` as a wire tensor of `dtype` (its shape kept)."""
    return RawTensor(to_bytes(x, dtype), dtype, tuple(x.shape))


def from_raw(raw: RawTensor) -> torch.Tensor:
    """A CPU tensor of a received wire tensor; copied, since a received frame's bytes are read-only."""
    return to_tensor(bytearray(raw.data), raw.dtype, raw.shape)
