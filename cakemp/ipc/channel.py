"""ZeroMQ sockets between the front and its device processes: one DEALER pair per device.

The front binds `ipc://<runtime dir>/device-<i>` before starting the process, the device
connects; messages queue until then. Each device serves its socket one request at a time, so
the pair is a FIFO per device while different devices run in parallel.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from cakemp.ipc.message import Message, decode, encode


class FrontChannel:
    """The front's end of one device's socket (asyncio)."""

    def __init__(self, endpoint: str):
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)

    async def send(self, msg: Message) -> None:
        # copy=False: a large activation body is handed to zmq as the same buffer, not copied.
        await self._socket.send_multipart(encode(msg), copy=False)

    async def receive(self) -> Message:
        frames = await self._socket.recv_multipart(copy=False)
        return decode([frame.buffer for frame in frames])

    def close(self) -> None:
        self._socket.close(linger=0)


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
