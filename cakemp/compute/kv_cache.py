"""Per-session KV caches of one device process, under one byte budget and one context limit.

Allocation strategy: every (session, block_idx) owns two contiguous buffers
`k, v: [1, H_kv, capacity, D]` in the compute dtype, and a length. A request for positions
[p, p+T) first makes sure capacity >= p+T, growing by doubling (from 256 positions, capped at
the context limit), then the block writes rows [p, p+T) in place and attends over a view of
rows [0, p+T) -- no copy, no concatenation per step.

Why not fixed-size pages: torch's SDPA wants each sequence's K/V as one strided tensor, so
pages would have to be gathered into a contiguous copy on every step (the whole context,
every token), which costs more than the amortised O(1) doubling copy. Contiguous buffers
also keep the cache addressable without any Python object per token: a later cross-session
batch can index buffers by (session, block_idx) and lengths, and CUDA-graph replay can ask
for buffers preallocated at the context limit (stable addresses) through `reserve`.

What each layer kind keeps: every attention layer, global or local (a sliding-window layer of
Mistral, Qwen, Gemma 3, EXAONE 4, Phi-3), keeps all its positions; a local layer reads only the
last `window` of them (model/block.py), so it costs as much memory as a global one. Keeping
only the window would need a ring buffer whose rows no longer sit in position order.

Linear-attention layers (Qwen3.5's Gated DeltaNet) keep no rows: per (session, block_idx) a
`LinearSlot` holds the convolution's last inputs and the recurrent state, f32, of a fixed size
allocated on the slot's first use. They share the byte budget with the KV buffers and are
freed with the session. The slot's state tensors are replaced whole (`LinearSlot.install`) once
a request has succeeded, never updated in place part-way.

The budget counts allocated capacity, not used positions, since that is what the device
actually holds. Growth falls back to the exact size needed when doubling would pass the
budget, so a session is refused only when the positions it needs cannot fit.

What prefix reuse keeps (prefix_cache.py) lives inside the same budget as the `spare`: the
cache counts its bytes as taken, and asks for them back (`Spare.release`) before it grows a
slot any less than doubled or refuses a session. Its KV slots leave the cache when a session
is retired (`detach`) and come back when another adopts them (`attach`, `resume`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from cakemp.errors import CacheBudgetExceeded, ContextLimitExceeded
from cakemp.model.deltanet import LinearState
from cakemp.units import human_bytes

MIN_CAPACITY = 256


@dataclass
class KVSlot:
    """One layer's keys and values for one session; rows [0, length) are valid."""

    k: torch.Tensor  # [1, H_kv, capacity, D]
    v: torch.Tensor  # [1, H_kv, capacity, D]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@dataclass
class LinearSlot:
    """One linear-attention layer's state for one session, after `length` positions (f32)."""

    conv: torch.Tensor  # [1, C, K-1]
    recurrent: torch.Tensor  # [1, H_v, D_k, D_v]
    length: int = 0

    def install(self, conv: torch.Tensor, recurrent: torch.Tensor, length: int) -> None:
        """Replace the state by one of the same shapes (what a successful request computed)."""
        self.conv, self.recurrent, self.length = conv, recurrent, length


class Spare(Protocol):
    """Bytes held inside the budget that are given back on demand (prefix reuse's)."""

    def nbytes(self) -> int: ...

    def release(self, nbytes: int) -> None:
        """Free at least `nbytes`, or all there is."""


