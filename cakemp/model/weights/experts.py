"""Where a MoE layer's routed experts are held, declared once: `ExpertStore`, what model/moe.py's
SparseMoe asks of them (expert e's gate/up and down, in compute form), and its two kinds:
`ResidentExperts`, every expert loaded stacked on the device, and `OffloadedExperts`
(`--expert-offload`), none of them loaded: each is read when a token is routed to it, from the
checkpoint's files kept mapped (source.Mapped), in its stored form, its bytes alone (an MLX
or GGUF stacked tensor's one matrix), and kept in an `ExpertCache` of hot experts shared by the
device's offloaded layers, at most `capacity` bytes in compute form. A 4-bit expert stays 4-bit
where torch's int4 matmul takes it (model/weights/int4.py), as it would loaded; every other one
is dequantized into the compute dtype, its values exactly those the resident layer holds.

An expert past the capacity (or one read while the rest of a token's experts fill it) is
computed with and then dropped, so a cache smaller than one token's experts computes the same,
reading more. Eviction is least recently used, or with `policy="lfu"` least often used since it
was read (ties: the least recently used), which bench/expert_offload.py measures side by side.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cakemp.errors import CheckpointError
from cakemp.model.weights.source import Loaded, Mapped

Pair = tuple[Loaded, Loaded]  # gate/up [2I, H] (gate rows, then up rows), down [H, I]
# Expert j's stored names ("gate_up", "down" -> the tensors stacked into each), and the matrix of
# each to read where they are stacked [E, ...] (None: the names are expert j's own tensors).
ExpertRead = Callable[[int], tuple[dict[str, list[str]], int | None]]
POLICIES = ("lru", "lfu")


class ExpertStore(Protocol):
    """A MoE layer's routed experts, however they are held."""

    count: int  # E

    def pair(self, expert: int) -> Pair:
        """Expert `expert`'s gate/up [2I, H] and down [H, I] weights, in a form `linear` takes."""


@dataclass(frozen=True)
class ResidentExperts:
    """Every expert on the device, stacked: gate/up [E, 2I, H], down [E, H, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def count(self) -> int:
        return self.gate_up.shape[0]

    def pair(self, expert: int) -> Pair:
        return self.gate_up[expert], self.down[expert]


class ExpertCache:
    """The hot experts of a device's offloaded layers in compute form, `capacity` bytes at most, and
    what they cost: reads that found one (`hits`), reads of the checkpoint (`misses`, `read_bytes` of
    it as stored) and the bytes held (`resident_bytes`)."""

    def __init__(self, capacity: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy {policy!r} is none of {', '.join(POLICIES)}")
        self.capacity = capacity
        self.policy = policy
        self.hits = self.misses = self.read_bytes = self.resident_bytes = 0
        self._held: OrderedDict[tuple[str, int], tuple[Pair, int]] = OrderedDict()  # oldest use first
        self._uses: dict[tuple[str, int], int] = {}

    def get(self, key: tuple[str, int], read: Callable[[], tuple[Pair, int]]) -> Pair:
        """The pair held under `key` (layer, expert), else `read()` -> (the pair, the bytes it read),
        kept if it fits beside what is held once the least valued are given up."""
        held = self._held.get(key)
        if held is not None:
            self.hits += 1
            self._held.move_to_end(key)
            self._uses[key] += 1
            return held[0]
        pair, read_bytes = read()
        self.misses += 1
        self.read_bytes += read_bytes
        size = sum(weight.nbytes for weight in pair)
        if size <= self.capacity:
            while self.resident_bytes + size > self.capacity:
                self._evict()
            self._held[key] = (pair, size)
            self._uses[key] = 1
            self.resident_bytes += size
        return pair

    def _evict(self) -> None:
        if self.policy == "lru":
            victim = next(iter(self._held))
        else:  # the fewest uses, the least recently used of those (min keeps the first found)
            victim = min(self._held, key=self._uses.__getitem__)
        self.resident_bytes -= self._held.pop(victim)[1]
        del self._uses[victim]


@dataclass
class OffloadedExperts:
    """A layer's experts read on demand through `mapped` and held in the device's `cache`."""

    layer: str
    count: int
    reads: ExpertRead
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # what gate/up and down must be: ([2I, H], [H, I])
    mapped: Mapped
    cache: ExpertCache
    device: torch.device
    dtype: torch.dtype
    kernels: frozenset[str]  # the kept kernels quantized experts stay so for (compute/loading.kept_kernels)

    def pair(self, expert: int) -> Pair:
        return self.cache.get((self.layer, expert), lambda: self._read(expert))

    def _read(self, expert: int) -> tuple[Pair, int]:
        groups, index = self.reads(expert)
        loaded = self.mapped.load(groups, self.device, self.dtype, self.kernels, index)
        pair = (loaded["gate_up"], loaded["down"])
        got = tuple(tuple(weight.shape) for weight in pair)
        if got != self.shapes:
            raise CheckpointError(f"{self.layer}: expert {expert} reads as {got}, config.json implies {self.shapes}")
        stored = self.mapped.stored_nbytes([name for names in groups.values() for name in names])
        return pair, stored if index is None else stored // self.count
