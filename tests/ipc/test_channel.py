"""The front's and the devices' sockets over real ipc:// endpoints."""

from __future__ import annotations

import asyncio
import os
import threading

from cakemp.ipc import Activation, Answers, DeviceChannel, FrontChannel, Hop, Hops, Op, Stage, rows


def test_a_request_handed_from_device_to_device_comes_back_intact(tmp_path):
    """Two 2 MiB Hops in one message routed over two devices reach the first, go to the second's
    inbox straight from it, and the second's Answers reach the front with the same bytes."""
    endpoints = [f"ipc://{tmp_path}/device-{i}" for i in range(2)]
    body = os.urandom(4 << 20)
    parent_read, parent_write = os.pipe()

    def device(index: int):
        channel = DeviceChannel(endpoints[index], parent_read, endpoints)
        (request,) = channel.receive()
        rest = request.hops[0].stages[1:]
        if rest:
            assert channel.hand_off(rest[0].device, Hops(tuple(Hop(hop.session, hop.request_id, hop.dtype, hop.nbytes,
                                                                   0, 1, hop.shape, rest) for hop in request.hops),
                                                         request.data))
        else:
            channel.send(Answers(tuple(Activation(hop.request_id, hop.dtype, hop.nbytes, 0, hop.shape)
                                       for hop in request.hops), data=request.data))
        channel.close(linger_ms=10_000)  # let the message leave before the socket goes

    async def front():
        replies: asyncio.Queue = asyncio.Queue()
        channels = [FrontChannel(endpoint, replies.put_nowait, lambda error: None) for endpoint in endpoints]
        # Daemons: where the front's send fails, they wait on for a message and must not keep pytest's process alive.
        threads = [threading.Thread(target=device, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        route = (Stage.of(0, 1, (Op(0, 0, 0),)), Stage.of(1, 1, (Op(0, 0, 1),)))
        half = len(body) // 2
        await channels[0].send(Hops((Hop(3, 9, 5, half, 0, 1, (1, 512, 1024), route),
                                     Hop(4, 10, 5, half, 0, 1, (1, 512, 1024), route)), memoryview(body)))
        reply = await asyncio.wait_for(replies.get(), 10)
        for thread in threads:
            thread.join()
        for channel in channels:
            channel.close()
        return reply

    reply = asyncio.run(front())
    assert [(a.request_id, a.shape) for a in reply.activations] == [(9, (1, 512, 1024)), (10, (1, 512, 1024))]
    assert b"".join(rows(reply.activations, reply.data)) == body
    os.close(parent_read)
    os.close(parent_write)


def test_a_hand_off_to_a_device_that_is_not_a_peer_is_refused(tmp_path):
    """hand_off to an index outside the node's devices returns False rather than raising."""
    parent_read, parent_write = os.pipe()
    endpoint = f"ipc://{tmp_path}/device-0"
    channel = DeviceChannel(endpoint, parent_read, [endpoint])
    assert channel.hand_off(1, Hops((), b"")) is False
    channel.close()
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
