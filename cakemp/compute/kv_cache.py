"""The session state of one device process: K/V rows in paged pools, linear-attention states,
under one byte budget and one context limit.

Every attention layer of every session keeps its K and V rows in blocks of BLOCK positions of the
pool of its KV slot index (block_idx), shared by every session, `k, v: [blocks, BLOCK, H_kv, D]` in
the compute dtype (a block's rows contiguous, so that reading blocks and writing rows are copies
along the first dimension, the fast ones). A pool per layer rather than one per device keeps a
session's blocks of one layer in one run of the pool while no other session takes blocks there,
which a step reads as a view, without gathering them. A slot (one session's one
layer, by block_idx) is a block table: the ids of its blocks in position order, and a length.
Position p of a slot lives at row `p % BLOCK` of block `table[p // BLOCK]`, so the pool's
flattened row `table[p // BLOCK] * BLOCK + p % BLOCK` (its slot id) addresses it, which is how a
step writes every new row of every session with one indexed copy and gathers every session's
keys with one indexed read (compute/paged_step.py).

The live sessions' tables are also kept as one tensor, `tables: [rows, slots, width]` (a session's
row, block_idx, then its block ids), written where a table changes (a new block every BLOCK
positions, a copy on write, a slot attached), so that a step reads every request's table with
one gather instead of building it in Python. They are written on the host (`Tables`) and, on a
GPU, copied over once a step where they changed. An entry past a table's end names the pool's null
block (NULL_BLOCK: zeros, held by no table, outside the budget): a batched step pads a shorter
request's table to the longest of those it attends with, and those entries must read nothing another session wrote
(a masked NaN key still makes the row NaN). A second block outside the budget, SCRATCH_BLOCK, takes
the writes of a fixed-shape step's padding rows (compute/decode_graph.py) and is never read.

Allocation is in blocks: a request for positions [p, p+T) takes the blocks its slot lacks up to
p+T, and no more. Nothing is ever copied to grow a slot; a pool itself grows by doubling, but where
there is a budget a doubling stops at the pool's share of its blocks (the budget's over the pools)
and at what the other pools leave of them; past its share a pool grows by what it needs. Each
pool doubling up to the whole budget on its own allocated up to ~2x the budget once every layer's
pool had just doubled (1.95x, 4 layers): on a GPU an out-of-memory at half the KV promised.
Where decode steps are CUDA graphs (a GPU's), the pools of the slots a master names are made at
their shares at the start instead (`presize`): a graph reads a pool's tensors, which a growth
replaces.

Blocks are reference-counted: prefix reuse (prefix_cache.py) shares a kept prefix's blocks with
a session that continues from its rows (`shared`) instead of copying them. A block with more
than one owner is copied before a row of it is written (copy on write, in `reserve`), so no
owner ever sees another's rows change. The budget counts blocks in use once, however many
tables hold them (`nbytes` the live sessions' share of them, `room` what is left).

What each layer kind keeps: every attention layer, global or local (a sliding-window layer of
Mistral, Qwen, Gemma 3, EXAONE 4, Phi-3), keeps all its positions; a local layer reads only the
last `window` of them, so it costs as much memory as a global one.

Linear-attention layers (Qwen3.5's Gated DeltaNet) keep no rows: per (session, block_idx) a
`LinearSlot` holds the convolution's last inputs and the recurrent state, f32, of a fixed size
allocated on the slot's first use. They share the byte budget with the blocks and are freed
with the session. The slot's state tensors are replaced whole (`LinearSlot.install`) once a
request has succeeded, never updated in place part-way.

What prefix reuse keeps besides blocks (output rows, state points) lives inside the same budget
as the `spare`: the cache counts its bytes as taken, and asks for room back (`Spare.release`)
before it refuses a session. Its KV slots leave the cache's sessions when a session is retired
(`detach`: their blocks stay in use, counted) and come back when another adopts them (`attach`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

import numpy as np
import torch

from cakemp.errors import CacheBudgetExceeded, ContextLimitExceeded
from cakemp.model.deltanet import LinearState
from cakemp.units import human_bytes

BLOCK = 16  # positions per block
MIN_POOL_BLOCKS = 64  # the pool's first size, in blocks, where it grows
NULL_BLOCK = 0  # every pool's block of zeros that no table holds: what an unused table entry names
SCRATCH_BLOCK = 1  # every pool's block that no table holds, where padding rows write: never read
RESERVED = 2  # blocks 0 and 1, outside the budget


def int64_tensor(values: list[int], device: torch.device | str) -> torch.Tensor:
    """A list of ints as an int64 tensor on `device`: through an array's buffer, ~6x faster than
    torch.tensor's conversion of each Python int (the step's index lists are built per request)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64).to(device) if values else \
        torch.empty(0, dtype=torch.int64, device=device)


