"""The front's and a device's sockets over a real ipc:// endpoint."""

from __future__ import annotations

import asyncio
import os
import threading

from cakemp.ipc import Activation, DeviceChannel, Forward, FrontChannel, Op


def test_a_request_and_its_reply_cross_the_socket_intact(tmp_path):
    """A 4 MiB Forward reaches the device and its Activation comes back with the same bytes."""
    endpoint = f"ipc://{tmp_path}/device-0"
    body = os.urandom(4 << 20)
    parent_read, parent_write = os.pipe()

    def device():
        channel = DeviceChannel(endpoint, parent_read)
        request = channel.receive()
        channel.send(Activation(request.request_id, request.dtype, request.shape, request.data))
        channel.close(linger_ms=10_000)  # let the reply leave before the socket goes

    async def front():
        channel = FrontChannel(endpoint)
        thread = threading.Thread(target=device)
        thread.start()
        await channel.send(Forward(3, 9, 5, (1, 1024, 1024), (Op(0, 0, 0),), memoryview(body)))
        reply = await asyncio.wait_for(channel.receive(), 10)
        thread.join()
        channel.close()
        return reply

    reply = asyncio.run(front())
    assert (reply.request_id, reply.shape) == (9, (1, 1024, 1024))
    assert bytes(reply.data) == body
    os.close(parent_read)
    os.close(parent_write)


def test_the_device_end_returns_none_once_the_parent_pipe_closes(tmp_path):
    """With no request pending, closing the parent's end of the pipe makes receive() return None."""
    parent_read, parent_write = os.pipe()
    channel = DeviceChannel(f"ipc://{tmp_path}/device-0", parent_read)
    os.close(parent_write)
    assert channel.receive() is None
    channel.close()
    os.close(parent_read)
