"""How a device's KV budget is shared out once it is full: evenly among the sources holding it.

Until the budget is full a session takes the room it asks for, first come, first served. A session
that asks for room neither the budget left nor prefix reuse's kept rows (given up first: they are
nobody's) can give, while its source holds less than its share (the budget over the sources holding
KV, its own counted; a block several of a source's sessions share counted once), is given it by the
sources past their share, the furthest first: their sessions are given up, least recently asked
first, until the room is there. So however much of the budget one source took while the others were
away, each source that comes can have its share, and no source loses its sessions while it holds no
more than its share. A source is a master's address (an IPv4 address, an IPv6 /64), carried in the top
bits of the session ids the front gives (sources.session_id).

A session of the step being planned keeps its slots for the step (they are reserved): where the
sessions past their share are all in it (a master sending a row for each of its sessions at every
step), the asking request is refused, and the least recently asked of each such source is given up
once the step is computed, so that the room is there at the next ask. A session given up is told so
at each request (CacheBudgetExceeded) until it starts again at position 0 or says Goodbye.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Set

from cakemp.compute.kv_cache import KVCache
from cakemp.errors import CacheBudgetExceeded
from cakemp.sources import session_source

GIVEN_UP = ("this session's KV cache was given up to make room for a session of another master: a device's "
            "budget is shared out evenly among the masters' addresses once it is full; start again at position 0")


class FairShare:
    """The sessions of one device's KV cache, by source, and when each last asked for a step."""

    def __init__(self, cache: KVCache, give_up: Callable[[int], None]):
        """`give_up(session)`: free everything of the session (the runner's own state of it too)."""
        self._cache, self._give_up = cache, give_up
        self._clock = itertools.count()
        self._asked: dict[int, int] = {}  # session -> the clock at its last request
        self._given_up: set[int] = set()
        self._owed: set[int] = set()  # sessions of the step to give up once it is computed
        self._stepping: Set[int] = frozenset()  # the sessions of the step under way
        cache.reclaim = self.reclaim

    @contextlib.contextmanager
    def step(self, sessions: Iterable[int]) -> Iterator[None]:
        """A step of `sessions` planned and computed: none of them is given up meanwhile (their slots are
        reserved for it); once it is computed, the sessions of it owed to a source under its share are."""
        self._stepping = set(sessions)
        try:
            yield
        finally:
            self._stepping = frozenset()
            owed, self._owed = self._owed, set()
            for session in owed:
                if session in self._cache.sessions():
                    self._give_up_one(session)

    def asked(self, session: int, position: int | None) -> None:
        """A request of `session` at `position` (None: its ops at several) is being planned.
        CacheBudgetExceeded where the session was given up and does not start again at 0."""
        self._asked[session] = next(self._clock)
        if self._given_up and session in self._given_up:
            if position != 0:
                raise CacheBudgetExceeded(GIVEN_UP)
            self._given_up.discard(session)

    def forget(self, session: int) -> None:
        """The session starts afresh, or is gone."""
        self._asked.pop(session, None)
        self._given_up.discard(session)

    def reclaim(self, session: int, nbytes: int) -> None:
        """Make room for `nbytes` more for `session` (the budget and the kept rows have none), as far as
        its source's share allows, by giving up sessions of the sources past their own."""
        cache, mine = self._cache, session_source(session)
        while cache.room() < nbytes:
            by_source: dict[int, list[int]] = defaultdict(list)
            for other in cache.sessions():
                by_source[session_source(other)].append(other)
            held = {source: cache.held_by(sessions) for source, sessions in by_source.items()}
            share = cache.budget_bytes / len(held.keys() | {mine})
            if held.get(mine, 0) + nbytes > share:
                return
            over = sorted((source for source in held if source != mine and held[source] > share),
                          key=held.__getitem__, reverse=True)
            victim = None
            for source in over:
                free = [other for other in by_source[source] if other not in self._stepping]
                if free:
                    victim = min(free, key=self._last_asked)
                    break
                self._owed.add(min(by_source[source], key=self._last_asked))
            if victim is None:
                return
            self._give_up_one(victim)
            if cache.spare is not None:  # what the victim's rows left kept for reuse, if anything
                cache.spare.release(nbytes)

    def _last_asked(self, session: int) -> int:
        return self._asked.get(session, -1)

    def _give_up_one(self, session: int) -> None:
        self._give_up(session)
        self._given_up.add(session)
