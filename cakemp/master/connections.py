"""The master's connections to its workers: one set per concurrent request, kept open in a pool.

Cake ties a session's KV cache to a connection, so each request that runs at once holds its own
`ConnectionSet`: a connection per remote layer (as Cake opens one per remote layer, each said
Hello), and a session id for the layers this master runs itself. Between requests a set says
Goodbye on each connection and goes back to the pool, open.

Prefix reuse on a worker is scoped by connection (compute/prefix_cache.py: a retired prefix is
adopted only by the session it came from, unless the worker runs `--share-prefixes`; a closed
connection's retired prefixes are dropped). So a set carries the isolation key of its last request:
a request reuses only a set whose last request had its key, and a set that last served another key,
or a request that named none, is closed and dialed afresh before it serves again: its worker
sessions, and what they kept, are gone.

When a request's key matches no idle set and the pool has no room for one more, an idle set is
closed for it: one whose key has not come back (it served a single request of its key), least
recently used first, and only when every idle set's key has come back the least recently used of
them. So a stream of one-shot keys (a new `user` on every request) closes its own kind's sets and
leaves a returning user its set and its prefixes. A key whose set was closed for another's and that
comes back (remembered, by hash, among the last GONE_KEYS closed) counts as returning from its
new set's first request. Requests naming no key never match: each takes a fresh set or closes
another and dials afresh, so they never reuse a prefix (`--share-prefixes-across-clients` gives
them one shared key instead).

A set to dial is dialed in the background (`take` hands out a future), never in the step that
runs the other requests: a dial opens a connection, runs the cluster-key handshake and says Hello,
one remote layer after another, each bounded by the connect timeout, and a distant or busy worker
takes long at each. At most `DIALS_AT_ONCE` sets are dialed at a time, so that the master itself
never holds more of a node's handshake places (sources.PER_SOURCE per source address) than a few.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cakemp import log
from cakemp.errors import CakempError, ProtocolError, WorkerUnreachable
from cakemp.master.address import dial
from cakemp.master.client import NO_KEY_HINT, WorkerClient
from cakemp.wire import Revision

# What a fresh set's key is: no request ran on it, any request may take it.
FRESH = ("fresh",)
# The key a set gets from a request that named none: no later request matches it.
NOBODY = ("nobody",)
# Sets dialed at once at most. Each dial has one connection in its handshake at a time, so the master
# holds at most this many of a node's handshake places, well under the 8 a node keeps per address.
DIALS_AT_ONCE = 4
# Keys (their hashes) whose sets were closed for another key's, remembered so that one coming back
# counts as returning: a bound on the pool's memory, far past the sets a pool holds.
GONE_KEYS = 4096


@dataclass(frozen=True)
class Dialer:
    """How the master reaches its workers: the cluster's key, the protocol revision, the connect timeout."""

    cluster_key: str | None = None
    revision: Revision = Revision.V2
    timeout: float = 10.0

    async def connect(self, hosts: Sequence[tuple[int, str]]) -> dict[int, WorkerClient]:
        """A connection per remote layer (`hosts`: (block index, host) in layer order), each said Hello, one
        after another as Cake connects; none is left open when one fails or the dial is cancelled."""
        clients: dict[int, WorkerClient] = {}
        try:
            for index, host in hosts:
                clients[index] = await dial(host, cluster_key=self.cluster_key, revision=self.revision,
                                            timeout=self.timeout)
                hint = "" if self.cluster_key else NO_KEY_HINT
                try:
                    await asyncio.wait_for(clients[index].hello(), self.timeout)
                except TimeoutError:  # a worker that never answers would hold a dial's place for ever
                    raise WorkerUnreachable(f"{host} did not answer Hello within {self.timeout:g} s{hint}") from None
                except ProtocolError as exc:  # a keyed node closes a handshake that never comes after its own timeout
                    raise ProtocolError(f"{exc}{hint}") from None
        except BaseException:
            for client in clients.values():
                await client.close()
            raise
        return clients


class ConnectionSet:
    """One request's connections: block index → its connection; `session`: its local layers' KV session."""

    def __init__(self, clients: dict[int, WorkerClient], session: int) -> None:
        self.clients = clients
        self.session = session
        self.key: tuple[str, ...] = FRESH  # the isolation key of the last request it served
        self.returned = False  # whether its key came back: it served a second request of it, or was closed before

    async def goodbye(self) -> None:
        """End the request as Cake does: Goodbye on every remote layer's connection, in layer order."""
        for index in sorted(self.clients):
            await self.clients[index].goodbye()

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


