"""The front's and the devices' sockets over real ipc:// endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from functools import partial
from typing import NamedTuple

import pytest
import zmq

from cakemp.ipc import Activation, Answers, DeviceChannel, FrontChannel, Hop, Hops, Op, Ping, Stage, encode, rows
from cakemp.ipc.channel import send_frames


def test_a_request_handed_from_device_to_device_comes_back_intact(tmp_path):
    """Two 2 MiB Hops in one message routed over two devices reach the first, go to the second's
    inbox straight from it, and the second's Answers reach the front with the same bytes."""
    endpoints = [f"ipc://{tmp_path}/device-{i}" for i in range(2)]
    body = os.urandom(4 << 20)
    parent_read, parent_write = os.pipe()

    def device(index: int):
        channel = DeviceChannel(endpoints[index], parent_read, endpoints)
        try:
            (request,) = channel.receive(30)
            rest = request.hops[0].stages[1:]
            if rest:
                assert channel.hand_off(rest[0].device, Hops(tuple(Hop(hop.session, hop.request_id, hop.dtype,
                                                                       hop.nbytes, 0, 1, hop.shape, rest)
                                                                   for hop in request.hops), request.data))
            else:
                channel.send(Answers(tuple(Activation(hop.request_id, hop.dtype, hop.nbytes, 0, hop.shape)
                                           for hop in request.hops), data=request.data))
        finally:  # whatever failed: an open channel would hang the interpreter's exit
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
        try:
            await channels[0].send(Hops((Hop(3, 9, 5, half, 0, 1, (1, 512, 1024), route),
                                         Hop(4, 10, 5, half, 0, 1, (1, 512, 1024), route)), memoryview(body)))
            return await asyncio.wait_for(replies.get(), 10)
        finally:
            for thread in threads:
                thread.join(40)
            for channel in channels:
                channel.close()

    reply = asyncio.run(front())
    assert [(a.request_id, a.shape) for a in reply.activations] == [(9, (1, 512, 1024)), (10, (1, 512, 1024))]
    assert b"".join(rows(reply.activations, reply.data)) == body
    os.close(parent_read)
    os.close(parent_write)


class Device(NamedTuple):
    channel: DeviceChannel
    front: zmq.Socket  # a plain DEALER in the front's place, bound first as the front binds
    parent_write: int  # the parent's end of the pipe


@pytest.fixture
def device(tmp_path):
    """A device's channel with the front's socket and the parent's pipe; all closed afterwards, failed or not
    (a channel left open would hang the interpreter's exit in its context's term)."""
    endpoint = f"ipc://{tmp_path}/device-0"
    front = zmq.Context.instance().socket(zmq.DEALER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind(endpoint)
    parent_read, parent_write = os.pipe()
    channel = DeviceChannel(endpoint, parent_read, [endpoint])
    yield Device(channel, front, parent_write)
    channel.close()
    front.close()
    os.close(parent_read)
    with contextlib.suppress(OSError):  # closed by the test
        os.close(parent_write)


def test_a_hand_off_to_a_device_that_is_not_a_peer_is_refused(device):
    """hand_off to an index outside the node's devices returns False rather than raising."""
    assert device.channel.hand_off(1, Hops((), b"")) is False


def test_the_device_end_returns_none_once_the_parent_pipe_closes(device):
    """With no request pending, closing the parent's end of the pipe makes receive() return None."""
    os.close(device.parent_write)
    assert device.channel.receive(10) is None


def test_a_device_asleep_with_nothing_to_do_wakes_once_the_parent_is_gone(device):
    """A sleeping receive returns None when the parent's end of the pipe closes meanwhile."""
    closer = threading.Timer(0.05, os.close, (device.parent_write,))
    closer.start()
    assert device.channel.receive(10) is None  # (a receive that slept through it would give [] after 10 s)
    closer.join()


def test_a_device_waits_out_its_timeout_when_nothing_comes_and_wakes_for_what_comes_later(device, tmp_path):
    """receive(timeout) with nothing sent returns no messages once the timeout has passed (not before);
    a message sent while a receive sleeps (or while it looks without sleeping, poll_s) is returned as it
    comes, each time."""
    channel = device.channel
    started = time.monotonic()
    assert channel.receive(0.05) == []
    assert time.monotonic() - started >= 0.05
    assert channel.receive(0) == []
    ping = partial(send_frames, device.front, encode(Ping()))
    for poll_s in (0.0, 10.0):
        sender = threading.Timer(0.05, ping)
        sender.start()
        started = time.monotonic()
        assert channel.receive(30, poll_s) == [Ping()]
        assert time.monotonic() - started < 5
        sender.join()
    # A peer connecting to the inbox wakes the sleeper with no message: it sleeps on until one comes.
    peer = zmq.Context.instance().socket(zmq.PUSH)
    peer.setsockopt(zmq.LINGER, 0)
    connecting, sender = threading.Timer(0.05, peer.connect, (f"ipc://{tmp_path}/device-0-in",)), threading.Timer(0.3, ping)
    connecting.start()
    sender.start()
    try:
        assert channel.receive(30) == [Ping()]
    finally:
        connecting.join()
        sender.join()
        peer.close()
