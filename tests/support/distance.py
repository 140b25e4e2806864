"""A peer far away, on loopback: a TCP relay that delivers every byte a fixed time after it was sent.

A client connects to the relay's `port`; the relay connects on to the target from its own
`source` address at once (as the client's SYN would arrive) and carries each direction's bytes
`one_way_s` late, in order. So a handshake through it takes its round trips as over a real
distance, and the target sees the connection sit silent between them. It runs its own event loop
in a thread, so blocking clients (the openai client) and asyncio ones can use it alike.

Leaving the `with` block closes every socket the relay holds, both sides, before it returns: bytes
still on their way (a client's close a moment ago) are dropped, and the target sees each of its
connections end. Left to the garbage collector, a stopped loop's sockets stay open at the target
for as long as the process lives (a node would count them as masters' connections).

`hold()` makes the connections that arrive from then on wait, accepted but not yet connected on
(their bytes unread), until `release()`: a peer whose handshake never comes, for as long as a test
likes; `held` counts those waiting.
"""

from __future__ import annotations

import asyncio
import threading
import time


class Distance:
    """Relays 127.0.0.1:`port` (at `.port`), from `source`, `one_way_s` late each way."""

    def __init__(self, port: int, source: str, one_way_s: float):
        self._target, self._source, self._one_way_s = port, source, one_way_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()  # every socket the relay holds open, either side
        self._open = asyncio.Event()  # cleared while new connections are held
        self._open.set()
        self.held = 0
        self.port = 0

    def __enter__(self) -> Distance:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0), self._loop).result()
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            self._server.close()
            relaying = asyncio.all_tasks() - {asyncio.current_task()}
            for task in relaying:
                task.cancel()
            await asyncio.gather(*relaying, return_exceptions=True)
            for writer in self._writers:
                writer.transport.abort()  # a close would wait for its unsent bytes, which nothing sends now
            await asyncio.sleep(0)  # the transports' closing callbacks run (they close the sockets)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def hold(self) -> None:
        self._open.clear()  # a flag, read by the next connection: no waiter to wake, so safe from this thread

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    async def _relay(self, client_reader, client_writer) -> None:
        writers = [client_writer]
        self._writers.add(client_writer)
        try:
            if not self._open.is_set():
                self.held += 1
                await self._open.wait()
                self.held -= 1
            target_reader, target_writer = await asyncio.open_connection(
                "127.0.0.1", self._target, local_addr=(self._source, 0))
            writers.append(target_writer)
            self._writers.add(target_writer)
            await asyncio.gather(self._late(client_reader, target_writer), self._late(target_reader, client_writer),
                                 return_exceptions=True)
        except OSError:
            pass  # the target refused: the client's connection ends at once
        except asyncio.CancelledError:
            return  # the relay stopping closes the sockets; a cancelled handler asyncio's server would log as an error
        for writer in writers:
            writer.close()
            self._writers.discard(writer)

    async def _late(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry `reader`'s bytes to `writer`, each chunk `one_way_s` after it came; then end `writer`."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver():
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(due - time.monotonic())
                if not chunk:
                    writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + self._one_way_s, chunk))
        except OSError:
            delivering.cancel()
            writer.transport.abort()  # a reset, passed on as one
            return
        queue.put_nowait((time.monotonic() + self._one_way_s, b""))
        await delivering
