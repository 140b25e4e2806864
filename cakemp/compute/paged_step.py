"""One batched step's view of the paged KV pool: every request's rows, positions and blocks as tensors.

A step computes the requests of one layer run together: x: [1, N, H] holds their rows one request
after another, decode requests (one row) first. What attention needs of the pool is built here,
once per step, as a few tensors; no torch call inside a layer is made per request but a prompt
chunk's own attention:

* `StepRows`, once per step: per attention layer and row of x its position and its slot id in the
  pool (two small tensors for the whole step, built from the slots' block tables: a large step of
  decodes in one pass over the host's tables as arrays, `KVCache.decode_rows`, whatever its sessions
  and layers), and, where decode rows are batched, each request's block table (one gather from
  `KVCache.tables`) and which keys each decode row sees;
* `LayerPages`, one per attention layer: `write` puts the step's K/V rows at their slot ids (one
  indexed copy for K, one for V); `attend` runs every decode row in one attention call over its own
  blocks (on a GPU read where they lie, by model/paged_attention.py's kernel; elsewhere gathered,
  padded and masked, in one call per group of rows whose keys span alike: `StepRows.spans`), each
  prompt chunk in one call of its own. A layer's gathers land in the cache's kept gather space
  (`KVCache.gather_space`), not in memory allocated afresh for each.

A step's requests share each layer's KV slot index (the runner groups them so), so a layer reads
and writes one pool (kv_cache.Pool). A request alone in its step whose blocks of a layer lie in one
run of the pool (a session that grew while no other took blocks there: the common case for one
session, and for every prompt's first chunk) reads its keys as a view of the pool, with no gather
and no mask: the same call the contiguous cache made.

Why decode rows go in one call and chunks one each: a decode row's attention is a few hundred
FLOPs per key, so one call per session is mostly dispatch; a chunk's is T times that and a call of
its own is amortised (and takes SDPA's fused causal kernels).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from cakemp.compute.kv_cache import BLOCK, KVCache, KVSlot, int64_tensor
from cakemp.log import get_logger
from cakemp.model import attention
from cakemp.model.rotary import Rotary

# Where a step of d decodes through L attention layers has its rows read from the tables as arrays: at
# L * (4 + d) of at least this. Arrays cost about the same whatever the step's size; reading each slot's
# table in Python costs per layer and per row. A StepRows, warm (µs, Python / arrays): a lone decode through
# 2 layers 11 / 23, through 32 layers 32 / 24; 8 sessions through 4 layers 22 / 22, through 8 32 / 25;
# 32 sessions through 32 layers 198 / 39. Where a CPU's compute has just run, cold, a lone decode
# through 32 layers took 74 / 95: ~20 µs of a 6 ms step.
_ARRAYS_FROM = 80
# Decode rows whose keys span unlike are attended in groups (StepRows.spans) only where one group would pad
# rows by this many bytes of K and V or more: a group's gather and attention call cost about as much as
# gathering this much (2-core Xeon VM, 2 kv heads of 64, f32: ~40 µs).
_SPLIT_BYTES = 1 << 20


class StepRows:
    """The requests of one step, their rows of x (decode requests first), and per attention layer
    where each row's K/V goes and what each decode row reads."""

    def __init__(self, cache: KVCache, sessions: Sequence[int], lengths: Sequence[int],
                 starts: Sequence[int | tuple[int, ...]], slots: Sequence[Sequence[KVSlot | None]],
                 layers: Sequence[int], beyond: Sequence[int] | None = None):
        """Each request's `starts`, its index_pos: an int where every op of it is at one position (a
        decode's, most requests), else a tuple of its ops'; its `slots`, its KV slot of each op (None: a
        linear-attention op's), each holding blocks to the request's end; `layers`: the op of each
        attention layer of the step, in order. The decode requests (`lengths` 1) come first, and a
        layer's requests share its KV slot index (the runner groups and orders them so). `beyond`: where a
        request is a piece of a longer one, that one's rows past the piece (longrope's factors are picked by
        where it ends); None: none is."""
        self.cache = cache
        self._beyond = (0,) * len(lengths) if beyond is None else tuple(beyond)
        self.sessions = tuple(sessions)
        self.lengths = tuple(lengths)
        self._slots, self._layers = slots, tuple(layers)
        d = self.decodes = self.lengths.count(1)  # requests [0, d) have one row each
        B = len(lengths)
        self.firsts = [0, *itertools.accumulate(lengths)][:-1]  # each request's first row of x
        # Per attention layer, each request's index_pos; and per layer the first at the same positions
        # (each mask and rotation is made once for those: for all layers where each request is at one
        # position, as a step's requests mostly are).
        mixed = tuple in set(map(type, starts))  # a request whose ops are at several positions
        if mixed:
            self.starts = [tuple(start if type(start) is int else start[j] for start in starts) for j in layers]
            alike: dict[tuple[int, ...], int] = {}
            self._alike = [alike.setdefault(row, index) for index, row in enumerate(self.starts)]
        else:
            self.starts = [tuple(starts)] * len(layers)
            self._alike = [0] * len(layers)
        pool_ids = [slots[0][j].pool for j in layers]  # each layer's KV slot index
        self.pools = [cache.pools[pool] for pool in pool_ids]
        L, N = len(layers), sum(lengths)
        # One tensor for all (a tensor's making costs more than its size here, and on a GPU each is a
        # copy from the host): positions and slot ids [2, L, N], then each layer's row of the flat block
        # tables for each request [L * B] (`row * slots + pool`, `cache.tables` viewed as [rows * slots,
        # width]: its session's row, the layer's pool).
        if d == B and not mixed and L * (4 + d) >= _ARRAYS_FROM:  # decodes, each at one position
            packed = torch.from_numpy(cache.decode_rows(self.sessions, pool_ids, starts)).to(cache.device)
        else:
            packed = int64_tensor(self._listed(pool_ids), cache.device)
        self.placed = packed[: 2 * L * N].view(2, L, N)  # [2, L, N]: each row's position; its row of the flat pool
        self._picked = packed[2 * L * N :]
        self._placed_views: tuple[torch.Tensor, ...] | None = None
        self._request: torch.Tensor | None = None
        self._tables: torch.Tensor | None = None
        self._spans: dict[tuple, list[KeySpan]] = {}

    def _listed(self, pool_ids: list[int]) -> list[int]:
        """`packed`'s values, each read from a slot's table in Python (`KVCache.decode_rows` reads a step of
        decodes from the tables as arrays); `pool_ids`: each attention layer's KV slot index."""
        cache, slots, layers, d, lengths = self.cache, self._slots, self._layers, self.decodes, self.lengths
        positions, slot_ids = [], []
        for layer_starts, j in zip(self.starts, layers, strict=True):
            # A decode request's one row, at its start (most of a step: one comprehension for them all).
            positions += layer_starts[:d]
            slot_ids += [slot[j].table[p // BLOCK] * BLOCK + p % BLOCK for p, slot in zip(layer_starts[:d], slots)]
            if d == len(lengths):
                continue
            for start, T, request_slots in zip(layer_starts[d:], lengths[d:], slots[d:], strict=True):
                table, rows = request_slots[j].table, range(start, start + T)
                positions += rows
                slot_ids += [table[p // BLOCK] * BLOCK + p % BLOCK for p in rows]
        scaled = [row * cache.tables.shape[1] for row in cache.rows_of(self.sessions)]
        return positions + slot_ids + [row + pool for pool in pool_ids for row in scaled]

    @property
    def positions(self) -> torch.Tensor:
        """Each row's position at each attention layer, [L, N]."""
        return self._placed_rows()[0]

    @property
    def slot_ids(self) -> torch.Tensor:
        """Each row's row of its layer's flat pool, [L, N]."""
        return self._placed_rows()[1]

    def _placed_rows(self) -> tuple[torch.Tensor, ...]:
        if self._placed_views is None:  # (a fixed-shape step copies `placed` whole: it asks for neither)
            self._placed_views = self.placed.unbind(0)
        return self._placed_views

    @property
    def request(self) -> torch.Tensor:
        """Each row's request, [N]."""
        if self._request is None:
            device = self.cache.device
            self._request = torch.repeat_interleave(torch.arange(len(self.lengths), device=device),
                                                    torch.tensor(self.lengths, device=device))
        return self._request

    def long_rows(self, index: int, rotary: Rotary) -> torch.Tensor:
        """[N] bool: the rows of attention layer `index` whose request reaches `rotary`'s long factors
        (longrope picks its factors per request, by where the request ends: a piece's, where its request does)."""
        reaches = [rotary.reaches_long(start + T + more)
                   for start, T, more in zip(self.starts[index], self.lengths, self._beyond, strict=True)]
        return torch.tensor(reaches, device=self.cache.device)[self.request]

    def tables(self, index: int) -> torch.Tensor:
        """Attention layer `index`'s block table of each request, [B, width] (past a table's end: the null block)."""
        return self.all_tables()[index]

    @functools.cached_property
    def blocks_needed(self) -> int:
        """The blocks the step's furthest-reaching request holds in a layer, to its last row (worked out once:
        a GPU's decode rows name it at every layer)."""
        ends = (start + T for index in set(self._alike) for start, T in zip(self.starts[index], self.lengths, strict=True))
        return (max(ends) - 1) // BLOCK + 1

    def alike(self, index: int) -> int:
        """The first attention layer whose requests are at the positions of layer `index`'s."""
        return self._alike[index]

    def slot(self, index: int, i: int) -> KVSlot:
        """Request i's KV slot at attention layer `index`."""
        return self._slots[i][self._layers[index]]

    def all_tables(self) -> torch.Tensor:
        """Every attention layer's block table of each request, [L, B, width], gathered at the first use."""
        if self._tables is None:
            tables = self.cache.tables
            rows, slots, width = tables.shape
            self._tables = tables.view(rows * slots, width).index_select(0, self._picked).view(len(self.pools), -1, width)
        return self._tables

    def layer(self, index: int) -> LayerPages:
        """The pages of the step's `index`-th attention layer."""
        return LayerPages(self, index)

    def spans(self, index: int, window: int | None) -> list[KeySpan]:
        """The decode rows of attention layer `index` in groups (`_grouped`), each row reading its table from
        the first block its keys are in (its window's, else its first) as far as the group's widest row:
        what a group's rows see costs about their own keys to gather and attend over, never those of the
        step's longest row nor of its rows furthest apart (one long context in a step of short ones would
        otherwise cost each short row as much: a step of 8 decodes at 32 positions, 1.6 ms alone, took
        31 ms beside one at 8,128). Shared by layers at the same positions and window, each group's mask
        made once (SDPA would make that mask of a bool one at each call)."""
        key = (self._alike[index], window)
        found = self._spans.get(key)
        if found is None:
            ends = self.starts[index][: self.decodes]
            firsts = [0] * len(ends) if window is None else [max(0, end + 1 - window) // BLOCK for end in ends]
            widths = [end // BLOCK + 1 - first for end, first in zip(ends, firsts, strict=True)]
            found = self._spans[key] = [self._span(index, window, rows, ends, firsts, widths)
                                          for rows in _grouped(widths, self._split_blocks)]
        return found

    def gathers_alike(self, width: int, least: int) -> bool:
        """Whether every decode row may have its keys gathered to `width` blocks, as a fixed-shape step
        gathers them where it reads no keys in place (compute/decode_graph.py): on the terms `spans` keeps a
        group to, each row counted at its blocks from its table's first to its position (such a step reads no
        window's start) and at no fewer than `least`, the narrowest width that step pads to anyway."""
        alike = set(self._alike)
        widths = [max(least, max(self.starts[index][r] for index in alike) // BLOCK + 1) for r in range(self.decodes)]
        return _pads_alike(widths, width, self._split_blocks)

    @functools.cached_property
    def _split_blocks(self) -> int:
        """_SPLIT_BYTES of K and V, in blocks of this cache."""
        return max(1, _SPLIT_BYTES // self.cache.bytes_per_block)

    def _span(self, index: int, window: int | None, rows: list[int], ends: Sequence[int], firsts: list[int],
              widths: list[int]) -> KeySpan:
        """The KeySpan of decode rows `rows` (each at `ends`, its keys in `widths` blocks from block `firsts`)
        at attention layer `index` (a lone row's without a mask: it attends as a lone request does)."""
        device = self.cache.device
        picked = None if len(rows) == self.decodes else int64_tensor(rows, device)
        if len(rows) == 1:
            return KeySpan(rows, picked, None, None)
        if picked is not None:
            ends, firsts, widths = ([values[r] for r in rows] for values in (ends, firsts, widths))
        positions = self.positions[index, : self.decodes]
        positions = positions if picked is None else positions[picked]
        width, first = max(widths), min(firsts)
        if first == max(firsts):  # (every row where there is no window) their keys one slice of the tables: [S]
            columns = slice(first, first + width)
            keys = torch.arange(first * BLOCK, max(ends) + 1, device=device)  # to the furthest row's own
        else:  # each row's own blocks, [n, width], and their keys' positions, [n, S]
            S = max(end + 1 - start * BLOCK for end, start in zip(ends, firsts, strict=True))
            starts = int64_tensor(firsts, device)[:, None]
            # Past the tables' width (a row's blocks ending before the group's widest): their last column,
            # the null block or the row's own, masked either way.
            columns = (starts + torch.arange(width, device=device)).clamp_(max=self.cache.tables.shape[2] - 1)
            keys = starts * BLOCK + torch.arange(S, device=device)
        seen = attention.seen_keys(keys, positions, window)
        return KeySpan(rows, picked, columns, attention.bias(seen, self.cache.dtype))


class KeySpan(NamedTuple):
    """Decode rows of a step attended together: `rows` (their indices; `picked` the same on the device,
    None where they are every decode row, in order), the columns of their block tables their keys lie in
    (one slice for all, or each row's own, [rows, width]: its table's from its first block on), and which
    gathered keys each sees, [rows, S] as SDPA's additive mask (0 seen, -inf not). A lone row's has neither
    columns nor mask: it attends as a lone request does."""

    rows: list[int]
    picked: torch.Tensor | None
    columns: slice | torch.Tensor | None
    visible: torch.Tensor | None


def _grouped(widths: Sequence[int], split: int) -> list[list[int]]:
    """Decode rows in groups to attend together, row r reading `widths[r]` blocks of its table and every row of a
    group as many as its widest: all together where none is padded past twice its own, or the padding is
    under `split` blocks (a group's gather and call cost about what gathering that many blocks does); else
    widest first, a row joining the group before it on the same terms."""
    if _pads_alike(widths, max(widths), split):
        return [list(range(len(widths)))]  # (the step's rows alike: most steps)
    groups: list[list[int]] = []
    widest = padding = 0
    for r in sorted(range(len(widths)), key=widths.__getitem__, reverse=True):
        if groups and (widest <= 2 * widths[r] or padding + widest - widths[r] < split):
            groups[-1].append(r)
            padding += widest - widths[r]
            continue
        groups.append([r])
        widest, padding = widths[r], 0
    return groups


def _pads_alike(widths: Sequence[int], width: int, split: int) -> bool:
    """Whether rows reading `widths[r]` blocks each may all be padded to `width` blocks: none past twice its
    own, or all by under `split` blocks together."""
    return width <= 2 * min(widths) or width * len(widths) - sum(widths) < split


@functools.cache
def in_place_attention(device: torch.device, dtype: torch.dtype, n_rep: int, head_dim: int) -> Callable | None:
    """How decode rows of a layer of `n_rep` query heads a kv head of `head_dim`, in `dtype`, attend on
    `device` (a KVCache's `paged_attend`): on a GPU in place, by model/paged_attention.py's kernel, once it
    has run there beside the portable way and matched it; else None, the portable way (gathered keys and
    SDPA), as on a CPU. The choice is logged once, with the reason where the kernel is not used."""
    if device.type != "cuda":
        return None
    try:
        from cakemp.model import paged_attention  # Triton: a GPU's torch brings it

        paged_attention.trial(device, dtype, n_rep, head_dim)
    except Exception as e:  # a kernel that cannot be imported, compiled or run here, or that differs, is not used
        get_logger().warning("decode attention over gathered keys: the paged kernel is unavailable",
                             device=str(device), reason=f"{type(e).__name__}: {str(e)[:200]}")
        return None
    get_logger().info("decode attention in place", device=str(device), kernel="model/paged_attention.py")
    return paged_attention.attend


class LayerPages:
    """Where one layer's step writes its K/V rows and what each row attends over (model.block.Pages)."""

    def __init__(self, step: StepRows, index: int):
        self.step, self.index = step, index

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, H_kv, N, D], the step's new rows, into each request's blocks."""
        self.step.pools[self.index].write(self.step.slot_ids[self.index], k, v)

    def attend(self, q: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
        """q: [1, H_q, N, D] -> [1, H_q, N, D]: each row over its request's keys up to its own position
        (the last `window` of them where there is one), the step's rows already written."""
        step = self.step
        d, B = step.decodes, len(step.lengths)
        if B == 1 or d == 0:  # each request in a call of its own (one request, or prompt chunks only)
            return self._each(q, range(B), window, scale)
        if d == B:
            return self._decode_rows(q[0].transpose(0, 1), window, scale).transpose(0, 1)[None]
        out = torch.empty_like(q)
        out[0, :, :d] = self._decode_rows(q[0, :, :d].transpose(0, 1), window, scale).transpose(0, 1)
        out[:, :, d:] = self._each(q[:, :, d:], range(d, B), window, scale)
        return out

    def _each(self, q: torch.Tensor, requests: range, window: int | None, scale: float) -> torch.Tensor:
        """q: [1, H_q, n, D], the rows of `requests` -> [1, H_q, n, D], each request attended on its own."""
        step, starts = self.step, self.step.starts[self.index]
        outs = []
        for i in requests:
            start, T, first = starts[i], step.lengths[i], step.firsts[i] - step.firsts[requests[0]]
            # Through a window, its keys from the block its first row's window starts in (positions counted from there).
            skipped = 0 if window is None else max(0, start + 1 - window) // BLOCK
            k, v = self._keys(i, skipped, start + T)
            outs.append(attention.attend(q[:, :, first : first + T], k, v, start - skipped * BLOCK, window, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _keys(self, i: int, skipped: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's K and V from block `skipped` of its table to position `end`, [1, H_kv, S >= end -
        skipped * BLOCK, D]: a view of the pool where those blocks are one run, else gathered."""
        pool = self.step.pools[self.index]
        last = -(-end // BLOCK)
        table = self.step.slot(self.index, i).table[skipped:last]
        first = table[0]
        if table[-1] - first == len(table) - 1 and table == list(range(first, first + len(table))):
            rows = slice(first * BLOCK, (first + len(table)) * BLOCK)
            k_rows, v_rows = pool.rows()
            return k_rows[rows].transpose(0, 1)[None], v_rows[rows].transpose(0, 1)[None]
        return self._gather(self.step.tables(self.index)[i : i + 1, skipped:last])

    def _decode_rows(self, q: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
        """q: [d, H_q, D], the decode rows (one per request) -> [d, H_q, D]."""
        step, d = self.step, q.shape[0]
        if step.cache.paged_attend is not None:  # a GPU's: each row's keys read where they lie
            pool = step.pools[self.index]
            return step.cache.paged_attend(q, pool.k, pool.v, step.tables(self.index)[:d], step.positions[self.index, :d],
                                           window, scale, step.blocks_needed * BLOCK)
        spans = step.spans(self.index, window)
        if len(spans) == 1:
            return self._span_rows(q, spans[0], window, scale)
        out = torch.empty_like(q)
        for span in spans:
            out.index_copy_(0, span.picked, self._span_rows(q.index_select(0, span.picked), span, window, scale))
        return out

    def _span_rows(self, q: torch.Tensor, span: KeySpan, window: int | None, scale: float) -> torch.Tensor:
        """q: [n, H_q, D], the decode rows of `span` -> [n, H_q, D]: a lone row as a lone request's (its keys a
        view of the pool where its blocks are one run), several over their blocks gathered, padded and masked."""
        if len(span.rows) == 1:
            return self._each(q[:, :, None], range(span.rows[0], span.rows[0] + 1), window, scale)[:, :, 0]
        tables = self.step.tables(self.index)[: self.step.decodes]
        tables = tables if span.picked is None else tables.index_select(0, span.picked)
        columns = span.columns
        tables = tables[:, columns] if type(columns) is slice else tables.gather(1, columns)
        k, v = self._gather(tables)  # [n, H_kv, width * BLOCK, D]
        S = span.visible.shape[1]
        return attention.attend_rows(q, k[:, :, :S], v[:, :, :S], span.visible, scale)

    def _gather(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables: [b, n] -> the K and V of those blocks, [b, H_kv, n * BLOCK, D], into the cache's
        gather space (read by this layer's attention before any other gather)."""
        step = self.step
        return step.pools[self.index].gather(tables, step.cache.gather_space(tables.numel()))
