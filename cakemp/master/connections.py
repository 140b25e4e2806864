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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from cakemp import log
from cakemp.errors import CakempError
from cakemp.master.address import dial
from cakemp.master.client import WorkerClient
from cakemp.wire import Revision

# What a fresh set's key is: no request ran on it, any request may take it.
FRESH = ("fresh",)
# The key a set gets from a request that named none: no later request matches it.
NOBODY = ("nobody",)


@dataclass(frozen=True)
class Dialer:
    """How the master reaches its workers: the cluster's key, the protocol revision, the connect timeout."""

    cluster_key: str | None = None
    revision: Revision = Revision.V2
    timeout: float = 10.0

    async def connect(self, hosts: Sequence[tuple[int, str]]) -> dict[int, WorkerClient]:
        """A connection per remote layer (`hosts`: (block index, host) in layer order), each said Hello, one
        after another as Cake connects; none is left open when one fails."""
        clients: dict[int, WorkerClient] = {}
        try:
            for index, host in hosts:
                clients[index] = await dial(host, cluster_key=self.cluster_key, revision=self.revision,
                                            timeout=self.timeout)
                await clients[index].hello()
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
        self._taken = 0  # sets held by requests (or saying Goodbye)
        self._sessions = itertools.count()

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

    async def take(self, key: tuple[str, ...] | None) -> ConnectionSet:
        """A set for a request of isolation `key` (None: it named none): an idle one that last served
        `key`, else a fresh one, else the least recently used, closed and dialed afresh."""
        self._taken += 1
        try:
            chosen = next((s for s in reversed(self._idle) if key is not None and s.key == key), None) or \
                next((s for s in self._idle if s.key == FRESH), None)
            if chosen is not None:
                self._idle.remove(chosen)
            elif len(self._idle) + self._taken > self.size:  # no room to dial: recycle one
                stale = self._idle.pop(0)
                await stale.close()
                chosen = await self._dial()
            else:
                chosen = await self._dial()
        except BaseException:
            self._taken -= 1
            raise
        chosen.key = NOBODY if key is None else key
        return chosen

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
        idle, self._idle = self._idle, []
        for connections in idle:
            await connections.close()

    async def _dial(self) -> ConnectionSet:
        try:
            connections = ConnectionSet(await self.dialer.connect(self.hosts), next(self._sessions))
        except (CakempError, OSError):
            self.broken = True  # no set could be dialed: the next request tries again
            raise
        self.broken = False
        return connections
