"""How a device's KV budget is shared out once it is full: evenly among the sources holding it.

Until the budget is full a session takes the room it asks for, first come, first served. A session
that asks for room neither the budget left nor prefix reuse's kept rows (given up first: they are
nobody's) can give, while its source holds less than its share (the budget over the sources holding
KV, its own counted), is given it by the source holding the most past its share: that source's
sessions are given up, least recently asked first, until the room is there. So however much of the
budget one source took while the others were away, each source that comes can have its share, and
no source loses its sessions while it holds no more than its share. A source is a master's address
(an IPv4 address, an IPv6 /64), carried in the top bits of the session ids the front gives
(sources.session_id). A session of the step being planned is never given up (its slots are
reserved for the step); a session given up is told so at each request (CacheBudgetExceeded) until
it starts again at position 0 or says Goodbye.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Set

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
        self.stepping: Set[int] = frozenset()  # the sessions of the step being planned: never given up
        cache.reclaim = self.reclaim

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
        its source's share allows, by giving up sessions of the source most past its own."""
        cache, mine = self._cache, session_source(session)
        while cache.room() < nbytes:
            held: Counter[int] = Counter()
            for other in cache.sessions():
                held[session_source(other)] += cache.session_bytes(other)
            share = cache.budget_bytes / len(held.keys() | {mine})
            over = [source for source, nbytes_held in held.items() if source != mine and nbytes_held > share]
            if held[mine] + nbytes > share or not over:
                return
            source = max(over, key=held.__getitem__)
            victims = [other for other in cache.sessions()
                       if session_source(other) == source and other not in self.stepping]
            if not victims:
                return
            victim = min(victims, key=lambda other: self._asked.get(other, -1))
            self._give_up(victim)
            self._given_up.add(victim)
            if cache.spare is not None:  # what the victim's rows left kept for reuse, if anything
                cache.spare.release(nbytes)
