"""ZeroMQ sockets between the front and its device processes: one DEALER pair per device.

The front binds `ipc://<runtime dir>/device-<i>` before starting the process, the device
connects; messages queue until then. Each device serves its socket one request at a time, so
the pair is a FIFO per device while different devices run in parallel.
"""

from __future__ import annotations

import asyncio

import zmq

from cakemp.ipc.message import Message, decode, encode


class FrontChannel:
    """The front's end of one device's socket, driven by the asyncio loop that created it.

    A plain zmq socket with non-blocking send and receive, woken by `loop.add_reader` on its
    ZMQ_FD, rather than zmq.asyncio, which wraps every call in futures and callbacks: side by
    side this takes ~10 µs off a ~200 µs round trip to a device process (docs/benchmarks.md,
    "Pool"). ZMQ_FD only says that the socket's events *may* have changed, and any send,
    receive or ZMQ_EVENTS read resets it; so every wait first tries the operation itself, and
    after each one the events are re-read for the other waiters (a send may have swallowed the
    signal of a reply that had already arrived).
    """

    def __init__(self, endpoint: str):
        self._loop = asyncio.get_running_loop()
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._fd = self._socket.getsockopt(zmq.FD)
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (zmq.POLLIN or zmq.POLLOUT, its waiter)
        self._loop.add_reader(self._fd, self._wake)

    async def send(self, msg: Message) -> None:
        frames = encode(msg)
        while True:
            try:
                # copy=False: a large activation body is handed to zmq as the same buffer, not
                # copied (below zmq.COPY_THRESHOLD, 64 KiB, pyzmq copies it anyway, which is cheaper).
                self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:  # no device connected yet, or its queue is full
                await self._wait(zmq.POLLOUT)
        self._wake()

    async def receive(self) -> Message:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await self._wait(zmq.POLLIN)
        self._wake()
        return decode([frame.buffer for frame in frames])

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self._socket.close(linger=0)
        for _, waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()

    async def _wait(self, event: int) -> None:
        waiter = self._loop.create_future()
        self._waiters.append((event, waiter))
        await waiter

    def _wake(self) -> None:
        # Reading ZMQ_EVENTS also resets ZMQ_FD: without it the loop would call us again at once.
        events = self._socket.getsockopt(zmq.EVENTS)
        waiting = []
        for event, waiter in self._waiters:
            if waiter.done():  # its task was cancelled
                continue
            if events & event:
                waiter.set_result(None)
            else:
                waiting.append((event, waiter))
        self._waiters = waiting


class DeviceChannel:
    """A device process's end of its socket (blocking), watching the parent's liveness too.

    `parent_fd` is the read end of a pipe whose write end only the parent holds: it becomes
    readable (EOF) exactly when the parent is gone, however it died.
    """

    def __init__(self, endpoint: str, parent_fd: int):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(parent_fd, zmq.POLLIN)

    def receive(self) -> Message | None:
        """The next message, or None once the parent is gone. Raises ProtocolError on garbage."""
        while True:
            ready = dict(self._poller.poll())
            if self._parent_fd in ready:
                return None
            if self._socket in ready:
                frames = self._socket.recv_multipart(copy=False)
                return decode([frame.buffer for frame in frames])

    def send(self, msg: Message) -> None:
        self._socket.send_multipart(encode(msg), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` lets a last message (a load Failure) reach the front first."""
        self._socket.close(linger=linger_ms)
        self._context.term()
