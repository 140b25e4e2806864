"""The API's connection guard on a real uvicorn server and real sockets, in this process, with a small
cap and a short deadline (tests/master/test_serve.py shows the defaults against `cakemp serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket

import pytest

uvicorn = pytest.importorskip("uvicorn")

from cakemp.master.connection_guard import GuardedH11Protocol, IncompleteConnections  # noqa: E402

MOST, PER_SOURCE, DEADLINE_S, GRACE_S = 4, 2, 2.0, 0.5
ANSWER = b"ok"
STREAMED = 64 << 20  # far more than the kernel's and uvicorn's buffers hold


class App:
    """GET /: a short answer; GET /stream: STREAMED bytes in 64 KiB chunks, noting how the stream ended."""

    def __init__(self) -> None:
        self.stream_ended = asyncio.Event()
        self.streamed = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(ANSWER)).encode())]})
            await send({"type": "http.response.body", "body": ANSWER})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        gone = asyncio.create_task(receive())  # the request has no body: the next message is the disconnect
        chunk = b"x" * (64 << 10)
        while self.streamed < STREAMED and not gone.done():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.streamed += len(chunk)
        gone.cancel()
        self.stream_ended.set()


@contextlib.asynccontextmanager
async def guarded_server(app):
    """A uvicorn server of `app` with the guard, listening on a free port: yields (host, port)."""
    listener = socket.create_server(("127.0.0.1", 0))
    guarded = functools.partial(GuardedH11Protocol, guard=IncompleteConnections(MOST, DEADLINE_S, PER_SOURCE, GRACE_S))
    server = uvicorn.Server(uvicorn.Config(app, http=guarded, log_config=None, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield listener.getsockname()
    finally:
        server.should_exit = True
        await task
        listener.close()


async def connect(address, receive_buffer: int | None = None, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address)
    return sock


async def closed(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closes `sock` (read to its end, or reset) within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while await loop.sock_recv(sock, 1 << 16):
                pass
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return True


async def still_open(sock: socket.socket) -> bool:
    return not await closed(sock, timeout=0.05)


async def get(sock: socket.socket, path: str = "/") -> bytes:
    """A keep-alive GET on `sock`: the answer's bytes, read until the answer's body is in."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    answer = b""
    while not answer.endswith(ANSWER):
        answer += await loop.sock_recv(sock, 4096)
    return answer


def test_past_the_cap_newcomers_wait_out_the_grace_then_displace_the_oldest_fresh_one_not_a_served_one():
    """A client served once keeps its connection while 6 fresh idle ones come from 6 addresses (cap 4): the 3 that find
    the others within their grace are closed at once; past the grace a newcomer closes the oldest fresh
    one instead, never the kept-alive one, whose next request on that connection is answered."""
    async def run():
        async with guarded_server(App()) as address:
            client = await connect(address)
            assert (await get(client)).startswith(b"HTTP/1.1 200")
            idle = [await connect(address, source=f"127.0.0.{10 + i}") for i in range(6)]  # a source each
            assert [await still_open(s) for s in idle[:3]] == [True, True, True]
            assert [await closed(s, timeout=DEADLINE_S / 4) for s in idle[3:]] == [True, True, True]
            await asyncio.sleep(GRACE_S)
            newest = await connect(address, source="127.0.0.20")
            assert await closed(idle[0], timeout=DEADLINE_S / 4)
            assert [await still_open(s) for s in [*idle[1:3], newest]] == [True, True, True]
            assert (await get(client)).startswith(b"HTTP/1.1 200")
            for sock in [client, *idle, newest]:
                sock.close()

    asyncio.run(run())


def test_a_client_with_more_kept_alive_connections_than_its_share_closes_its_own_idle_one_and_is_served():
    """Two connections from one address (its cap), each served once and kept alive: a third from the same
    address takes the place of the oldest of them at once (closed, as a keep-alive timeout would) and
    is answered; the other stays open and is answered again."""
    async def run():
        async with guarded_server(App()) as address:
            kept = [await connect(address) for _ in range(PER_SOURCE)]
            for sock in kept:
                assert (await get(sock)).startswith(b"HTTP/1.1 200")
            newcomer = await connect(address)
            assert await closed(kept[0], timeout=DEADLINE_S / 4)
            assert (await get(newcomer)).startswith(b"HTTP/1.1 200")
            assert (await get(kept[1])).startswith(b"HTTP/1.1 200")
            for sock in [*kept, newcomer]:
                sock.close()

    asyncio.run(run())


def test_one_address_holds_at_most_its_share_and_another_address_is_served():
    """Idle connections from one address past its per-source cap (2) are closed at once, however few
    the others hold; a client from another address is answered meanwhile."""
    async def run():
        async with guarded_server(App()) as address:
            idle = [await connect(address, source="127.0.0.3") for _ in range(4)]
            assert [await still_open(s) for s in idle[:2]] == [True, True]
            assert [await closed(s, timeout=DEADLINE_S / 4) for s in idle[2:]] == [True, True]
            client = await connect(address)
            assert (await get(client)).startswith(b"HTTP/1.1 200")
            for sock in [client, *idle]:
                sock.close()

    asyncio.run(run())


def test_an_incomplete_request_is_closed_at_its_deadline_though_it_trickles():
    """Half a request head, then a byte every tenth of the deadline: closed by the deadline all the same."""
    async def run():
        async with guarded_server(App()) as address:
            loop = asyncio.get_running_loop()
            sock = await connect(address)
            await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\n")
            with pytest.raises(ConnectionError):
                async with asyncio.timeout(20 * DEADLINE_S):
                    while True:
                        await loop.sock_sendall(sock, b"X")
                        await asyncio.sleep(DEADLINE_S / 10)
            sock.close()

    asyncio.run(run())


def test_a_client_that_stops_reading_is_aborted_and_its_answer_ends():
    """A client asks for a long stream and reads none of it: once the buffers are full and writing has
    stayed paused for the deadline, the connection is aborted and the app's stream ends (far short)."""
    async def run():
        app = App()
        async with guarded_server(app) as address:
            sock = await connect(address, receive_buffer=4096)
            await asyncio.get_running_loop().sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(30):
                await app.stream_ended.wait()
            assert app.streamed < STREAMED
            assert await closed(sock)
            sock.close()

    asyncio.run(run())