class ConnectionPool:
    """At most `size` connection sets, open between requests; each taken by one request at a time."""

    def __init__(self, dialer: Dialer, hosts: Sequence[tuple[int, str]], size: int) -> None:
        self.dialer = dialer
        self.hosts = tuple(hosts)
        self.size = size
        self.broken = False  # a set was dropped for a broken connection, or failed to dial, and none dialed since
        self._idle: list[ConnectionSet] = []  # least recently used first
        self._taken = 0  # sets held by requests (being dialed for them, or saying Goodbye)
        self._sessions = itertools.count()
        self._dials = asyncio.Semaphore(DIALS_AT_ONCE)
        self._dialing: set[asyncio.Task] = set()  # dials in flight
        self._gone: OrderedDict[int, None] = OrderedDict()  # hashes of keys whose sets were closed for others

    async def open(self) -> None:
        """Dial every set now: the first failure of the first set is raised; a later one means the
        workers admit no more sessions (their --max-connections), and the pool keeps what it got."""
        for count in range(self.size):
            try:
                self._idle.append(await self._dial())
            except (CakempError, OSError) as exc:
                if count == 0:
                    raise
                log.get_logger().warning("the workers admit fewer concurrent sessions", asked=self.size,
                                         admitted=count, error=str(exc))
                self.size = count
                return

    @property
    def free(self) -> bool:
        """Whether a request can take a set now (an open one, or room to dial one)."""
        return self._taken < self.size

    def take(self, key: tuple[str, ...] | None) -> asyncio.Future[ConnectionSet]:
        """A set for a request of isolation `key` (None: it named none), while `free`, as a future: an idle
        set that last served `key`, else a fresh one, at once (the future is done); else a set dialed in the
        background, in place of the least recently used idle set when there is no room for one more (that
        one closed first). The request may cancel the future while it dials: the set, once dialed, stays
        idle and fresh for the next."""
        self._taken += 1
        ready = asyncio.get_running_loop().create_future()
        chosen = next((s for s in reversed(self._idle) if key is not None and s.key == key), None) or \
            next((s for s in self._idle if s.key == FRESH), None)
        if chosen is None:
            stale = self._stale() if len(self._idle) + self._taken > self.size else None
            dialing = asyncio.create_task(self._dial_for(ready, key, stale))
            self._dialing.add(dialing)
            dialing.add_done_callback(self._dialing.discard)
            return ready
        self._idle.remove(chosen)
        chosen.returned = chosen.key == key or self._came_back(key)
        chosen.key = NOBODY if key is None else key
        ready.set_result(chosen)
        return ready

    def _stale(self) -> ConnectionSet:
        """The idle set to close for another key's: the least recently used whose key has not come back,
        else the least recently used; its key remembered as gone."""
        stale = next((s for s in self._idle if not s.returned), self._idle[0])
        self._idle.remove(stale)
        if stale.key not in (FRESH, NOBODY):
            self._gone[hash(stale.key)] = None
            self._gone.move_to_end(hash(stale.key))
            if len(self._gone) > GONE_KEYS:
                self._gone.popitem(last=False)
        return stale

    def _came_back(self, key: tuple[str, ...] | None) -> bool:
        """Whether `key`'s set was closed for another's before: it is a returning key."""
        if key is None or hash(key) not in self._gone:
            return False
        del self._gone[hash(key)]
        return True

    async def give_back(self, connections: ConnectionSet, broken: bool) -> None:
        """A request's set, once it ended: said Goodbye and kept, or closed when its connection broke
        (or Goodbye failed)."""
        try:
            if not broken:
                try:
                    await connections.goodbye()
                except (CakempError, OSError):
                    broken = True
            if broken:
                self.broken = True
                await connections.close()
            else:
                self._idle.append(connections)
        finally:
            self._taken -= 1

    async def close(self) -> None:
        """Close every idle set, once the dials in flight (those of requests that left included) have ended."""
        await asyncio.gather(*self._dialing, return_exceptions=True)
        idle, self._idle = self._idle, []
        for connections in idle:
            await connections.close()

    async def _dial_for(self, ready: asyncio.Future, key: tuple[str, ...] | None, stale: ConnectionSet | None) -> None:
        """Dial `ready`'s set, once `stale` (whose place it takes) is closed and a dial's place is free; a
        failed dial fails `ready` and frees its place, as does one whose request left (`ready` cancelled)."""
        try:
            if stale is not None:
                await stale.close()
            async with self._dials:
                connections = await self._dial()
        except Exception as exc:  # (CakempError, OSError), or a bug: the request fails with it, alone
            self._taken -= 1
            if not ready.cancelled():
                ready.set_exception(exc)
            return
        if ready.cancelled():
            self._taken -= 1
            self._idle.append(connections)  # fresh: no request ran on it
        else:
            connections.returned = self._came_back(key)
            connections.key = NOBODY if key is None else key
            ready.set_result(connections)

    async def _dial(self) -> ConnectionSet:
        try:
            connections = ConnectionSet(await self.dialer.connect(self.hosts), next(self._sessions))
        except (CakempError, OSError):
            self.broken = True  # no set could be dialed: the next request tries again
            raise
        self.broken = False
        return connections
