"""Where a MoE layer's routed experts are held, declared once: `ExpertStore`, what model/moe.py's
SparseMoe asks of them (the experts a step routes tokens to, in compute form), and its two kinds:
`ResidentExperts`, every expert loaded stacked on the device, and `OffloadedExperts`
(`--expert-offload`), none of them loaded: each is read when a token is routed to it, from the
checkpoint's files kept mapped (source.Mapped), in its stored form, its bytes alone (an MLX
or GGUF stacked tensor's one matrix), and kept in an `ExpertCache` of hot experts shared by the
device's offloaded layers, at most `capacity` bytes in compute form. A 4-bit expert stays 4-bit
where torch's int4 matmul takes it (model/weights/int4.py), as it would loaded; every other one
is dequantized into the compute dtype, its values exactly those the resident layer holds.

How a read expert reaches the device is its `Transfer` (model/weights/expert_transfer.py): on a
CPU it is read straight into compute form; on a GPU staged through pinned host memory and copied
on a side stream. SparseMoe calls `fetch` as soon as the router has chosen: the held experts are
found, and the reads of the missed ones start, as many as fit in the cache's room beside the held
ones (one at least), so that what the caller runs before it iterates (the shared expert) and the
held experts' products overlap them; each further read starts once the expert before it has been
handed out. Reads in flight count against the capacity as held experts do: the cache gives up
experts to make room for them.

An expert past the capacity (or one read while the rest of a token's experts fill it) is
computed with and then dropped, so a cache smaller than one token's experts computes the same,
reading more. Eviction is least recently used, or with `policy="lfu"` least often used since it
was read (ties: the least recently used), which bench/expert_offload.py measures side by side.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cakemp.errors import CheckpointError
from cakemp.model.weights import kept
from cakemp.model.weights.source import Fuse, Loaded, Mapped

Pair = tuple[Loaded, Loaded]  # gate/up [2I, H] (gate rows, then up rows), down [H, I]
# Expert j's stored names ("gate_up", "down" -> the tensors stacked into each), and the matrix of
# each to read where they are stacked [E, ...] (None: the names are expert j's own tensors).
ExpertRead = Callable[[int], tuple[dict[str, list[str]], int | None]]
# One expert's gate/up and down read onto a device, a kept group's parts made one by the Fuse given.
ExpertLoad = Callable[[torch.device, Fuse], tuple[Loaded | kept.KeptParts, Loaded | kept.KeptParts]]
POLICIES = ("lru", "lfu")


class ExpertStore(Protocol):
    """A MoE layer's routed experts, however they are held."""

    count: int  # E

    def fetch(self, experts: Sequence[int]) -> Iterator[tuple[int, Pair]]:
        """(expert, its gate/up [2I, H] and down [H, I] in a form `linear` takes) for each of `experts`
        (the ones a step routes tokens to, each once), in the order to compute them; reads of those
        not held start at the call, so what the caller runs before iterating overlaps them."""


class PendingPair(Protocol):
    """An expert on its way to the device (what `Transfer.begin` returns)."""

    @property
    def nbytes(self) -> int:
        """The device bytes it holds (allocated already)."""

    def ready(self) -> Pair:
        """The pair, once the device's compute may use it (a GPU's compute stream waits for its copy)."""


class Transfer(Protocol):
    """How an offloaded expert reaches its device (model/weights/expert_transfer.py)."""

    def begin(self, load: ExpertLoad) -> PendingPair:
        """Read one expert through `load` and start moving it to the device."""


def pair_nbytes(pair: Pair) -> int:
    return sum(weight.nbytes for weight in pair)


