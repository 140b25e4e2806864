"""What a peer that is not a real client can hold of `cakemp serve`: a few connections, for a few seconds.

An HTTP API has no handshake to tell a client from a flood: until a connection's request (its
head and its body) has arrived, it is an *incomplete* connection. uvicorn holds such a connection
for as long as the peer likes (its keep-alive timer starts only after a response, and any byte
received stops it), so a flood of idle or slow-header connections would hold the process's file
descriptors. Here each incomplete connection gets `deadline_s` to complete its request, from the
moment it connected or its previous answer ended (bytes trickling in do not extend it), and at most
`most` of them are held: a new one past that closes the oldest that has never carried a request
(else the oldest). A real client sends its request as soon as it connects, so it is never the
oldest for long, and its kept-alive connection between requests is closed only once no fresh
connection is left to close; a flood of connections that never send a request closes its own.

The other side of the same rule: a client that stops reading its answer (uvicorn pauses writing
once 64 KiB wait in its buffer, past the kernel's) is aborted once writing has stayed paused for
`deadline_s`; its request then sees the client gone (a generation halts).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MOST_INCOMPLETE = 64
DEADLINE_S = 10.0
COMPLETE = (h11.DONE, h11.MUST_CLOSE)  # the peer's side of a request, once its whole body has arrived


class IncompleteConnections:
    """The connections whose request has not arrived whole, oldest first, each with its deadline."""

    def __init__(self, most: int = MOST_INCOMPLETE, deadline_s: float = DEADLINE_S) -> None:
        self.most, self.deadline_s = most, deadline_s
        self._deadlines: dict[GuardedH11Protocol, asyncio.TimerHandle] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._deadlines)

    def incomplete(self, connection: GuardedH11Protocol) -> None:
        """`connection` waits for a request; its deadline runs from its first call, not its latest."""
        if connection in self._deadlines:
            return
        self._deadlines[connection] = asyncio.get_running_loop().call_later(self.deadline_s, connection.close)
        while len(self._deadlines) > self.most:
            oldest = next(iter(self._deadlines))
            next((c for c in self._deadlines if not c.served), oldest).close()

    def forget(self, connection: GuardedH11Protocol) -> None:
        """`connection`'s request arrived whole, or it closed."""
        if (deadline := self._deadlines.pop(connection, None)) is not None:
            deadline.cancel()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, each connection counted among `guard`'s until its request has arrived whole."""

    def __init__(self, *args, guard: IncompleteConnections, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.served = False  # whether a request of this connection's was answered
        self._stalled: asyncio.TimerHandle | None = None  # while writing is paused: the abort

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        self.served = True
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
        """Closes the connection (its deadline passed, or it was the oldest incomplete one)."""
        self.guard.forget(self)
        self.transport.close()

    def _track(self) -> None:
        if self.transport.is_closing() or self.conn.their_state in COMPLETE:
            self.guard.forget(self)
        else:
            self.guard.incomplete(self)