class KVCache:
    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int,
        budget_bytes: int | None = None,
        linear_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ):
        """linear_shapes: the conv and recurrent state shapes of a linear-attention layer, if any."""
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_context = max_context
        self.budget_bytes = budget_bytes
        # K and V rows of one position, together.
        self.bytes_per_position = 2 * kv_heads * head_dim * dtype.itemsize
        self.linear_shapes = linear_shapes  # held in f32 whatever the compute dtype
        self.bytes_per_linear_slot = 0 if linear_shapes is None else \
            torch.float32.itemsize * sum(math.prod(s) for s in linear_shapes)
        self._sessions: dict[int, dict[int, KVSlot]] = {}
        self._linear: dict[int, dict[int, LinearSlot]] = {}
        self._bytes = 0
        self.spare: Spare | None = None

    def nbytes(self) -> int:
        """Bytes the sessions' slots hold (not the spare's)."""
        return self._bytes

    def room(self) -> int | None:
        """Bytes of the budget neither the sessions nor the spare hold (None: no budget)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self._bytes - (0 if self.spare is None else self.spare.nbytes())

    def session_count(self) -> int:
        return len(self._sessions.keys() | self._linear.keys())

    def length(self, session: int, block_idx: int) -> int:
        """Positions cached for this layer of this session (0 when nothing is)."""
        slot = self._sessions.get(session, {}).get(block_idx)
        return 0 if slot is None else slot.length

    def linear_length(self, session: int, block_idx: int) -> int:
        """Positions a linear-attention slot of this session has consumed (0 when it has none)."""
        slot = self._linear.get(session, {}).get(block_idx)
        return 0 if slot is None else slot.length

    def reserve(
        self, session: int, ends: dict[int, int], linear_ends: dict[int, int] | None = None
    ) -> dict[int, KVSlot]:
        """Slots of `session` for each block_idx in `ends`, each with capacity >= its end; and
        a linear-attention slot (`linear_slot`) for each block_idx in `linear_ends`, zeros when new.

        All or nothing: limits and the budget are checked for every slot before any buffer
        is allocated, so a refusal leaves every session's cache as it was.
        """
        linear_ends = linear_ends or {}
        for block_idx, end in [*ends.items(), *linear_ends.items()]:
            if end > self.max_context:
                raise ContextLimitExceeded(
                    f"position {end - 1} (block {block_idx}) is past the context limit of {self.max_context} positions"
                )
        slots = self._sessions.get(session, {})
        growth = {}
        for block_idx, end in ends.items():
            capacity = slots[block_idx].capacity if block_idx in slots else 0
            if end > capacity:
                growth[block_idx] = (capacity, end, min(self.max_context, max(2 * capacity, MIN_CAPACITY, end)))
        linear = self._linear.get(session, {})
        new_linear = [block_idx for block_idx in linear_ends if block_idx not in linear]
        growth = self._fitted(growth, len(new_linear) * self.bytes_per_linear_slot)
        if ends:
            slots = self._sessions.setdefault(session, slots)
        for block_idx, (_, _, new_capacity) in growth.items():
            self._grow(slots, block_idx, new_capacity)
        if linear_ends:
            linear = self._linear.setdefault(session, linear)
        for block_idx in new_linear:
            conv, recurrent = (torch.zeros(shape, dtype=torch.float32, device=self.device) for shape in self.linear_shapes)
            linear[block_idx] = LinearSlot(conv, recurrent)
            self._bytes += self.bytes_per_linear_slot
        return {block_idx: slots[block_idx] for block_idx in ends}

    def linear_slot(self, session: int, block_idx: int) -> LinearSlot:
        """A linear-attention slot `reserve` made for `session`."""
        return self._linear[session][block_idx]

    def _fitted(self, growth: dict[int, tuple[int, int, int]], linear_bytes: int = 0) -> dict[int, tuple[int, int, int]]:
        """`growth` (block_idx -> old capacity, end, doubled capacity) as it fits the budget: doubled,
        else exact (capacity = end); CacheBudgetExceeded if even that does not fit.

        `linear_bytes`: new linear-attention state, a fixed size that must fit as well.
        """
        if self.budget_bytes is None or not (growth or linear_bytes):
            return growth
        left = self.room() - linear_bytes
        doubled = sum(new - old for old, _, new in growth.values()) * self.bytes_per_position
        if doubled > left and self.spare is not None:
            self.spare.release(doubled - left)
            left = self.room() - linear_bytes
        if doubled <= left:
            return growth
        exact = sum(end - old for old, end, _ in growth.values()) * self.bytes_per_position
        if exact > left:
            raise CacheBudgetExceeded(
                f"the KV cache would need {human_bytes(exact + linear_bytes)} more but only "
                f"{human_bytes(max(left + linear_bytes, 0))} of this device's {human_bytes(self.budget_bytes)} budget is left"
            )
        return {block_idx: (old, end, end) for block_idx, (old, end, _) in growth.items()}

    def _grow(self, slots: dict[int, KVSlot], block_idx: int, capacity: int) -> None:
        shape = (1, self.kv_heads, capacity, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        old = slots.get(block_idx)
        length = 0
        if old is not None:
            length = old.length
            k[:, :, :length] = old.k[:, :, :length]
            v[:, :, :length] = old.v[:, :, :length]
            self._bytes -= old.capacity * self.bytes_per_position
        slots[block_idx] = KVSlot(k, v, length)
        self._bytes += capacity * self.bytes_per_position

    def detach(self, session: int) -> tuple[dict[int, KVSlot], dict[int, LinearSlot]]:
        """Take every slot of `session` out of the cache, uncounted (unknown sessions: none)."""
        slots, linear = self._sessions.pop(session, {}), self._linear.pop(session, {})
        self._bytes -= sum(slot.capacity for slot in slots.values()) * self.bytes_per_position
        self._bytes -= len(linear) * self.bytes_per_linear_slot
        return slots, linear

    def attach(self, session: int, slots: dict[int, KVSlot], linear: dict[int, LinearSlot] | None = None) -> None:
        """Make `slots` and `linear` (detached, or copied) `session`'s, counted; it must hold none of those block_idx."""
        linear = linear or {}
        mine, mine_linear = self._sessions.get(session, {}), self._linear.get(session, {})
        if mine.keys() & slots.keys() or mine_linear.keys() & linear.keys():
            raise ValueError(f"session {session} already holds some of slots {sorted(slots)}, {sorted(linear)}")
        if slots:
            self._sessions.setdefault(session, mine).update(slots)
        if linear:
            self._linear.setdefault(session, mine_linear).update(linear)
        self._bytes += sum(slot.capacity for slot in slots.values()) * self.bytes_per_position
        self._bytes += len(linear) * self.bytes_per_linear_slot

    def copied(self, session: int, blocks: Iterable[int], length: int, capacity: int) -> dict[int, KVSlot]:
        """New slots holding the first `length` rows of `session`'s slots `blocks`, of `capacity`
        positions (at least `length`; not counted until attached)."""
        capacity = max(capacity, length)
        copies = {}
        for block_idx in blocks:
            slot = self._sessions[session][block_idx]
            copy = KVSlot(slot.k.new_empty(*slot.k.shape[:2], capacity, slot.k.shape[3]),
                          slot.v.new_empty(*slot.v.shape[:2], capacity, slot.v.shape[3]), length)
            copy.k[:, :, :length] = slot.k[:, :, :length]
            copy.v[:, :, :length] = slot.v[:, :, :length]
            copies[block_idx] = copy
        return copies

    def resume(self, session: int, blocks: Iterable[int], length: int, states: dict[int, LinearState]) -> None:
        """Set `session`'s attention slots `blocks` to their first `length` rows, and its
        linear-attention slots to `states` (block_idx -> the state after `length` positions),
        making those slots it lacks."""
        slots = self._sessions.get(session, {})
        for block_idx in blocks:
            slots[block_idx].length = length
        linear = self._linear.setdefault(session, {}) if states else {}
        for block_idx, state in states.items():
            if block_idx not in linear:
                self._bytes += self.bytes_per_linear_slot
            linear[block_idx] = LinearSlot(state.conv, state.recurrent, length)

    def clear(self, session: int) -> None:
        """Free every buffer of `session` (unknown sessions are a no-op)."""
        self.detach(session)
