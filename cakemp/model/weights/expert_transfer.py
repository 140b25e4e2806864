"""How an offloaded MoE expert (model/weights/experts.py) reaches its device: `transfer(device)`.

* A CPU (`DirectReads`): read straight into compute form where it is computed; nothing else.
* A GPU (`StagedCopies`): read on the host in the form that goes on to the GPU (plain matrices
  dequantized into the compute dtype; a 4-bit expert the int4 kernel takes as its int4 parts, codes
  one a byte and f32 scales and zeros, so that it is packed for the GPU's kernel there and stays
  4-bit in the GPU's cache), copied into a bounded ring of pinned host memory (`PinnedPool`), and
  from it to the GPU with non_blocking copies on a side stream, where kept parts are then packed;
  the compute stream waits on the copy's event only when it uses the expert (`ready`), so the
  copies overlap whatever the compute stream runs meanwhile (the shared expert, the held experts).
  Each tensor made on the side stream is recorded on the compute stream when handed over, so that
  the allocator does not reuse its memory while the compute stream may still read it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cakemp.model.weights import kept
from cakemp.model.weights.experts import ExpertLoad, Pair, Transfer, pair_nbytes

HOST = torch.device("cpu")
PINNED_POOL_BYTES = 64 << 20  # a decode step's misses of a large MoE layer (8 experts of 6 MiB in bf16) in flight
_ALIGN = 512  # each staged tensor starts on a 512-byte boundary (any dtype's view; DMA-friendly)


def transfer(device: torch.device) -> Transfer:
    """The way offloaded experts reach `device`: staged copies on a GPU, direct reads anywhere else."""
    if device.type == "cuda":
        return StagedCopies(device, PinnedPool(PINNED_POOL_BYTES, pin=True), torch.cuda.Stream(device))
    return DirectReads(device)


@dataclass(frozen=True)
class Done:
    """An expert read on its device already."""

    pair: Pair

    @property
    def nbytes(self) -> int:
        return pair_nbytes(self.pair)

    def ready(self) -> Pair:
        return self.pair


@dataclass(frozen=True)
class DirectReads:
    """Each expert read straight into compute form on `device` (a CPU's: the page cache is its staging)."""

    device: torch.device

    def begin(self, load: ExpertLoad) -> Done:
        return Done(load(self.device, kept.weight))


class Waitable(Protocol):
    def synchronize(self) -> None:
        """Block until the copy it marks is done (torch.cuda.Event's)."""


class PinnedPool:
    """A ring of `capacity` bytes of host memory (pinned where `pin`), allocated at first use and
    reused: each tensor moved `through` it is copied into the next free bytes, which stay busy
    until the copy out of them is done; bytes still busy are waited for before reuse, the oldest
    copy first. A tensor larger than the ring grows it to that size once every copy is done, so
    the pool holds at most max(capacity, the largest tensor moved through it)."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity = capacity
        self.pin = pin
        self.allocations = 0  # rings allocated (one, unless a tensor outgrew it)
        self.waits = 0  # copies waited for before their bytes were reused
        self._ring: torch.Tensor | None = None  # [capacity] uint8
        self._head = 0  # where the next tensor goes
        self._busy: deque[tuple[int, int, Waitable]] = deque()  # [start, end) and its copy's event, oldest first

    def through(self, tensor: torch.Tensor, move: Callable[[torch.Tensor], tuple[torch.Tensor, Waitable]]) -> torch.Tensor:
        """What `move` makes of a copy of `tensor` in the ring (`move` -> the moved tensor, and what is
        done once the ring's bytes have been read: a CUDA event recorded after a non_blocking copy)."""
        size = -(-tensor.nbytes // _ALIGN) * _ALIGN
        if self._ring is None or size > self._ring.numel():
            self._allocate(max(self.capacity, size))
        if self._head + size > self._ring.numel():
            self._head = 0
        start, end = self._head, self._head + size
        while any(s < end and start < e for s, e, _ in self._busy):
            self._busy.popleft()[2].synchronize()
            self.waits += 1
        self._head = end
        staged = self._ring[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        moved, done = move(staged)
        self._busy.append((start, end, done))
        return moved

    def _allocate(self, size: int) -> None:
        while self._busy:
            self._busy.popleft()[2].synchronize()
        self._ring = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self._head = 0
        self.allocations += 1


@dataclass(frozen=True)
class InFlight:
    """An expert whose copy to the GPU was queued on a side stream, `event` recorded after it."""

    pair: Pair
    event: torch.cuda.Event
    device: torch.device

    @property
    def nbytes(self) -> int:
        return pair_nbytes(self.pair)

    def ready(self) -> Pair:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for weight in self.pair:
            for tensor in _tensors(weight):
                tensor.record_stream(stream)
        return self.pair


class StagedCopies:
    """Experts read on the host, staged in `pool` and copied to `device` on `stream` (None: on the
    compute stream itself, which then waits for each copy in turn: what the GPU check compares)."""

    def __init__(self, device: torch.device, pool: PinnedPool, stream: torch.cuda.Stream | None):
        self.device = device
        self.pool = pool
        self.stream = stream

    def begin(self, load: ExpertLoad) -> InFlight:
        host = load(HOST, _stacked)  # (gate/up, down): plain tensors, or kept parts stacked, on the host
        stream = self.stream or torch.cuda.current_stream(self.device)

        def copied(staged: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
            return staged.to(self.device, non_blocking=True), stream.record_event()

        with torch.cuda.stream(stream):
            moved = [_each_tensor(weight, lambda t: self.pool.through(t, copied)) for weight in host]
            pair = tuple(weight if isinstance(weight, torch.Tensor) else weight.kept() for weight in moved)
            event = stream.record_event()
        return InFlight(pair, event, self.device)


def _stacked(parts: list[kept.KeptParts]) -> kept.KeptParts:
    """A kept group's members' parts stacked along the outputs, not yet packed for a kernel (source.Fuse)."""
    return parts[0].cat(parts)


def _each_tensor(weight: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`weight` (a tensor, or kept parts: a dataclass of tensors) with `move` applied to each tensor in it."""
    if isinstance(weight, torch.Tensor):
        return move(weight)
    return dataclasses.replace(weight, **{field.name: move(getattr(weight, field.name))
                                          for field in dataclasses.fields(weight)
                                          if isinstance(getattr(weight, field.name), torch.Tensor)})


def _tensors(weight: Any) -> list[torch.Tensor]:
    """The tensors a weight holds (a tensor itself, or a kept weight's)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [value for field in dataclasses.fields(weight)
            if isinstance(value := getattr(weight, field.name), torch.Tensor)]

