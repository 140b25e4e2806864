"""What a peer that is not a real client can hold of `cakemp serve`: a few connections, for a few seconds.

An HTTP API has no handshake to tell a client from a flood: until a connection's request (its
head and its body) has arrived, it is an *incomplete* connection. uvicorn holds such a connection
for as long as the peer likes (its keep-alive timer starts only after a response, and any byte
received stops it), so a flood of idle or slow-header connections would hold the process's file
descriptors. Here each incomplete connection gets `deadline_s` to complete its request, from the
moment it connected or its previous answer ended (bytes trickling in do not extend it), and at most
`most` of them are held, at most PER_SOURCE of one source address (per IPv6 /64), as the node's
handshake places are (sources.py, the one implementation of both): past a cap a newcomer closes
the oldest connection that has never sent a byte and is past a short grace, from its own source if
that is at its cap, else from the source holding the most; with none, the newcomer is closed. A
real client sends its request as soon as it connects, so it is not closed for a flood's sake, and
a connection kept alive between requests gives its place only to a newcomer from its own source
(a client whose pool keeps more than PER_SOURCE connections closes its own idle ones, as a
keep-alive timeout would, and is answered); a flood from one address holds PER_SOURCE places and
closes its own connections.

The other side of the same rule: a client that stops reading its answer (uvicorn pauses writing
once 64 KiB wait in its buffer, past the kernel's) is aborted once writing has stayed paused for
`deadline_s`; its request then sees the client gone (a generation halts).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cakemp.sources import GRACE_S, PER_SOURCE, Places

MOST_INCOMPLETE = 64
DEADLINE_S = 10.0
COMPLETE = (h11.DONE, h11.MUST_CLOSE)  # the peer's side of a request, once its whole body has arrived


class IncompleteConnections:
    """The connections whose request has not arrived whole, each with its deadline and place."""

    def __init__(self, most: int = MOST_INCOMPLETE, deadline_s: float = DEADLINE_S, per_source: int = PER_SOURCE,
                 grace_s: float = GRACE_S) -> None:
        self.most, self.deadline_s = most, deadline_s
        self._places: Places[GuardedH11Protocol] = Places(most, lambda connection: connection.close(), per_source,
                                                          grace_s)
        self._deadlines: dict[GuardedH11Protocol, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def incomplete(self, connection: GuardedH11Protocol) -> None:
        """`connection` waits for a request; its deadline runs from its first call, not its latest. Closed at
        once when no place can be made for it."""
        if connection in self._deadlines:
            return
        if not self._places.enter(connection, connection.client_host, resting=connection.served):
            connection.transport.close()
            return
        if connection.sent:  # a connection that has its request's first bytes is never displaced
            self._places.progressed(connection)
        self._deadlines[connection] = asyncio.get_running_loop().call_later(self.deadline_s, connection.close)

    def received(self, connection: GuardedH11Protocol) -> None:
        """`connection` sent its request's first bytes: it keeps its place until the request is whole or its
        deadline passes."""
        self._places.progressed(connection)

    def forget(self, connection: GuardedH11Protocol) -> None:
        """`connection`'s request arrived whole, or it closed."""
        self._places.leave(connection)
        if (deadline := self._deadlines.pop(connection, None)) is not None:
            deadline.cancel()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, each connection counted among `guard`'s until its request has arrived whole."""

    def __init__(self, *args, guard: IncompleteConnections, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.sent = False  # whether the peer has sent a byte of the request it is on
        self.served = False  # whether it has carried a whole request and its answer (kept alive since)
        self._stalled: asyncio.TimerHandle | None = None  # while writing is paused: the abort

    @property
    def client_host(self) -> str:
        peer = self.transport.get_extra_info("peername")
        return peer[0] if peer else "?"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        if not self.sent:
            self.sent = True
            self.guard.received(self)
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        self.served, self.sent = True, False  # resting until the next request's first byte
        super().on_response_complete()  # this may start the next request, pipelined
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self._resumed()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.guard.deadline_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._resumed()

    def _resumed(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def close(self) -> None:
        """Closes the connection (its deadline passed, or it was displaced to make room)."""
        self.guard.forget(self)
        self.transport.close()

    def _track(self) -> None:
        if self.transport.is_closing() or self.conn.their_state in COMPLETE:
            self.guard.forget(self)
        else:
            self.guard.incomplete(self)
