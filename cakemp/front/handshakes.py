"""Connections that are not a master's yet: a few places of their own, shared among their sources.

A connection counts as a master's (toward --max-connections, or as a setup connection) only once
it has shown it is one: by proving the cluster key, on a node that has one, or else by its Hello.
Until then it holds one of `places` (MAX_HANDSHAKES), at most PER_SOURCE of them per source
address (per IPv6 /64), and never past its deadline: HANDSHAKE_TIMEOUT_S for the key handshake,
--frame-timeout for a keyless node's Hello. Connections that never show themselves cannot take
the masters' slots or the process's file descriptors, in serving and in setup mode alike.

Past a cap a newcomer displaces the oldest connection that has sent nothing for longer than a
grace period, from its own source if that is at its cap, else from the source holding the most
places; a connection that has sent its first bytes (a master's nonce, a Hello's header) is never
displaced, and with none to displace the newcomer is closed at once (sources.py). A connect
flood from one address therefore holds at most PER_SOURCE places and displaces only its own;
masters from elsewhere find the other places free. Floods from many addresses at once need a
firewall in front of the port (SYN cookies, rate limits). Nothing a connection does here touches
an authenticated one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cakemp.auth import authenticate_master
from cakemp.errors import AuthError
from cakemp.front.metrics import Metrics
from cakemp.sources import PER_SOURCE, Places

MAX_HANDSHAKES = 64
HANDSHAKE_TIMEOUT_S = 10.0


class Handshakes:
    def __init__(self, metrics: Metrics, places: int = MAX_HANDSHAKES, timeout: float = HANDSHAKE_TIMEOUT_S):
        self._metrics, self._timeout = metrics, timeout
        self._places: Places[asyncio.StreamWriter] = Places(places, self._displace)
        self._loggers: dict[asyncio.StreamWriter, object] = {}  # the connections in a place -> their loggers
        self._displaced: set[asyncio.StreamWriter] = set()  # displaced, their own end not seen yet

    def enter(self, writer: asyncio.StreamWriter, logger) -> bool:
        """Give the new connection `writer` a place; False when none could be made (logged; the caller closes it)."""
        peer = writer.get_extra_info("peername")
        if not self._places.enter(writer, peer[0] if peer else "?"):
            self._metrics.refused_connections.inc(reason="handshake-places")
            logger.warning("refusing a connection: no handshake place free", fault="peer",
                           error=f"all {self._places.most} places, or the {PER_SOURCE} of its source, are held by "
                                 "connections that are progressing or within their grace")
            return False
        self._loggers[writer] = logger
        self._metrics.handshakes.set(len(self._places))
        return True

    def progressed(self, writer: asyncio.StreamWriter) -> None:
        """`writer`'s peer sent its first bytes: it keeps its place until it is done or its deadline passes."""
        self._places.progressed(writer)

    def leave(self, writer: asyncio.StreamWriter) -> bool:
        """`writer` is done with its place (shown to be a master's, or closed); False if it was displaced meanwhile."""
        self._places.leave(writer)
        self._loggers.pop(writer, None)
        self._metrics.handshakes.set(len(self._places))
        if writer in self._displaced:
            self._displaced.discard(writer)
            return False
        return True

    async def authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str,
                           logger) -> bool:
        """Run the key handshake on a new connection: True once the master proved the key; False when
        no place was free, or it failed, ran out of time or was displaced (logged; the caller closes it)."""
        if not self.enter(writer, logger):
            return False
        try:
            await authenticate_master(reader, writer, key, self._timeout, lambda: self.progressed(writer))
        except AuthError as e:
            if self.leave(writer):  # a displaced one was logged as such
                logger.warning("authentication failed", error=str(e), fault="peer")
            return False
        return self.leave(writer)

    def _displace(self, writer: asyncio.StreamWriter) -> None:
        """Close a connection that has sent nothing, to make room (its handshake or Hello then fails at once)."""
        self._displaced.add(writer)
        self._metrics.handshakes_displaced.inc()
        self._metrics.handshakes.set(len(self._places))
        self._loggers.pop(writer).warning(
            "closing connection", fault="peer",
            error="sent nothing while all its places were taken: displaced by a newer connection")
        writer.transport.abort()


class HelloPlace:
    """A keyless node's new connection: it holds a place of `handshakes` until its Hello, and only then
    asks `admit` (the --max-connections check, which logs a refusal) to count it as a master's."""

    def __init__(self, handshakes: Handshakes, writer: asyncio.StreamWriter, admit: Callable[[], bool]):
        self._handshakes, self._writer, self._admit = handshakes, writer, admit

    def progressed(self) -> None:
        """A frame's header came: the connection is on its way to Hello."""
        self._handshakes.progressed(self._writer)

    def greeted(self) -> bool:
        """Its Hello came: True when it now counts as a master's; False when it was displaced or the node is full."""
        return self._handshakes.leave(self._writer) and self._admit()

    def closed(self) -> None:
        """It ended before its Hello: the place is free again."""
        self._handshakes.leave(self._writer)
