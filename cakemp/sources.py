"""Where a connection comes from, as per-source limits count it, and the few places that
connections which have not yet shown they are real may hold, shared among their sources.

One source is one IPv4 address, or one IPv6 /64 (a host is usually given a whole /64, so counting
single IPv6 addresses would count nothing); an IPv4 address mapped into IPv6 is that IPv4 address.
The node's TCP port (front/handshakes.py: the key handshake, a keyless node's Hello;
front/buffer_budget.py: the frames' bytes) and `cakemp serve`'s connection guard
(master/connection_guard.py) count by it alike.

`Places` holds at most `most` entries, at most `per_source` of one source. A newcomer past either
cap takes the place of an entry that has shown nothing yet (`progressed` was not called for it)
and is older than `grace_s`: from its own source when that source is at its cap, else from the
source holding the most places, its oldest. With no such entry the newcomer is refused. So a
flood from one address holds `per_source` places and the others stay free for other sources; a
connection whose handshake is progressing is never displaced by one that has sent nothing, and
none is displaced before it had `grace_s` to show itself. An entry that is `resting` (an HTTP
connection kept alive between the requests it carried: real, but doing nothing) yields its place
to a newcomer of its own source only, at once, so a client with more connections than its share
(a pool, a proxy) closes its own idle ones, and a flood's newcomers never another client's.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

PER_SOURCE = 8
GRACE_S = 0.5

Item = TypeVar("Item", bound=Hashable)


@functools.lru_cache(maxsize=4096)  # asked on every frame; bounded, so a spray of addresses only evicts
def source_of(host: str) -> str:
    """The source `host` (a peer address as the socket gives it) is counted under."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) names no other host
    except ValueError:
        return host  # not an IP address (a Unix socket's peer): counted as it is named
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


# A session's id (the front numbers each connection) holds its source in its top bits, so that a device,
# which never sees an address, can share its KV budget out by source (compute/fair_share.py).
_SERIAL_BITS = 32


def session_id(source: str, serial: int) -> int:
    """The id of the `serial`-th connection, from `source` (`source_of`): a hash of the source above the serial
    (BLAKE2b, not a CRC, whose linearity would let a peer pick among its addresses one that passes for another's)."""
    digest = hashlib.blake2b(source.encode(), digest_size=_SERIAL_BITS // 8).digest()
    return int.from_bytes(digest, "big") << _SERIAL_BITS | serial & (1 << _SERIAL_BITS) - 1


def session_source(session: int) -> int:
    """The source a session id carries (`session_id`; 0 for an id of fewer bits, as a test's)."""
    return session >> _SERIAL_BITS


@dataclass
class _Entry:
    source: str
    since: float  # when it entered (the clock's seconds)
    resting: bool  # displaced by its own source's newcomers only
    progressed: bool = False


class Places(Generic[Item]):
    """At most `most` items, at most `per_source` of one source; `displace` closes an item made to leave."""

    def __init__(self, most: int, displace: Callable[[Item], None], per_source: int = PER_SOURCE,
                 grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.most, self.per_source = most, per_source
        self._displace, self._grace_s, self._clock = displace, grace_s, clock
        self._entries: dict[Item, _Entry] = {}  # insertion order: oldest first
        self._held: Counter[str] = Counter()  # source -> entries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: object) -> bool:
        return item in self._entries

    def enter(self, item: Item, host: str, resting: bool = False) -> bool:
        """Give `item`, from `host`, a place, displacing another if a cap is reached; False: refused, none was free.
        A `resting` item yields its place to its own source's newcomers only."""
        source = source_of(host)
        if self._held[source] >= self.per_source:
            crowded, own = [other for other, entry in self._entries.items() if entry.source == source], True
        elif len(self._entries) >= self.most:
            crowded, own = list(self._entries), False
        else:
            crowded = None
        if crowded is not None:
            victim = self._displaceable(crowded, own)
            if victim is None:
                return False
            self.leave(victim)
            self._displace(victim)
        self._entries[item] = _Entry(source, self._clock(), resting)
        self._held[source] += 1
        return True

    def progressed(self, item: Item) -> None:
        """`item` has shown it is real (sent its first bytes): it is never displaced from now on."""
        if (entry := self._entries.get(item)) is not None:
            entry.progressed = True

    def leave(self, item: Item) -> None:
        """`item` no longer holds a place (done, closed, or displaced); no change if it held none."""
        entry = self._entries.pop(item, None)
        if entry is not None:
            self._held[entry.source] -= 1
            if not self._held[entry.source]:
                del self._held[entry.source]

    def _displaceable(self, items: list[Item], own_source: bool) -> Item | None:
        """Of `items` (oldest first), the oldest of the source holding the most places among those that
        have shown nothing and are past their grace, or rest (for a newcomer of their `own_source`); None
        if none is."""
        settled = self._clock() - self._grace_s

        def open_to_newcomer(entry: _Entry) -> bool:
            if entry.progressed:
                return False
            if entry.resting:  # it has had its turn: no grace, and only its own source's newcomer may take it
                return own_source
            return entry.since <= settled

        idle = [item for item in items if open_to_newcomer(self._entries[item])]
        return max(idle, key=lambda item: self._held[self._entries[item].source], default=None)
