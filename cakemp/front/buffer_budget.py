"""The bytes all master connections together may hold in frames being read or served, shared among their sources.

A connection takes a whole frame's payload size once its header is in, before reading the
payload, and gives it back once the request is answered. When no room is free it waits, reading
nothing more, so the peer's TCP window fills and it is slowed down (backpressure) instead of the
front buffering past the cap. Taking a frame's size all at once means no connection ever holds
part of the budget while waiting for more: no two wait on each other.

Peers that stop reading their replies hold their requests' bytes until --frame-timeout closes
them, so the budget is shared by source address (per IPv6 /64, sources.py), not first come first
served:

* a source may hold one frame, and more only within its share: `capacity` divided among the
  sources holding bytes or waiting for them;
* waiting frames are granted in the order of what their source holds (least first), then of
  arrival; a frame that does not fit yet is not overtaken by later ones of sources holding as
  much or more, so a large frame is not starved by a stream of small ones, and a correct master's
  frame waits for the first bytes given back, not behind every stalled peer's next frame;
* a small frame (at most SMALL_FRAME: a Hello, a decode step) that finds no room takes one of the
  RESERVE bytes kept beside `capacity`, one frame per source at a time, so that a peer's Hello and
  decode steps pass however much stalled peers hold.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from cakemp.sources import source_of

SMALL_FRAME = 64 << 10
RESERVE = 16 * SMALL_FRAME  # beside the capacity: small frames of 16 sources at once


@dataclass(frozen=True)
class Held:
    """Bytes a frame holds: give them back with `BufferBudget.give`."""

    size: int
    source: str
    reserved: bool  # taken from the reserve of small frames


@dataclass(frozen=True, eq=False)
class _Waiter:
    seq: int  # arrival order
    size: int
    source: str
    granted: asyncio.Future  # its Held, once granted


class BufferBudget:
    def __init__(self, capacity: int, on_change: Callable[[int], None] | None = None):
        self.capacity = capacity
        self.held = 0  # bytes held, the reserve's included
        self._on_change = on_change  # told the bytes held after every change (the front's gauge)
        self._in_capacity = 0  # bytes held of `capacity` (the rest, of the reserve)
        self._by_source: Counter[str] = Counter()  # bytes of `capacity` each source holds
        self._reserved: dict[str, int] = {}  # source -> the small frame it holds of the reserve
        self._waiters: list[_Waiter] = []  # arrival order
        self._seq = itertools.count()

    async def take(self, size: int, host: str) -> Held:
        """Hold `size` bytes (at most `capacity`) for a frame from `host`, waiting until they are free; returns
        at once when they are."""
        if size > self.capacity:
            raise ValueError(f"{size} bytes is more than the whole budget of {self.capacity}")
        source = source_of(host)
        waiter = _Waiter(next(self._seq), size, source, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._grant()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted just as it was cancelled
                self.give(waiter.granted.result())
            else:
                self._waiters.remove(waiter)
                self._grant()
            raise
        return waiter.granted.result()

    def give(self, held: Held) -> None:
        """Return bytes taken before."""
        if held.reserved:
            del self._reserved[held.source]
        else:
            self._in_capacity -= held.size
            self._by_source[held.source] -= held.size
            if not self._by_source[held.source]:
                del self._by_source[held.source]
        self._change(-held.size)
        self._grant()

    def _grant(self) -> None:
        """Grant the waiting frames that may go now: of the capacity, then small ones of the reserve."""
        self._grant_capacity()
        for waiter in [w for w in self._waiters if w.size <= SMALL_FRAME]:
            if waiter.source not in self._reserved and sum(self._reserved.values()) + waiter.size <= RESERVE:
                self._waiters.remove(waiter)
                self._reserved[waiter.source] = waiter.size
                self._change(waiter.size)
                waiter.granted.set_result(Held(waiter.size, waiter.source, reserved=True))

    def _grant_capacity(self) -> None:
        """Grant the frames that fit the capacity and their source's share: least held by their source first."""
        while self._waiters:
            sources = set(self._by_source) | {w.source for w in self._waiters}
            share = self.capacity // max(len(sources), 1)
            within = [w for w in self._waiters if not self._by_source[w.source] or
                      self._by_source[w.source] + w.size <= share]
            if not within:
                return
            first = min(within, key=lambda w: (self._by_source[w.source], w.seq))
            if self._in_capacity + first.size > self.capacity:
                return
            self._waiters.remove(first)
            self._in_capacity += first.size
            self._by_source[first.source] += first.size
            self._change(first.size)
            first.granted.set_result(Held(first.size, first.source, reserved=False))

    def _change(self, change: int) -> None:
        self.held += change
        if self._on_change is not None:
            self._on_change(self.held)
