"""The node's TCP port: bound at once, accepting once started, and surviving a lack of descriptors.

asyncio's own server, out of file descriptors, logs the failed accept and tries again up to its
backlog (100) times in the same step, every second, for as long as the shortage lasts. This
accept loop instead pauses when an accept fails (for want of a descriptor, mostly), for twice
as long each time in a row (ACCEPT_PAUSE_FIRST_S up to ACCEPT_PAUSE_MAX_S), and logs the
shortage once when it begins and once when it ends, with how long it lasted. Connections
arriving meanwhile wait in the kernel's backlog and are accepted once descriptors are free.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable, Callable

from cakemp import log, streams
from cakemp.front.metrics import Metrics

BACKLOG = 100
ACCEPT_PAUSE_FIRST_S = 0.05
ACCEPT_PAUSE_MAX_S = 2.0

Handler = Callable[[streams.Inbox, asyncio.StreamWriter], Awaitable[None]]


class Listener:
    def __init__(self, host: str, port: int, handle: Handler, metrics: Metrics):
        """Bind `host:port` now (each address it resolves to); OSError if it cannot. `handle` serves
        each accepted connection, in a task of its own."""
        self._handle, self._metrics = handle, metrics
        self._sockets = _bound(host, port)
        self._accepting: list[asyncio.Task] = []
        self._connections: set[asyncio.Task] = set()
        self._log = log.get_logger()

    @property
    def address(self) -> tuple[str, int]:
        """The first bound address (the real port when port 0 was asked for)."""
        return self._sockets[0].getsockname()[:2]

    def start(self) -> None:
        """Listen and accept from now on (again: no change)."""
        if self._accepting:
            return
        for sock in self._sockets:
            sock.listen(BACKLOG)
            self._accepting.append(asyncio.create_task(self._accept(sock)))

    def close(self) -> None:
        """Stop accepting (connections already accepted go on); safe to call again."""
        for task in self._accepting:
            task.cancel()
        self._accepting.clear()
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            if sock.fileno() >= 0:
                # Unwatched before it is closed: the cancelled accept then leaves alone whatever
                # later reuses its descriptor number.
                loop.remove_reader(sock.fileno())
                sock.close()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        pause, short_since = ACCEPT_PAUSE_FIRST_S, None
        while True:
            try:
                connection, _ = await loop.sock_accept(sock)
            except ConnectionAbortedError:
                continue  # the peer gave up before it was accepted
            except OSError as e:
                self._metrics.accept_failures.inc()
                if short_since is None:
                    short_since = loop.time()
                    self._log.warning("cannot accept connections: paused until it can", error=str(e),
                                      out_of_descriptors=e.errno in (errno.EMFILE, errno.ENFILE))
                await asyncio.sleep(pause)
                pause = min(2 * pause, ACCEPT_PAUSE_MAX_S)
                continue
            if short_since is not None:
                self._log.info("accepting again", paused_s=round(loop.time() - short_since, 3))
                pause, short_since = ACCEPT_PAUSE_FIRST_S, None
            task = asyncio.create_task(self._serve(connection))
            self._connections.add(task)  # a reference until it ends: the loop keeps only weak ones
            task.add_done_callback(self._connections.discard)

    async def _serve(self, connection: socket.socket) -> None:
        try:
            reader, writer = await streams.accepted(connection)
        except OSError as e:  # gone before its transport was made
            connection.close()
            self._log.info("connection lost", error=f"{type(e).__name__}: {e}")
            return
        try:
            await self._handle(reader, writer)
        except Exception as e:  # a bug in the handler: this connection alone ends
            self._log.error("closing connection: unexpected error", error=f"{type(e).__name__}: {e}", fault="node")
        finally:
            writer.close()


def _bound(host: str, port: int) -> list[socket.socket]:
    """A non-blocking TCP socket bound to each address `host:port` resolves to (as asyncio binds them)."""
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(
                socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # no dual stack: each family is bound on its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