@dataclass(frozen=True)
class ResidentExperts:
    """Every expert on the device, stacked: gate/up [E, 2I, H], down [E, H, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def count(self) -> int:
        return self.gate_up.shape[0]

    def fetch(self, experts: Sequence[int]) -> Iterator[tuple[int, Pair]]:
        return ((expert, (self.gate_up[expert], self.down[expert])) for expert in experts)


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

    def find(self, key: tuple[str, int]) -> Pair | None:
        """The pair held under `key` (layer, expert), counted as a hit; None if none is."""
        held = self._held.get(key)
        if held is None:
            return None
        self.hits += 1
        self._held.move_to_end(key)
        self._uses[key] += 1
        return held[0]

    def put(self, key: tuple[str, int], pair: Pair, read_bytes: int) -> None:
        """Count a read of the checkpoint (a miss, `read_bytes` of it as stored) and keep its `pair` if it
        fits beside what is held once the least valued are given up."""
        self.misses += 1
        self.read_bytes += read_bytes
        size = pair_nbytes(pair)
        if size <= self.capacity:
            self.make_room(size)
            self._held[key] = (pair, size)
            self._uses[key] = 1
            self.resident_bytes += size

    def make_room(self, size: int) -> None:
        """Give up the least valued until `size` more bytes fit beside what is held (or none is held)."""
        while self._held and self.resident_bytes + size > self.capacity:
            self._evict()

    def _evict(self) -> None:
        if self.policy == "lru":
            victim = next(iter(self._held))
        else:  # the fewest uses, the least recently used of those (min keeps the first found)
            victim = min(self._held, key=self._uses.__getitem__)
        self.resident_bytes -= self._held.pop(victim)[1]
        del self._uses[victim]


@dataclass
class OffloadedExperts:
    """A layer's experts read on demand through `mapped`, moved to the device by `transfer`, held in
    the device's `cache`."""

    layer: str
    count: int
    reads: ExpertRead
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # what gate/up and down must be: ([2I, H], [H, I])
    mapped: Mapped
    cache: ExpertCache
    transfer: Transfer
    dtype: torch.dtype
    kernels: frozenset[str]  # the kept kernels quantized experts stay so for (compute/loading.kept_kernels)

    def fetch(self, experts: Sequence[int]) -> Iterator[tuple[int, Pair]]:
        """The held experts first (found now), then the missed ones as each read is ready; the reads
        that fit in the cache's room beside the held ones start now."""
        held, missed = [], deque()
        for expert in experts:
            pair = self.cache.find((self.layer, expert))
            if pair is None:
                missed.append(expert)
            else:
                held.append((expert, pair))
        room = self.cache.capacity - sum(pair_nbytes(pair) for _, pair in held)
        flight: deque[tuple[int, PendingPair]] = deque()
        self._read_ahead(missed, flight, room)
        return self._in_order(held, missed, flight, room)

    def _in_order(self, held: list[tuple[int, Pair]], missed: deque[int],
                  flight: deque[tuple[int, PendingPair]], room: int) -> Iterator[tuple[int, Pair]]:
        yield from held
        while flight:
            expert, pending = flight.popleft()
            pair = pending.ready()
            got = tuple(tuple(weight.shape) for weight in pair)
            if got != self.shapes:
                raise CheckpointError(f"{self.layer}: expert {expert} reads as {got}, config.json implies {self.shapes}")
            self.cache.put((self.layer, expert), pair, self._stored_bytes(expert))
            self.cache.make_room(sum(other.nbytes for _, other in flight))
            yield expert, pair
            self._read_ahead(missed, flight, room)  # the caller has set this expert's products going

    def _read_ahead(self, missed: deque[int], flight: deque[tuple[int, PendingPair]], room: int) -> None:
        """Start reading missed experts while those in flight fit in `room`, one at least (so that the
        next is always on its way); the cache gives up what it must to hold them beside it."""
        in_flight = sum(pending.nbytes for _, pending in flight)
        while missed and (not flight or in_flight + flight[-1][1].nbytes <= room):
            expert = missed.popleft()
            pending = self.transfer.begin(functools.partial(self._load, expert))
            flight.append((expert, pending))
            in_flight += pending.nbytes
            self.cache.make_room(in_flight)

    def _load(self, expert: int, device: torch.device, fuse: Fuse) -> tuple[Loaded | kept.KeptParts, ...]:
        groups, index = self.reads(expert)
        loaded = self.mapped.load(groups, device, self.dtype, self.kernels, index, fuse)
        return loaded["gate_up"], loaded["down"]

    def _stored_bytes(self, expert: int) -> int:
        """The checkpoint's bytes expert `expert` is stored in (its matrix's share of stacked tensors)."""
        groups, index = self.reads(expert)
        stored = self.mapped.stored_nbytes([name for names in groups.values() for name in names])
        return stored if index is None else stored // self.count
