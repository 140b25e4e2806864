"""Prefix reuse: the rows of a session's run kept past its end, so that a request sending them
again costs only its new rows.

A Cake master serving a chat ends each request with Goodbye and sends the next turn from
position 0 with the whole history again. So each session's run (through its ops' layers and
KV slots, its `LayerPath`, from position 0) is followed as it goes: a chain of digests of its
input rows (row_chain.py), its output rows, and for a run with linear-attention layers their
states where each request of more than one row ended (`StatePoint`s: every prompt chunk's
end). On Goodbye, or when the session starts again at position 0, that becomes a retired
`Prefix` holding the session's KV slots as they were (moved, not copied: their blocks stay
where they are), with a state point at its end.

A request at position 0 whose first rows agree with a retired prefix of its domain and layer path
(MIN_REUSE rows at least, or the whole of a shorter request) adopts it: its KV slots become
the session's again. While the rows the session sends agree with the prefix's, they are
answered its kept output rows and not computed: the session's KV slots are set to them, and a
recurrent run's state follows from one state point to the next (until the next one, the
agreeing rows since the last one wait as `pending`, and the slots' later rows are still the
prefix's). A prompt comes in chunks, so this goes on request after request. Where the rows
stop agreeing, or the prefix ends, the run computes from there, or from the last state point
at or before there (a linear-attention state cannot be rewound), the pending rows first.
Across devices a hit propagates: the next device's input is this one's output, the kept rows
bit for bit.

Chats interleaved on one connection share their first rows (a system prompt): a session that
leaves an adopted prefix before its end continues on the blocks of the rows it shares (shared, copied only
where it writes) and puts the prefix back whole (`_put_back`), and one whose rows agree further with another retired prefix
holding all of its rows so far switches to it (`_switch`).

Everything kept for reuse alone (retired prefixes, and live sessions' output rows and state
points) is counted inside the KV cache's budget and given back the moment a live session needs
the room (`release`: retired prefixes oldest first, then what live sessions keep, least
recently used first): it never makes a request fail. A live session that finds no room to keep
its output rows stops being followed until it starts again at 0.

Domains: by default a prefix is reused only by the session (one master connection) it came
from, and freed with it; with `shared`, by any session, and a closed connection's rows are
retired like a Goodbye's.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cakemp.compute.kv_cache import KVCache, KVSlot, LinearSlot
from cakemp.compute.output_rows import OutputRows, RowPool
from cakemp.compute.row_chain import Extension, RowChain
from cakemp.errors import PositionGap, RecurrentRewind
from cakemp.model.deltanet import LinearState
from cakemp.sources import session_source

# Retired prefixes kept at most, whatever the budget (none may be unbounded, and a lookup scans them).
MAX_RETIRED = 256
# Rows a request must reuse for a hit (one block of 16 rows): fewer save next to nothing.
MIN_REUSE = 16
SHARED = -1  # the domain of every session when prefixes are shared

# The layers a request's ops run through on this device, with the KV slot of each:
# (layer, block_idx) of each op, in order. A prefix is reused only by a request of the same one.
LayerPath = tuple[tuple[int, int], ...]


# A run's linear-attention states after some position: block_idx -> state (where the run may resume).
StatePoint = dict[int, LinearState]


@dataclass
class Prefix:
    """A run's rows from position 0 in one session, and what is kept of them: a live session's, or retired."""

    domain: int
    layer_path: LayerPath
    chain: RowChain  # the input rows taken, [0, length)
    outputs: OutputRows  # their output rows
    points: dict[int, StatePoint] = field(default_factory=dict)  # runs with linear layers: position -> states
    # Live only: the chain of an adopted prefix while its rows past `chain` may still match.
    ahead: RowChain | None = None
    # Live only: where the session's KV slots and linear states are, `chain.length` but while a
    # recurrent run answers agreeing rows past its last state point: then `pending` holds their
    # input rows [resumed, chain.length), [1, n, H], to compute from there once they stop agreeing.
    resumed: int = 0
    pending: torch.Tensor | None = None
    slots: dict[int, KVSlot] = field(default_factory=dict)  # retired only: the attention layers' KV slots
    used: int = 0  # when last used (for least recently used first)
    source: int = 0  # the source of the session it came from (sources.session_source)
    # The bytes it holds besides KV blocks as last counted: a live prefix's after each request (only
    # a request changes it), a retired one's as it was retired (unchanged until it is taken out);
    # and a retired one's KV blocks, counted then too.
    held: int = 0
    held_kv: int = 0

    @property
    def lags(self) -> bool:
        return self.resumed < self.chain.length


class Begun(NamedTuple):
    """A request [start, end) as prefix reuse takes it: rows [resume, end) are computed, from
    input rows `pending` and then the request's own when resume < start; the answer is `kept`
    (output rows [start, resume), when resume > start), then the computed rows from start on.
    (A tuple: one is made per request, in a quarter of a frozen dataclass's time.)"""

    session: int
    prefix: Prefix
    extension: Extension
    resume: int
    kept: torch.Tensor | None = None  # [1, resume - start, H]
    pending: torch.Tensor | None = None  # [1, start - resume, H]

    @property
    def computes(self) -> bool:
        return self.resume < self.extension.end


def _not_continued(length: int, start: int | None) -> PositionGap:
    """Why a request of a session holding `length` positions of a run with a linear-attention layer, at `start`
    on that run's layers (None: at several positions, or on other layers), does not continue it."""
    if start is not None and 0 < start < length:
        return RecurrentRewind(f"index_pos {start} would rewind a linear-attention layer's recurrent state, which "
                               f"cannot be rewound: it has consumed {length} positions in this session; continue at "
                               f"{length} or start again at 0")
    return PositionGap(f"index_pos {start} does not follow the {length} positions of this session's run, whose re-sent "
                       f"rows are being answered from kept rows: continue at {length}, or start again at 0")


class PrefixCache:
    """The prefixes of one device's runner: each live session's, and the retired ones (module docstring)."""

    def __init__(self, cache: KVCache, recurrent: Sequence[bool], hidden: int, shared: bool = False,
                 regime: Callable[[int], bytes] | None = None):
        """`recurrent[layer]`: the runner's layer `layer` is a linear-attention layer. `regime(end)`: how a
        request ending at `end` rotates its rows, as bytes (b"": as any other; a longrope model's past its
        original context: otherwise, row_chain.py), hashed with its rows; None where every request is alike."""
        self._cache = cache
        self._regime = regime
        cache.spare = self  # its budget asks for room back (release)
        self._recurrent = tuple(recurrent)
        self._row_bytes = hidden * cache.dtype.itemsize
        self._outputs = RowPool(hidden, cache.dtype, cache.device, cache.budget_bytes)  # every prefix's output rows
        self._shared = shared
        self._live: dict[int, Prefix] = {}  # session -> its run's prefix
        self._retired: list[Prefix] = []  # oldest first
        self._retired_held = 0  # the retired prefixes' `held`, summed
        self._retired_kv = 0  # and their `held_kv`
        self._live_held = 0  # the live ones'
        self._clock = itertools.count(1)
        # Since the last report.
        self.hits = self.tokens = self.evictions = 0

    # -- requests

    def begin(self, session: int, x: torch.Tensor, rows: memoryview, start: int | None, path: LayerPath,
              beyond: int = 0) -> Begun | None:
        """Take a request (x: [1, T, H], `rows` its bytes on the host; its ops checked against the
        runner's layers, `start` the position every one of them is at, None where they differ; `path`
        their layers and KV slots; `beyond`: a piece's request's rows past it) before it runs: a request
        at 0 retires what the session held and may adopt a retired prefix; one following an adopted
        prefix goes on matching it. None when the
        request is not followed (its ops start at different positions, or it does not continue the
        session's run: the session is then not followed until it starts again at 0)."""
        if start == 0:
            self.retire(session)  # a new prompt replaces the session's rows: they are kept
            prefix = Prefix(SHARED if self._shared else session, path, RowChain(self._row_bytes),
                            OutputRows(self._outputs), source=session_source(session))
            self._live[session] = prefix
        else:
            prefix = self._live.get(session)
            if start is None or prefix is None or prefix.layer_path != path or prefix.chain.length != start:
                if prefix is not None and prefix.lags:
                    # Its state is behind rows it was answered (kept rows past the last state point of a recurrent
                    # run, computed with its next rows): refused as it would be had it computed them, and followed
                    # still, to go on where it was.
                    raise _not_continued(prefix.chain.length, start if prefix.layer_path == path else None)
                self._drop(session)
                return None
        prefix.used = next(self._clock)
        extension = prefix.chain.extension(rows, b"" if self._regime is None else self._regime(start + x.shape[1] + beyond))
        if start == 0:
            self._adopt(session, prefix, extension)
        if prefix.ahead is None:  # nothing it holds changed (a decode step; a prompt that adopted nothing)
            return Begun(session, prefix, extension, start)
        begun = self._follow(session, prefix, extension, x)
        self._count(prefix)  # what it adopted and followed
        return begun

    def finish(self, begun: Begun, computed: torch.Tensor, states: dict[int, LinearState]) -> None:
        """The request computed its rows [resume, end) (`computed`: [1, n, H]) and the linear
        layers' `states` after them (block_idx -> state): keep them, if there is room."""
        extension = begun.extension
        point = extension.end - extension.start > 1 and self._linear(begun.prefix.layer_path)
        changes = self._advance(begun, self._point_bytes(begun.prefix.layer_path) if point else 0)
        if changes is None:
            return
        prefix = begun.prefix
        skip = max(0, extension.start - begun.resume)  # rows answered from kept rows before: they stay
        prefix.outputs.write(begun.resume + skip, computed[:, skip:] if skip else computed)
        if point:
            prefix.points[extension.end] = dict(states)
        if changes:
            self._count(prefix)

    def finish_rows(self, begun: Sequence[Begun], rows: torch.Tensor) -> None:
        """Requests that computed one row each, at their start (none kept by reuse; no linear state point:
        one row), rows: [n, H], row i begun[i]'s: kept as `finish` keeps them, in one copy."""
        slots, kept = [], []
        for i, decode in enumerate(begun):
            changes = self._advance(decode, 0)
            if changes is None:
                continue
            slots.append(decode.prefix.outputs.slot(decode.resume))
            kept.append(i)
            if changes:
                self._count(decode.prefix)
        if kept:
            self._outputs.write(slots, rows if len(kept) == len(begun) else rows[kept])

    def _advance(self, begun: Begun, point_bytes: int) -> bool | None:
        """Take a request's rows into its prefix (its chain to the request's end, room for its output
        rows and `point_bytes` more), if it is still followed and there is room (else None: no longer
        followed); whether what the prefix holds changed (most decode steps: no)."""
        prefix, extension = begun.prefix, begun.extension
        if self._live.get(begun.session) is not prefix:  # no longer followed (its room was needed)
            return None
        needed = prefix.outputs.growth(extension.end) + point_bytes
        if needed and not self._make_room(needed):  # (most requests need none: their rows fit their blocks)
            self._drop(begun.session, evicted=True)
            return None
        prefix.outputs.hold(extension.end)  # (a GPU short of memory raises here: the runner gives its step up)
        changes = bool(needed) or prefix.pending is not None
        prefix.chain.advance(extension, extension.end)
        prefix.resumed, prefix.pending = extension.end, None
        return changes

    def give_up(self, sessions: Iterable[int]) -> None:
        """Stop following `sessions`, their kept rows given back: a step that ran them found no memory
        for those rows (a GPU out of it). Their requests are answered all the same."""
        for session in sessions:
            self._drop(session, evicted=True)

    @staticmethod
    def _held(outputs: OutputRows, end: int) -> bool:
        """Whether `outputs` now holds rows [0, end): False where a GPU has no memory for them."""
        try:
            outputs.hold(end)
        except torch.OutOfMemoryError:
            return False
        return True

    # -- sessions

    def retire(self, session: int) -> None:
        """Goodbye (or a new prompt at 0): the session's run becomes a retired prefix, holding its
        KV slots; the session holds nothing afterwards. Without a followed run, nothing is kept
        (the caller frees the session)."""
        prefix = self._unfollow(session)
        if prefix is None:
            return
        kv, linear = self._cache.detach(session)
        recurrent = self._recurrent_slots(prefix.layer_path)
        kept = self._run_slots(prefix.layer_path, kv)
        if not self._keepable(prefix, kept, linear):
            self._cache.drop(kept.values())
            prefix.outputs.free()
            return
        length = prefix.chain.length
        if recurrent and length not in prefix.points:
            prefix.points[length] = {block_idx: LinearState(linear[block_idx].conv, linear[block_idx].recurrent)
                                     for block_idx in recurrent}
        prefix.slots = kept
        for slot in prefix.slots.values():
            slot.length = length
        self._keep(prefix)

    def _keepable(self, prefix: Prefix, kept: dict[int, KVSlot], linear: dict[int, LinearSlot]) -> bool:
        """Whether a retiring run's detached state (`kept`, its attention slots; `linear`) is the state
        this run left, at its length, and long enough to be worth keeping."""
        attention, recurrent = self._attention(prefix.layer_path), self._recurrent_slots(prefix.layer_path)
        if not (len(kept) == len(attention) and set(recurrent) <= linear.keys()):
            return False
        if prefix.ahead is not None:
            # Adopted rows not all followed yet: nothing past the slots' length was written, so
            # the adopted prefix is whole still and is kept whole again.
            prefix.chain, prefix.ahead = prefix.ahead, None
        elif any(kept[b].length != prefix.chain.length for b in attention) or \
                any(linear[b].length != prefix.chain.length for b in recurrent):
            return False
        return prefix.chain.length >= MIN_REUSE

    def end(self, session: int) -> None:
        """The session's connection closed: its rows are retired if prefixes are shared, else
        nothing of it is kept (its domain's retired prefixes can never be asked for again)."""
        if self._shared:
            self.retire(session)
            return
        self._drop(session)
        for prefix in [prefix for prefix in self._retired if prefix.domain == session]:
            self._discard(prefix)

    def release(self, nbytes: int) -> None:
        """Give up what is kept for reuse until the budget has `nbytes` of room, if there is that
        much: a live session needs it. Retired prefixes go first, oldest first, then what live
        sessions keep. Room is the cache's own count: a prefix whose blocks a session shares frees
        only the blocks no one else holds."""
        if self._make_room(nbytes):
            return
        # A session whose state lags behind rows it was answered needs its record to catch up.
        followed = sorted((s for s, prefix in self._live.items() if not prefix.lags), key=lambda s: self._live[s].used)
        for session in followed:
            if self._cache.room() >= nbytes:
                break
            self._drop(session, evicted=True)

    # -- figures

    def nbytes(self) -> int:
        """Bytes held for reuse alone besides KV blocks (which the cache counts): output rows, state
        points and pending rows, of retired prefixes and live sessions."""
        # The budget asks at every block a session takes: kept counted as prefixes change, come and go.
        return self._retired_held + self._live_held

    def retired_bytes(self) -> int:
        """Bytes retired prefixes hold, their KV blocks included (the device reports it every step)."""
        return self._retired_held + self._retired_kv

    def kept_bytes(self) -> int:
        """Live sessions' output rows, state points and pending rows (their KV blocks are the sessions')."""
        return self._live_held

    def retired_count(self) -> int:
        return len(self._retired)

    # -- inside

    def _adopt(self, session: int, prefix: Prefix, extension: Extension) -> None:
        """Make the retired prefix of the session's domain and layer path whose rows agree with the
        request's furthest (MIN_REUSE rows at least, or all of a shorter request) the session's:
        its KV slots, output rows and state points, moved."""
        best, best_agreed = None, min(MIN_REUSE, extension.end)
        for candidate in self._retired:
            if candidate.domain == prefix.domain and candidate.layer_path == prefix.layer_path:
                agreed = extension.agreed(candidate.chain)
                if agreed >= best_agreed:  # the newest of equals
                    best, best_agreed = candidate, agreed
        if best is None:
            return
        self._unretire(best)
        self._cache.clear(session)  # whatever the session held outside a followed run
        self._cache.attach(session, best.slots)
        best.slots = {}
        prefix.outputs.free()  # (a new prompt's: none yet)
        prefix.outputs, prefix.points, prefix.ahead = best.outputs, best.points, best.chain
        self.hits += 1

    def _follow(self, session: int, prefix: Prefix, extension: Extension, x: torch.Tensor) -> Begun:
        """Take the request's rows that agree with the adopted prefix: answered from its kept
        output rows, the session's state moved to the furthest state point among them; the rest
        computed from there. Rows agreeing to the request's end keep the prefix for the next."""
        start, end = extension.start, extension.end
        agreed = extension.agreed(prefix.ahead)
        if agreed < min(end, prefix.ahead.length) and self._switch(session, prefix, extension, agreed):
            agreed = extension.agreed(prefix.ahead)
        usable = [p for p in prefix.points if start < p <= agreed] if self._linear(prefix.layer_path) else [agreed]
        resume = max(usable, default=prefix.resumed)
        if resume > prefix.resumed:
            states = prefix.points[resume] if self._linear(prefix.layer_path) else {}
            self._cache.resume(session, self._attention(prefix.layer_path), resume, states)
            self.tokens += resume - prefix.resumed
        kept = prefix.outputs.rows(start, agreed) if agreed > start else None
        if agreed == end and (end < prefix.ahead.length or resume == end):
            # Every row agreed: answered from kept rows, nothing computed. The next request goes on
            # with the prefix's later rows; a recurrent run's state stays at its last point meanwhile.
            behind = x[:, resume - start:] if resume >= start else torch.cat([prefix.pending, x], dim=1)
            prefix.chain.advance(extension, end)
            prefix.resumed, prefix.pending = resume, behind if resume < end else None
            if agreed == prefix.ahead.length:
                self._leave(prefix, resume)
            return Begun(session, prefix, extension, end, kept)
        # The rows stop agreeing (or the prefix ends) here: compute from the last state point.
        pending = None if resume >= start else prefix.pending[:, : start - resume]
        if resume > start:
            prefix.chain.advance(extension, resume)
            kept = kept[:, : resume - start]
        else:
            kept = None
        prefix.resumed, prefix.pending = resume, None
        if agreed < prefix.ahead.length:  # the session leaves the prefix before its end
            self._put_back(session, prefix, resume, start, end)
        self._leave(prefix, resume)
        return Begun(session, prefix, extension, resume, kept, pending)

    def _switch(self, session: int, prefix: Prefix, extension: Extension, agreed: int) -> bool:
        """Follow, instead of the adopted prefix, a retired one that holds every row the session
        has taken (the chains agree at `start`) and agrees with more of this request's, if there
        is one (chats interleaved on one connection share their first rows): the prefix left is
        retired whole again, its rows untouched."""
        start, mine = extension.start, prefix.chain.digest_at(extension.start)
        best, best_agreed = None, agreed
        for candidate in self._retired:
            if (candidate.domain, candidate.layer_path) == (prefix.domain, prefix.layer_path) and \
                    candidate.chain.length >= start and candidate.chain.digest_at(start) == mine:
                if (candidate_agreed := extension.agreed(candidate.chain)) > best_agreed:
                    best, best_agreed = candidate, candidate_agreed
        if best is None:
            return False
        self._unretire(best)
        kv, linear = self._cache.detach(session)  # the linear states stay: computed from the same rows
        self._keep_whole(prefix, kv)
        for slot in best.slots.values():
            slot.length = prefix.resumed  # rows before it computed from the same rows as the session's
        self._cache.attach(session, best.slots, linear)
        best.slots = {}
        prefix.ahead, prefix.outputs = best.chain, best.outputs
        prefix.points = {**best.points, **{p: point for p, point in prefix.points.items() if p <= start}}
        return True

    def _leave(self, prefix: Prefix, resume: int) -> None:
        """The session no longer follows its adopted prefix past `resume`."""
        prefix.ahead = None
        prefix.points = {position: point for position, point in prefix.points.items() if position <= resume}

    def _put_back(self, session: int, prefix: Prefix, resume: int, start: int, end: int) -> None:
        """The session's rows leave the adopted prefix: retire the prefix whole again, its slots'
        rows untouched, and give the session the blocks of the KV rows before `resume` (shared: the
        session's writes copy a shared block first) and a copy of the output rows before the
        request's `start` or `resume`, so that another chat sharing only its start does not cut it
        short. If the output rows do not fit the budget (or a GPU's memory), the prefix's rows past
        `resume` are the session's to overwrite."""
        attention = self._attention(prefix.layer_path)
        outputs = OutputRows(self._outputs)
        if not (self._make_room(outputs.growth(end)) and self._held(outputs, max(resume, start))):
            return
        shares = self._cache.shared_from(self._cache.slots(session), attention, resume)
        kv, linear = self._cache.detach(session)
        self._cache.attach(session, shares, linear)
        outputs.write(0, prefix.outputs.rows(0, max(resume, start)))
        self._keep_whole(prefix, kv)
        prefix.outputs = outputs

    def _keep_whole(self, prefix: Prefix, kv: dict[int, KVSlot]) -> None:
        """Retire the prefix `prefix` follows (`prefix.ahead`) whole again, its KV slots `kv` (detached
        from the session, nothing past its rows written) at its length."""
        slots = self._run_slots(prefix.layer_path, kv)
        for slot in slots.values():
            slot.length = prefix.ahead.length
        self._keep(Prefix(prefix.domain, prefix.layer_path, prefix.ahead, prefix.outputs, dict(prefix.points),
                          slots=slots, used=prefix.used, source=prefix.source))

    def _keep(self, prefix: Prefix) -> None:
        """Retire `prefix` (its slots at its chain's length), the newest; past MAX_RETIRED the oldest of the
        source that retired the most goes (a master saying Goodbye again and again pushes out its own)."""
        prefix.held, prefix.held_kv = self._held_bytes(prefix), self._kv_bytes(prefix)
        self._retired_held += prefix.held
        self._retired_kv += prefix.held_kv
        self._retired.append(prefix)
        if len(self._retired) > MAX_RETIRED:
            retired = Counter(kept.source for kept in self._retired)
            most = max(retired, key=retired.__getitem__)
            self._discard(next(kept for kept in self._retired if kept.source == most), evicted=True)

    def _unretire(self, prefix: Prefix) -> None:
        """Take `prefix` out of the retired (given up, or made a session's again)."""
        self._retired.remove(prefix)
        self._retired_held -= prefix.held
        self._retired_kv -= prefix.held_kv

    def _make_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit the budget, once retired prefixes (oldest first) are freed as needed."""
        while (room := self._cache.room()) is not None and room < nbytes and self._retired:
            self._discard(self._retired[0], evicted=True)
        return room is None or room >= nbytes

    def _discard(self, prefix: Prefix, evicted: bool = False) -> None:
        """A retired prefix given up, its blocks freed (those no session shares)."""
        self._unretire(prefix)
        self._cache.drop(prefix.slots.values())
        prefix.outputs.free()
        self.evictions += evicted

    def _drop(self, session: int, evicted: bool = False) -> None:
        """Stop following the session (its KV state stays the session's; its output rows go)."""
        prefix = self._unfollow(session)
        if prefix is not None:
            prefix.outputs.free()
            self.evictions += evicted

    def _unfollow(self, session: int) -> Prefix | None:
        """Take the session's prefix (if followed) out of the live ones, uncounted."""
        prefix = self._live.pop(session, None)
        if prefix is not None:
            self._live_held -= prefix.held
        return prefix

    def _count(self, prefix: Prefix) -> None:
        """Count again what a live prefix holds, once a request changed it."""
        held = self._held_bytes(prefix)
        self._live_held += held - prefix.held
        prefix.held = held

    def _run_slots(self, path: LayerPath, kv: dict[int, KVSlot]) -> dict[int, KVSlot]:
        """The KV slots of the path's attention layers among detached `kv`; the others are freed."""
        slots = {block_idx: kv.pop(block_idx) for block_idx in self._attention(path) if block_idx in kv}
        self._cache.drop(kv.values())
        return slots

    def _linear(self, path: LayerPath) -> bool:
        return any(self._recurrent[layer] for layer, _ in path)

    def _attention(self, path: LayerPath) -> list[int]:
        """The KV slots (block_idx) of the path's attention layers."""
        return [block_idx for layer, block_idx in path if not self._recurrent[layer]]

    def _recurrent_slots(self, path: LayerPath) -> list[int]:
        """The block_idx of the path's linear-attention layers."""
        return [block_idx for layer, block_idx in path if self._recurrent[layer]]

    def _point_bytes(self, path: LayerPath) -> int:
        return sum(self._recurrent[layer] for layer, _ in path) * self._cache.bytes_per_linear_slot

    def _held_bytes(self, prefix: Prefix) -> int:
        """What `prefix` holds besides KV blocks: output rows, state points, pending rows."""
        pending = 0 if prefix.pending is None else prefix.pending.numel() * prefix.pending.element_size()
        points = len(prefix.points) * self._point_bytes(prefix.layer_path) if prefix.points else 0
        return prefix.outputs.nbytes + points + pending

    def _kv_bytes(self, prefix: Prefix) -> int:
        """The bytes of a retired prefix's KV blocks (a live one holds none: its session's slots do)."""
        return sum(slot.capacity for slot in prefix.slots.values()) * self._cache.bytes_per_position
