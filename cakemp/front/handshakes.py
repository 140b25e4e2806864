"""The connections still in the cluster-key handshake: a few places of their own, for a short time.

A connection counts as a master's (toward --max-connections, or as a setup connection) only
once it has proved the key. Until then it holds one of `places` (MAX_HANDSHAKES) for at most
`timeout` seconds (HANDSHAKE_TIMEOUT_S), so connections that never authenticate cannot take
the masters' slots or the process's file descriptors, in serving and in setup mode alike.

When every place is taken, a newcomer takes the place of the connection that has been in the
handshake longest, and that one is closed. A master answers the handshake within one round
trip, so connects that never answer, however many, cannot keep it out unless they arrive at
`places` per round trip; nothing a connection does in the handshake touches an authenticated one.
"""

from __future__ import annotations

import asyncio

from cakemp.auth import authenticate_master
from cakemp.errors import AuthError
from cakemp.front.metrics import Metrics

MAX_HANDSHAKES = 64
HANDSHAKE_TIMEOUT_S = 10.0


class Handshakes:
    def __init__(self, key: str, metrics: Metrics, places: int = MAX_HANDSHAKES,
                 timeout: float = HANDSHAKE_TIMEOUT_S):
        self._key, self._metrics = key, metrics
        self._places, self._timeout = places, timeout
        # Connections in the handshake, oldest first -> their logger; a displaced one leaves at once.
        self._open: dict[asyncio.StreamWriter, object] = {}
        self._displaced: set[asyncio.StreamWriter] = set()

    async def authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, logger) -> bool:
        """Run the handshake on a new connection: True once the master proved the key; False when it
        failed, ran out of time or was displaced by a newer connection (logged; the caller closes it)."""
        if len(self._open) >= self._places:
            self._displace(next(iter(self._open)))
        self._open[writer] = logger
        self._metrics.handshakes.set(len(self._open))
        try:
            await authenticate_master(reader, writer, self._key, self._timeout)
            return True
        except AuthError as e:
            if writer not in self._displaced:  # a displaced one was logged as such
                logger.warning("authentication failed", error=str(e), fault="peer")
            return False
        finally:
            self._open.pop(writer, None)
            self._displaced.discard(writer)
            self._metrics.handshakes.set(len(self._open))

    def _displace(self, writer: asyncio.StreamWriter) -> None:
        """Close the connection in the handshake longest, to make room (its handshake then fails at once)."""
        logger = self._open.pop(writer)
        self._displaced.add(writer)
        self._metrics.handshakes_displaced.inc()
        logger.warning("closing connection", error=f"still in the cluster-key handshake when all {self._places} "
                       "places were taken: displaced by a newer connection", fault="peer")
        writer.transport.abort()