def _holds(table: list[int], owners: list[int], start: int, end: int) -> bool:
    """Whether a slot's `table` holds exactly the blocks to `end`, rows [start, end) in its last one, which
    only it owns (`owners`: its pool's): writing those rows takes, frees and copies no block. (For one
    row, `KVCache.continuing` makes the same check inline, per layer and session: change both.)"""
    return len(table) == -(-end // BLOCK) and start // BLOCK == len(table) - 1 and owners[table[-1]] == 1


@dataclass(slots=True)
class KVSlot:
    """One layer's keys and values for one session: its blocks (of the pool of block_idx `pool`) in
    position order; rows [0, length) valid."""

    pool: int
    table: list[int]
    length: int = 0

    @property
    def capacity(self) -> int:
        return len(self.table) * BLOCK


_LENGTH = attrgetter("length")


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
    """Bytes held inside the budget besides the blocks, given back on demand (prefix reuse's)."""

    def nbytes(self) -> int: ...

    def release(self, nbytes: int) -> None:
        """Give back what it holds (blocks included) until the budget has `nbytes` more room, or all there is."""


class Pool:
    """The blocks of one KV slot index (block_idx) across sessions: K and V, and who holds each block."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.empty(0, BLOCK, kv_heads, head_dim, dtype=dtype, device=device)  # [blocks, BLOCK, H_kv, D]
        self.v = torch.empty_like(self.k)
        self.owners: list[int] = []  # block id -> the tables holding it (0: free)
        self.live: list[int] = []  # block id -> the live sessions' tables holding it
        # The free blocks as a heap: a session takes the lowest, so one growing while no other
        # takes blocks here holds one run of the pool (read as a view), its first prompt or a later
        # one after a Goodbye freed blocks (a stack gave those back in reverse, a run no more).
        self.free: list[int] = []

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as rows, [blocks * BLOCK, H_kv, D] each (views): row block * BLOCK + offset."""
        flat = -1, *self.k.shape[2:]
        return self.k.view(flat), self.v.view(flat)

    def write(self, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, H_kv, N, D], N rows, into the pool's rows `slot_ids` [N] (block * BLOCK + offset)."""
        k_rows, v_rows = self.rows()
        k_rows.index_copy_(0, slot_ids, k[0].transpose(0, 1))  # [N, H_kv, D] rows
        v_rows.index_copy_(0, slot_ids, v[0].transpose(0, 1))

    def gather(self, tables: torch.Tensor, into: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """tables: [b, n] block ids -> the K and V of those blocks, [b, H_kv, n * BLOCK, D] each (a copy:
        into `into`, K's and V's room for b * n blocks, `KVCache.gather_space`, where given; else fresh)."""
        b, n = tables.shape
        ids = tables.reshape(-1)
        shape = b, n * BLOCK, *self.k.shape[2:]
        # index_select along the first dimension copies whole blocks (advanced indexing, or another
        # dimension, goes element by element: ~10x slower on a CPU). [b, S, H_kv, D] -> a strided view.
        k, v = (None, None) if into is None else into
        return (torch.index_select(self.k, 0, ids, out=k).view(shape).transpose(1, 2),
                torch.index_select(self.v, 0, ids, out=v).view(shape).transpose(1, 2))

    @torch.inference_mode()  # the pool may be an inference tensor: made by a step under inference mode
    def grow(self, at_least: int, limit: int | None) -> None:
        """At least `at_least` blocks: doubling, but to at most `limit` blocks where there is a budget
        (besides the RESERVED ones), new ones zeros."""
        old = len(self.owners)
        at_least += RESERVED if old == 0 else 0
        size = max(at_least, 2 * old, MIN_POOL_BLOCKS)
        if limit is not None:
            size = max(at_least, min(size, RESERVED + limit))
        k = self.k.new_zeros(size, *self.k.shape[1:])
        v = self.v.new_zeros(size, *self.v.shape[1:])
        k[:old], v[:old] = self.k, self.v
        self.k, self.v = k, v
        self.owners.extend([0] * (size - old))
        self.live.extend([0] * (size - old))
        if old == 0:
            self.owners[NULL_BLOCK] = self.owners[SCRATCH_BLOCK] = 1  # the pool's own, never taken nor freed
        self.free.extend(range(max(old, RESERVED), size))  # higher than every block free before: still a heap


class Tables:
    """The live sessions' block tables, [rows, slots, width] block ids: written on the host through
    numpy (~1.8 µs a table, where a tensor's indexed write took ~5.6, every BLOCK positions of every
    session) and read by a step on the device. On a CPU both are one tensor; on a GPU the entries
    written since the last step go over in one copy when a step asks (a decode's new block: one entry
    a layer, whatever the context), scattered into the device's tables there.

    A row's entries past its table name the null block (not a block it held before, which another
    session may hold now): a batched step reads them as a shorter request's padding."""

    def __init__(self, device: torch.device, mirrored: bool | None = None):
        """`mirrored`: keep a copy on the device apart from the host's (a GPU's; None: where the device is
        not the CPU; True on a CPU tests the same plan)."""
        self._device = torch.device(device)
        self._mirrored = self._device.type != "cpu" if mirrored is None else mirrored
        # The flat entries [start, end) written on the host since the device's copy was made.
        self._starts, self._ends = array("q"), array("q")
        self._grow(0, 0, 0)

    def write(self, row: int, slot: int, table: list[int], first: int = 0) -> None:
        """Row `row`'s entry for KV slot `slot` is `table`, whose entries before `first` it holds already
        (growing the tables, doubling, to hold it). A decode's new block every BLOCK positions then
        costs one entry's write, not the whole table's: a long context's thousands."""
        rows, slots, width = self._entries.shape
        if row >= rows or slot >= slots or len(table) > width:
            self._grow(max(rows, 2 * row, row + 1, 8), max(slots, slot + 1),
                       max(width, 2 * width if len(table) > width else 0, len(table), 16))
        entries, held = self._entries[row, slot], int(self._lengths[row, slot])
        entries[first:len(table)] = table[first:]
        entries[len(table):held] = NULL_BLOCK  # past `held` they are null already
        self._lengths[row, slot] = len(table)
        self._written(row, slot, first, max(len(table), held))

    def append(self, row: int, slots: list[int], index: int, blocks: list[int]) -> None:
        """Row `row`'s tables of `slots`, each `index` entries long, end in `blocks`' each (one numpy write
        for them all: a decode's new block in every layer)."""
        if index >= self._entries.shape[2]:
            rows, slot_count, width = self._entries.shape
            self._grow(rows, slot_count, max(2 * width, index + 1))
        self._entries[row, slots, index] = blocks
        self._lengths[row, slots] = index + 1
        for slot in slots:
            self._written(row, slot, index, index + 1)

    def clear(self, row: int) -> None:
        """Row `row` names no block (its session left it)."""
        self._entries[row] = NULL_BLOCK
        self._lengths[row] = 0
        self._written(row, 0, 0, self._entries.shape[1] * self._entries.shape[2])  # the whole row

    def on_device(self) -> torch.Tensor:
        """The tables on the device, with every entry written so far."""
        if self._starts:
            starts, ends = np.frombuffer(self._starts, dtype=np.int64), np.frombuffer(self._ends, dtype=np.int64)
            counts = ends - starts
            # Each span's entries, one after another: [n] flat indices, then their block ids.
            flat = np.arange(counts.sum()) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
            index, ids = torch.from_numpy(np.stack([flat, self._entries.reshape(-1)[flat]])).to(self._device)
            with torch.inference_mode():  # the device's copy may be an inference tensor: made under it
                self._on_device.view(-1).index_copy_(0, index, ids)
            self._starts, self._ends = array("q"), array("q")
        return self._on_device

    def decode_rows(self, rows: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """rows, positions: [B], slots: [L] -> the slot id of position `positions[b]` in the table of row
        `rows[b]`'s slot `slots[l]`, as written on the host, and that table's row of the tables viewed as
        [rows * slots, width]: [L, B] each."""
        tables = slots[:, None] + rows * self._entries.shape[1]  # [L, B]
        blocks = self._entries.reshape(-1, self._entries.shape[2])[tables, positions // BLOCK]  # [L, B]
        return blocks * BLOCK + positions % BLOCK, tables

    def _written(self, row: int, slot: int, start: int, end: int) -> None:
        """Entries [start, end) of row `row`'s slot `slot` changed on the host."""
        if self._mirrored and end > start:
            base = (row * self._entries.shape[1] + slot) * self._entries.shape[2]
            self._starts.append(base + start)
            self._ends.append(base + end)

    def _grow(self, rows: int, slots: int, width: int) -> None:
        host = torch.full((rows, slots, width), NULL_BLOCK, dtype=torch.int64)
        lengths = np.zeros((rows, slots), dtype=np.int64)
        if rows:
            old = self._host
            host[: old.shape[0], : old.shape[1], : old.shape[2]] = old
            lengths[: old.shape[0], : old.shape[1]] = self._lengths
        self._host, self._lengths = host, lengths  # each (row, slot)'s table length as last written
        self._entries = host.numpy()  # the same memory, written without torch's dispatch
        self._on_device = host.to(self._device, copy=True) if self._mirrored else host
        self._starts, self._ends = array("q"), array("q")


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
        # K and V rows of one position, together; and of one block.
        self.bytes_per_position = 2 * kv_heads * head_dim * dtype.itemsize
        self.bytes_per_block = BLOCK * self.bytes_per_position
        self.max_blocks = None if budget_bytes is None else budget_bytes // self.bytes_per_block
        self.linear_shapes = linear_shapes  # held in f32 whatever the compute dtype
        self.bytes_per_linear_slot = 0 if linear_shapes is None else \
            torch.float32.itemsize * sum(math.prod(s) for s in linear_shapes)
        self.pools: dict[int, Pool] = {}  # block_idx -> its blocks, made at its first use
        self._used = 0  # blocks with an owner
        self._live_used = 0  # blocks a live session holds
        self._sessions: dict[int, dict[int, KVSlot]] = {}
        # Each session's last `continuing` that passed: its blocks, the block its row was in, its slots then.
        self._continued: dict[int, tuple[tuple[int, ...], int, list[KVSlot]]] = {}
        self._rows: dict[int, int] = {}  # session -> its row of `tables`
        self._free_rows: list[int] = []
        self._tables = Tables(device)
        self._linear: dict[int, dict[int, LinearSlot]] = {}
        self._linear_bytes = 0  # the live sessions' linear-attention states
        self.spare: Spare | None = None
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # `gather_space`'s K and V
        # How a step's decode rows attend: over their blocks where they lie in the pool, by a GPU's kernel
        # (model/paged_attention.attend, where paged_step.in_place_attention gives it); None: over a gathered
        # copy, by SDPA.
        self.paged_attend: Callable | None = None
        # Asked for room a session needs when neither the budget nor the spare has it (session, bytes):
        # compute/fair_share.py's, which gives up sessions of a source past its share of the budget.
        self.reclaim: Callable[[int, int], None] | None = None

    @property
    def tables(self) -> torch.Tensor:
        """The live sessions' block tables on the device, [rows, slots, width]: a session's row
        (`rows_of`), block_idx, then its block ids, the null block past its end."""
        return self._tables.on_device()

    def nbytes(self) -> int:
        """Bytes the live sessions hold: their blocks (each once) and linear states (not the spare's)."""
        return self._live_used * self.bytes_per_block + self._linear_bytes

    def held_by(self, sessions: Iterable[int]) -> int:
        """Bytes the blocks (each once, however many of `sessions` share it) and linear states of `sessions` hold."""
        blocks, linear = set(), 0
        for session in sessions:
            for slot in self._sessions.get(session, {}).values():
                blocks.update(zip(itertools.repeat(slot.pool), slot.table))
            linear += len(self._linear.get(session, {}))
        return len(blocks) * self.bytes_per_block + linear * self.bytes_per_linear_slot

    def room(self) -> int | None:
        """Bytes of the budget neither the blocks in use, the sessions' linear states nor the spare
        hold (None: no budget)."""
        if self.budget_bytes is None:
            return None
        spare = 0 if self.spare is None else self.spare.nbytes()
        return self.budget_bytes - self._used * self.bytes_per_block - self._linear_bytes - spare

    def gather_space(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for `blocks` gathered blocks of K and of V, [blocks, BLOCK, H_kv, D] each, that every
        gather of a step computed op by op reuses (a layer has read its keys before the next gathers).
        Grown by doubling (by what is needed where the doubling runs out of memory) and kept: the device
        holds the largest step's gathered keys for good (outside the budget, as activations are; decode rows
        are gathered in groups padded within twice each row's own keys, or by under paged_step's _SPLIT_BYTES), where
        a fresh tensor for each layer's keys was memory mapped afresh past glibc's threshold, a page
        fault per 4 KiB: at 32 sessions of 2,048 positions, 4 KV heads of 64, f32, a layer's gather took
        66 ms, 20 ms into kept room (a 2-core VM's CPU)."""
        held = 0 if self._gathered is None else self._gathered[0].shape[0]
        if held < blocks:
            self._gathered = None  # the old room given back first: never both held at once
            try:
                self._gathered = self._room(max(blocks, 2 * held))
            except torch.OutOfMemoryError:  # a GPU short of the doubled room: what this gather needs
                self._gathered = self._room(blocks)
        k, v = self._gathered
        return k[:blocks], v[:blocks]

    def _room(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = blocks, BLOCK, self.kv_heads, self.head_dim
        return (torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device))

    def sessions(self) -> Set[int]:
        """The sessions holding KV slots or linear states."""
        return self._sessions.keys() | self._linear.keys()

    def slots(self, session: int) -> dict[int, KVSlot]:
        """The session's KV slots by block_idx (empty when it has none)."""
        return self._sessions.get(session, {})

    def slot(self, session: int, block_idx: int) -> KVSlot | None:
        return self.slots(session).get(block_idx)

    def rows_of(self, sessions: Iterable[int]) -> list[int]:
        """Each session's row of `tables` (each holds a KV slot)."""
        rows = self._rows
        return [rows[session] for session in sessions]

    def decode_rows(self, sessions: Sequence[int], block_idxs: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """For a step of decodes, session b's one row at `positions[b]` in its slot of each of `block_idxs`
        (each holding that row's block): [2 * L * B + L * B] int64, each row's position [L, B], its slot id
        [L, B], then its table's row of `tables` viewed as [rows * slots, width] [L, B]; read from the
        host's tables as arrays, one pass for the step (compute/paged_step.py)."""
        at = np.array(positions, dtype=np.int64)  # [B]
        slot_ids, tables = self._tables.decode_rows(np.array(self.rows_of(sessions), dtype=np.int64),
                                                    np.array(block_idxs, dtype=np.int64), at)
        return np.concatenate([np.broadcast_to(at, slot_ids.shape).ravel(), slot_ids.ravel(), tables.ravel()])

    def length(self, session: int, block_idx: int) -> int:
        """Positions cached for this layer of this session (0 when nothing is)."""
        slot = self.slot(session, block_idx)
        return 0 if slot is None else slot.length

    def linear_length(self, session: int, block_idx: int) -> int:
        """Positions a linear-attention slot of this session has consumed (0 when it has none)."""
        slot = self._linear.get(session, {}).get(block_idx)
        return 0 if slot is None else slot.length

    def reserve(
        self, session: int, writes: dict[int, tuple[int, int]], linear_ends: dict[int, int] | None = None
    ) -> dict[int, KVSlot]:
        """Slots of `session` for each block_idx in `writes` (-> the rows [start, end) a request will
        write), each holding blocks to `end`, those of rows it writes its own; and a linear-attention
        slot (`linear_slot`) for each block_idx in `linear_ends`, zeros when new. Returned as the
        session's slots by block_idx (those of `writes` among them).

        A slot's blocks past `end` are freed: rows past what a request writes are never read again
        (it replaces them, or falls back to before them). All or nothing: limits and the budget are
        checked for every slot before any block is taken, so a refusal leaves every session as it was.
        """
        slots = self._sessions.get(session, {})
        pools, max_context = self.pools, self.max_context
        needed, changes = 0, []
        for block_idx, (start, end) in writes.items():
            if end > max_context:
                self._refuse_context(block_idx, end)
            blocks = -(-end // BLOCK)
            slot = slots.get(block_idx)
            if slot is None:
                needed += blocks
                changes.append((block_idx, start, end))
                continue
            table, owners = slot.table, pools[block_idx].owners
            if _holds(table, owners, start, end):
                continue
            kept = len(table) if len(table) < blocks else blocks
            shared = 0  # copies on write
            for b in table[start // BLOCK:kept]:
                if owners[b] > 1:
                    shared += 1
            if shared or len(table) != blocks:
                needed += blocks - kept + shared
                changes.append((block_idx, start, end))
        if not (changes or linear_ends):
            return slots
        linear_ends = linear_ends or {}
        for block_idx, end in linear_ends.items():
            if end > max_context:
                self._refuse_context(block_idx, end)
        linear = self._linear.get(session, {})
        new_linear = [block_idx for block_idx in linear_ends if block_idx not in linear]
        self._fit(session, needed * self.bytes_per_block + len(new_linear) * self.bytes_per_linear_slot)
        if changes:
            slots = self._sessions.setdefault(session, slots)
            self._change(session, slots, changes)
        if linear_ends:
            linear = self._linear.setdefault(session, linear)
        for block_idx in new_linear:
            conv, recurrent = (torch.zeros(shape, dtype=torch.float32, device=self.device) for shape in self.linear_shapes)
            linear[block_idx] = LinearSlot(conv, recurrent)
            self._linear_bytes += self.bytes_per_linear_slot
        return slots

    def continuing(self, session: int, blocks: tuple[int, ...], position: int) -> list[KVSlot] | None:
        """The session's KV slots of `blocks` (block_idx each) if writing row `position` in each changes
        nothing of it but, where the row opens a block, that block: the row is within what it has cached
        and the context limit, and in its last block, which is its own (a decode step's next row, or one
        it rewrites: most requests), or the first of the next block, taken here for every slot at once (a
        decode's next row every BLOCK positions, where `reserve` took them one slot at a time). Else None:
        then `reserve` decides. A block taken stays in its table if the request then fails, as `reserve`'s do.

        What it finds of the tables is kept for the session's next rows in the same block (its blocks the
        same, as a run's are), so that 15 decode rows of 16 only have their lengths read: whatever
        changes its tables (`_change`, `detach`) or shares a block (`shared_from`) forgets it."""
        slots = self._sessions.get(session)
        if slots is None or position >= self.max_context:
            return None
        index = position // BLOCK  # the row's block in each table
        known = self._continued.get(session)
        # (Its blocks: the run's tuple, or an equal one the runner rebuilt after a step of another run.)
        if known is not None and known[1] == index and (known[0] is blocks or known[0] == blocks):
            # Row `position` is in the block each table ended in at the last check, its own still: only
            # lengths may have moved since (a step's, a rollback's).
            held = known[2]
            return held if min(map(_LENGTH, held)) >= position else None
        pools, held, opening = self.pools, [], {}  # opening: block_idx -> slot (a run may name one twice)
        blocks_held = index + 1  # `_holds` for row `position` alone, inlined: this runs per layer
        for block_idx in blocks:
            slot = slots.get(block_idx)
            if slot is None or position > slot.length:
                return None
            table = slot.table
            if len(table) != blocks_held or pools[block_idx].owners[table[-1]] != 1:
                if len(table) != index:
                    return None
                opening[block_idx] = slot  # it holds blocks to `length`, a multiple of BLOCK, which `position` is
            held.append(slot)
        if opening:
            self._open(session, list(opening.values()), index)
        self._continued[session] = (blocks, index, held)
        return held

    @torch.inference_mode()  # as `_change`: a pool that grows may be an inference tensor
    def _open(self, session: int, slots: list[KVSlot], index: int) -> None:
        """Give each of the session's `slots`, which hold `index` blocks, its next block, the budget
        checked for them all first (CacheBudgetExceeded: none is taken)."""
        self._fit(session, len(slots) * self.bytes_per_block)
        pools = self.pools
        taken = self._take_each([pools[slot.pool] for slot in slots])
        for slot, block in zip(slots, taken, strict=True):
            slot.table.append(block)
        self._tables.append(self._rows[session], [slot.pool for slot in slots], index, taken)

    @torch.inference_mode()  # entered once for all the changes (about 1.4 µs each time it is)
    def _change(self, session: int, slots: dict[int, KVSlot], changes: list[tuple[int, int, int]]) -> None:
        """Make each slot of `changes` (block_idx, start, end) hold blocks to `end`, its rows [start, end)
        its own (`reserve` has checked the budget for them all), made where the session has none."""
        self._continued.pop(session, None)  # its tables change
        for block_idx, start, end in changes:
            slot = slots.get(block_idx)
            if slot is None:
                self.pool(block_idx)  # made at its first use
                slot = slots[block_idx] = KVSlot(block_idx, [])
            first = min(start // BLOCK, len(slot.table))  # the first entry of its table this changes
            self._write_blocks(slot, start, end)
            self._publish(session, slot, first)

    def _refuse_context(self, block_idx: int, end: int) -> None:
        raise ContextLimitExceeded(
            f"position {end - 1} (block {block_idx}) is past the context limit of {self.max_context} positions"
        )

    def pool(self, block_idx: int) -> Pool:
        """The pool of KV slot index `block_idx` (made empty at its first use)."""
        pool = self.pools.get(block_idx)
        if pool is None:
            pool = self.pools[block_idx] = Pool(self.kv_heads, self.head_dim, self.dtype, self.device)
        return pool

    def presize(self, block_idxs: Iterable[int]) -> None:
        """Make the pools of `block_idxs` now, each at its share of the budget's blocks (the budget's
        over them), where there is a budget: used alike, they never grow, so that what reads a pool's
        tensors (a captured graph, compute/decode_graph.py) reads them for good, and the device holds
        its KV memory from the start. A pool of another block_idx is still made at its first use, and
        grows past its share by what it needs, as any pool does."""
        new = sorted(set(block_idxs) - self.pools.keys())
        if self.max_blocks is None or not new:
            return
        share = self.max_blocks // (len(self.pools) + len(new))
        for block_idx in new:
            self.pool(block_idx).grow(share, share)

    def pool_bytes(self) -> int:
        """Bytes the pools hold, in use or not (their K and V tensors)."""
        return sum(pool.k.nbytes + pool.v.nbytes for pool in self.pools.values())

    def linear_slot(self, session: int, block_idx: int) -> LinearSlot:
        """A linear-attention slot `reserve` made for `session`."""
        return self._linear[session][block_idx]

    def _fit(self, session: int, nbytes: int) -> None:
        """Make sure `nbytes` more fit the budget for `session`, asking the spare for room first, then
        `reclaim`; else CacheBudgetExceeded."""
        if self.budget_bytes is None or nbytes == 0:
            return
        if self.room() < nbytes and self.spare is not None:
            self.spare.release(nbytes)
        if self.room() < nbytes and self.reclaim is not None:
            self.reclaim(session, nbytes)
        left = self.room()
        if nbytes > left:
            raise CacheBudgetExceeded(
                f"the KV cache would need {human_bytes(nbytes)} more but only {human_bytes(max(left, 0))} "
                f"of this device's {human_bytes(self.budget_bytes)} budget is left"
            )

    def _write_blocks(self, slot: KVSlot, start: int, end: int) -> None:
        """A live slot made to hold exactly the blocks to `end`, those of rows [start, end) its own.
        Under inference mode, the caller's: the pool may be an inference tensor, made by a step under it."""
        table, blocks, pool = slot.table, -(-end // BLOCK), self.pools[slot.pool]
        if len(table) > blocks:
            self._release(pool, table[blocks:], live=True)
            del table[blocks:]
        for i in range(start // BLOCK, len(table)):
            if pool.owners[table[i]] > 1:  # shared: the rows it keeps are copied to a block of its own
                (copy,) = self._take(pool, 1)
                kept = max(0, start - i * BLOCK)  # rows of the block before the write (the rest stay zero)
                pool.k[copy, :kept] = pool.k[table[i], :kept]
                pool.v[copy, :kept] = pool.v[table[i], :kept]
                self._release(pool, [table[i]], live=True)
                table[i] = copy
        table.extend(self._take(pool, blocks - len(table)))

    def _publish(self, session: int, slot: KVSlot, first: int = 0) -> None:
        """Write a live slot's table into `tables` from entry `first` on (those before it are there as they
        are), on the session's row (given one at its first slot)."""
        block_idx, row = slot.pool, self._rows.get(session)
        if row is None:
            row = self._rows[session] = self._free_rows.pop() if self._free_rows else len(self._rows)
        self._tables.write(row, block_idx, slot.table, first)

    def _pool_limit(self, pool: Pool) -> int | None:
        """The most blocks (besides the reserved ones) `pool` may double to: its share of the budget's,
        and no more than the other pools leave of them (None: no budget)."""
        if self.max_blocks is None:
            return None
        allocated = sum(len(other.owners) - RESERVED for other in self.pools.values() if other.owners)
        mine = len(pool.owners) - RESERVED if pool.owners else 0
        return min(self.max_blocks // len(self.pools), mine + self.max_blocks - allocated)

    def _take(self, pool: Pool, n: int) -> list[int]:
        """n free blocks of `pool` (zeros: `_release`), owned by one live table; the pool grows when it has too few."""
        if n > len(pool.free):
            pool.grow(len(pool.owners) + n - len(pool.free), self._pool_limit(pool))
        return self._take_each([pool] * n)

    def _take_each(self, pools: list[Pool]) -> list[int]:
        """A free block of each of `pools` (one named twice gives two), as `_take`'s; a pool without one grows."""
        taken = []
        for pool in pools:
            if not pool.free:
                pool.grow(len(pool.owners) + 1, self._pool_limit(pool))
            block = heapq.heappop(pool.free)
            pool.owners[block] = pool.live[block] = 1
            taken.append(block)
        self._used += len(taken)
        self._live_used += len(taken)
        return taken

    @torch.inference_mode()  # the pool may be an inference tensor: made by a step under inference mode
    def _release(self, pool: Pool, blocks: Iterable[int], live: bool) -> None:
        """One owner (a live session's table when `live`) lets go of `blocks`; a block nobody owns is
        zeroed and free.

        Zeroed because a step reads whole blocks: rows past a request's keys are masked out, but a
        masked row still enters the product with weight 0, and 0 * inf is NaN. No row a session left
        in a block (whatever its input made of it) can reach a later owner's result."""
        freed = []
        for b in blocks:
            if live:
                pool.live[b] -= 1
                self._live_used -= pool.live[b] == 0
            pool.owners[b] -= 1
            if pool.owners[b] == 0:
                freed.append(b)
        if freed:
            ids = int64_tensor(freed, self.device)
            pool.k.index_fill_(0, ids, 0)
            pool.v.index_fill_(0, ids, 0)
            self._used -= len(freed)
            for b in freed:
                heapq.heappush(pool.free, b)

    def _hold_live(self, slots: Iterable[KVSlot], delta: int) -> None:
        for slot in slots:
            live = self.pools[slot.pool].live
            for b in slot.table:
                self._live_used += (live[b] == 0) if delta > 0 else -(live[b] == 1)
                live[b] += delta

    def detach(self, session: int) -> tuple[dict[int, KVSlot], dict[int, LinearSlot]]:
        """Take every slot of `session` out of the live sessions: its blocks stay in use, held by
        whoever keeps the slots (prefix reuse), until `drop`; its linear states are uncounted."""
        slots, linear = self._sessions.pop(session, {}), self._linear.pop(session, {})
        self._continued.pop(session, None)
        self._hold_live(slots.values(), -1)
        row = self._rows.pop(session, None)
        if row is not None:
            self._free_rows.append(row)
            self._tables.clear(row)  # the next session on this row names none of these blocks
        self._linear_bytes -= len(linear) * self.bytes_per_linear_slot
        return slots, linear

    def attach(self, session: int, slots: dict[int, KVSlot], linear: dict[int, LinearSlot] | None = None) -> None:
        """Make `slots` and `linear` (detached, or shared) `session`'s, counted; it must hold none of those block_idx."""
        linear = linear or {}
        mine, mine_linear = self._sessions.get(session, {}), self._linear.get(session, {})
        if mine.keys() & slots.keys() or mine_linear.keys() & linear.keys():
            raise ValueError(f"session {session} already holds some of slots {sorted(slots)}, {sorted(linear)}")
        if slots:
            self._sessions.setdefault(session, mine).update(slots)
        if linear:
            self._linear.setdefault(session, mine_linear).update(linear)
        self._hold_live(slots.values(), +1)
        with torch.inference_mode():
            for slot in slots.values():
                self._publish(session, slot)
        self._linear_bytes += len(linear) * self.bytes_per_linear_slot

    def drop(self, slots: Iterable[KVSlot]) -> None:
        """Free detached slots (a kept prefix given up): their blocks go back unless another table holds them."""
        for slot in slots:
            self._release(self.pools[slot.pool], slot.table, live=False)
            slot.table = []

    def shared_from(self, slots: dict[int, KVSlot], blocks: Iterable[int], length: int) -> dict[int, KVSlot]:
        """New slots holding the first `length` rows of `slots` `blocks` (a session's, or detached),
        their blocks shared (not counted until attached; a write copies a shared block first)."""
        self._continued.clear()  # `slots` may be a live session's: its last blocks are then no longer its own
        shares = {}
        for block_idx in blocks:
            slot = slots[block_idx]
            table = slot.table[: -(-length // BLOCK)]
            owners = self.pools[slot.pool].owners
            for b in table:
                owners[b] += 1
            shares[block_idx] = KVSlot(slot.pool, table, length)
        return shares

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
                self._linear_bytes += self.bytes_per_linear_slot
            linear[block_idx] = LinearSlot(state.conv, state.recurrent, length)

    def rows(self, slot: KVSlot, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's K and V rows [start, end), [H_kv, end - start, D] each (a copy; tests and checks)."""
        ids = int64_tensor([slot.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)], self.device)
        k_rows, v_rows = self.pools[slot.pool].rows()
        return k_rows[ids].transpose(0, 1), v_rows[ids].transpose(0, 1)

    def clear(self, session: int) -> None:
        """Free every block and state of `session` (unknown sessions are a no-op)."""
        slots, _ = self.detach(session)
        self.drop(slots.values())
