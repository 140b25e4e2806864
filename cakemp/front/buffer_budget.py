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
* a small frame (at most SMALL_FRAME: a Hello, a decode step) that finds no room passes from a
  reserve beside `capacity`, which has one place per source: each source holds at most one small
  frame of it at a time, and no source's frame waits for another's place. So a peer's Hello and
  decode steps pass however many other sources stall, each holding its share and its place. A
  pool of places that a few sources could fill would not do that: sixty-four stalled addresses,
  each holding one place, locked out every later master. The places are `reserve_sources` at
  most, which the node sets to the connections it admits (--max-connections, and the handshake
  places of connections not yet a master's), so the reserve never binds before admission does;
  each place costs no more than the 64 KiB a connection's reader already buffers unread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass

from cakemp.sources import source_of

SMALL_FRAME = 64 << 10


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
    def __init__(self, capacity: int, reserve_sources: int):
        """`reserve_sources`: how many sources may hold a small frame of the reserve at once (at most
        `reserve_sources * SMALL_FRAME` bytes beside `capacity`)."""
        self.capacity = capacity
        self.reserve_sources = reserve_sources
        self.held = 0  # bytes held, the reserve's included (the front's gauge reads it when scraped)
        self._in_capacity = 0  # bytes held of `capacity` (the rest, of the reserve)
        self._by_source: Counter[str] = Counter()  # bytes of `capacity` each source holds
        self._reserved: dict[str, int] = {}  # source -> the size of the small frame it holds of the reserve
        self._waiters: list[_Waiter] = []  # arrival order
        self._seq = itertools.count()

    def take_now(self, size: int, host: str) -> Held | None:
        """Hold `size` bytes (at most `capacity`) for a frame from `host` if they are free now and no frame
        waits for its turn; else None (`take` waits). A frame mostly finds room: no coroutine for it."""
        if size > self.capacity:
            raise ValueError(f"{size} bytes is more than the whole budget of {self.capacity}")
        source = source_of(host)
        # What _grant would do for this frame alone: the sources are those holding bytes, and this one.
        sources = len(self._by_source) + (source not in self._by_source)
        if not self._waiters and self._within_share(size, source, sources) and self._in_capacity + size <= self.capacity:
            self._hold(size, source)
            return Held(size, source, reserved=False)
        return None

    async def take(self, size: int, host: str) -> Held:
        """Hold `size` bytes (at most `capacity`) for a frame from `host`, waiting until they are free; returns
        at once when they are."""
        if (held := self.take_now(size, host)) is not None:
            return held
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
        self.held -= held.size
        if self._waiters:
            self._grant()

    def _grant(self) -> None:
        """Grant the waiting frames that may go now: of the capacity, then small ones of the reserve,
        the first waiting of each source that holds no place."""
        self._grant_capacity()
        for waiter in [w for w in self._waiters if w.size <= SMALL_FRAME and not w.granted.cancelled()]:
            if waiter.source not in self._reserved and len(self._reserved) < self.reserve_sources:
                self._waiters.remove(waiter)
                self._reserved[waiter.source] = waiter.size
                self.held += waiter.size
                waiter.granted.set_result(Held(waiter.size, waiter.source, reserved=True))

    def _grant_capacity(self) -> None:
        """Grant the frames that fit the capacity and their source's share: least held by their source first."""
        while True:
            # A waiter cancelled (its connection closed) leaves the list only once its task runs; several
            # cancelled at once must not be granted by one another's leaving meanwhile.
            waiting = [w for w in self._waiters if not w.granted.cancelled()]
            sources = len(set(self._by_source) | {w.source for w in waiting})
            within = [w for w in waiting if self._within_share(w.size, w.source, sources)]
            if not within:
                return
            first = min(within, key=lambda w: (self._by_source[w.source], w.seq))
            if self._in_capacity + first.size > self.capacity:
                return
            self._waiters.remove(first)
            self._hold(first.size, first.source)
            first.granted.set_result(Held(first.size, first.source, reserved=False))

    def _within_share(self, size: int, source: str, sources: int) -> bool:
        """Whether a frame of `size` keeps `source` within its share of the capacity among `sources`
        (a source holding nothing may always take one frame)."""
        held = self._by_source.get(source, 0)
        return not held or held + size <= self.capacity // sources

    def _hold(self, size: int, source: str) -> None:
        self._in_capacity += size
        self._by_source[source] += size
        self.held += size
