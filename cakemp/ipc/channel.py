"""ZeroMQ sockets between the front and its device processes, and between devices.

The front binds one DEALER per device on `ipc://<runtime dir>/device-<i>` before starting the
process, the device connects; messages queue until then. Each device also binds an inbox
(PULL) on `…/device-<i>-in`, and holds one PUSH connected to every other device's inbox: a
request whose route spans devices goes front → first device → next device … → front, each
device handing its result straight to the next. Each pipe is FIFO, so the chunks of one
prompt reach every device of the route in order.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence

import zmq

from cakemp.errors import BadIpcMessage
from cakemp.ipc.codec import decode, encode
from cakemp.ipc.message import Buffer, Message

# As plain ints: pyzmq's are enum members, whose `&` and `|` cost a Python call each time.
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


def send_frames(socket: zmq.Socket, frames: Sequence[Buffer], flags: int = 0) -> None:
    """socket.send_multipart(frames, flags, copy=False), without what it adds in Python for each message: a
    type check of every frame (ours are the codec's buffers) and enum arithmetic on the flags (0.7x its time).
    copy=False: a large activation body goes to zmq as the same buffer, not copied (below
    zmq.COPY_THRESHOLD, 64 KiB, pyzmq copies it anyway, which is cheaper). Once zmq has taken the first
    frame, it takes the rest: zmq.Again, where the socket cannot take the message now, is raised only there."""
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        socket.send(frame, more, copy=False)
    socket.send(frames[-1], flags, copy=False)


def receive_frames(socket: zmq.Socket) -> list[zmq.Frame]:
    """socket.recv_multipart(zmq.NOBLOCK, copy=False), asking each frame whether more follow rather than the
    socket with an enum option (0.5x its time); zmq.Again where no message waits."""
    frames = [socket.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(socket.recv(_NOBLOCK, copy=False))
    return frames


def inbox(endpoint: str) -> str:
    """The endpoint where the device behind `endpoint` receives hand-offs from other devices."""
    return f"{endpoint}-in"


class FrontChannel:
    """The front's end of one device's socket, driven by the asyncio loop that created it.

    A plain zmq socket with non-blocking send and receive, woken by `loop.add_reader` on its
    ZMQ_FD, rather than zmq.asyncio, which wraps every call in futures and callbacks. Every
    message received is handed to `on_message` from the reader callback itself, so a reply
    reaches its waiting request with no task in between. ZMQ_FD only says that the socket's
    events *may* have changed, and any send, receive or ZMQ_EVENTS read resets it; so the
    callback reads until ZMQ_EVENTS shows nothing left, and a send, which may have swallowed
    the signal of a reply that had already arrived, schedules the callback again when so.
    """

    def __init__(self, endpoint: str, on_message: Callable[[Message], None],
                 on_garbage: Callable[[BadIpcMessage], None]):
        self._loop = asyncio.get_running_loop()
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._fd = self._socket.getsockopt(zmq.FD)
        self._on_message, self._on_garbage = on_message, on_garbage
        self._writable: list[asyncio.Future] = []
        self._closed = False
        self._loop.add_reader(self._fd, self._ready)

    def try_send(self, frames: Sequence[Buffer]) -> bool:
        """Send encoded frames now if the socket takes them (False: no device connected yet, or its queue is full)."""
        try:
            send_frames(self._socket, frames, _NOBLOCK)
        except zmq.Again:
            return False
        if self._socket.getsockopt(_EVENTS) & _POLLIN:
            self._loop.call_soon(self._ready)
        return True

    async def send(self, msg: Message) -> None:
        """Encode and send `msg`, waiting while the socket cannot take it."""
        frames = encode(msg)
        while not self.try_send(frames):
            await self.writable()

    async def writable(self) -> None:
        """Return once the socket may take a message."""
        waiter = self._loop.create_future()
        self._writable.append(waiter)
        await waiter

    def wake_writers(self) -> None:
        """Wake every task waiting in `writable`, to look again at why it waits (its device died, say)."""
        waiters, self._writable = self._writable, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        self._socket.close(linger=0)
        for waiter in self._writable:
            waiter.cancel()
        self._writable.clear()

    def _ready(self) -> None:
        if self._closed:
            return
        # Reading ZMQ_EVENTS also resets ZMQ_FD: without it the loop would call us again at once.
        while (events := self._socket.getsockopt(_EVENTS)) & _POLLIN:
            frames = receive_frames(self._socket)
            try:
                msg = decode([frame.buffer for frame in frames])
            except BadIpcMessage as e:
                self._on_garbage(e)
                continue
            self._on_message(msg)
            if self._closed:  # the message stopped the pool
                return
        if events & _POLLOUT:
            self.wake_writers()


class DeviceChannel:
    """A device process's sockets (blocking): its front socket, its inbox, and its peers' inboxes.

    `parent_fd` is the read end of a pipe whose write end only the parent holds: it becomes
    readable (EOF) exactly when the parent is gone, however it died. `peers[i]` is device i's
    front endpoint (its inbox is derived from it); this device's own entry is skipped.
    """

    def __init__(self, endpoint: str, parent_fd: int, peers: Sequence[str] = (),
                 on_garbage: Callable[[BadIpcMessage], None] = lambda error: None):
        self.on_garbage = on_garbage
        self._context = zmq.Context()
        self._front = self._context.socket(zmq.DEALER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.connect(endpoint)
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(inbox(endpoint))
        self._peers: dict[int, zmq.Socket] = {}
        for index, peer in enumerate(peers):
            if peer == endpoint:
                continue
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(inbox(peer))
            self._peers[index] = push
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(self._front, zmq.POLLIN)
        self._poller.register(self._inbox, zmq.POLLIN)
        self._poller.register(parent_fd, zmq.POLLIN)
        self.last_sent = time.monotonic()  # when the front last heard from us

    def receive(self, timeout_s: float | None = None, poll_s: float = 0.0) -> list[Message] | None:
        """Every message waiting, from the front and from peers, once one is there or `timeout_s`
        has passed (None: no limit; 0: at once); None once the parent is gone. A message that
        cannot be decoded goes to `on_garbage` (only the front writes here: a bug worth a log
        line, not an end).

        `poll_s`: look at the sockets without sleeping for up to that long first (within
        `timeout_s`), so that a message due soon finds this process running, not asleep in the
        kernel (a wake-up from there costs tens to hundreds of µs)."""
        # hand-offs first: they finish requests already under way
        waiting = [socket for socket in (self._inbox, self._front) if socket.getsockopt(_EVENTS) & _POLLIN]
        if not waiting:  # no poll (a syscall, twice when it sleeps) while a message is known to wait
            if poll_s > 0 and timeout_s != 0:
                until = time.monotonic() + (poll_s if timeout_s is None else min(poll_s, timeout_s))
                while not self._poller.poll(0) and time.monotonic() < until:
                    pass
            ready = dict(self._poller.poll(None if timeout_s is None else math.ceil(timeout_s * 1000)))
            if self._parent_fd in ready:
                return None
            waiting = [socket for socket in (self._inbox, self._front) if socket in ready]
        messages = []
        for socket in waiting:
            # Until ZMQ_EVENTS shows none left, rather than until recv raises zmq.Again (an exception each time).
            while True:
                try:
                    frames = receive_frames(socket)
                except zmq.Again:
                    break
                try:
                    messages.append(decode([frame.buffer for frame in frames]))
                except BadIpcMessage as e:
                    self.on_garbage(e)
                if not socket.getsockopt(_EVENTS) & _POLLIN:
                    break
        return messages

    def send(self, msg: Message) -> None:
        """To the front."""
        send_frames(self._front, encode(msg))
        self.last_sent = time.monotonic()

    def hand_off(self, device: int, msg: Message) -> bool:
        """To device `device`'s inbox; False if it cannot take it now (it is gone: the front fails the request)."""
        push = self._peers.get(device)
        if push is None:
            return False
        try:
            send_frames(push, encode(msg), _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` lets last messages (a load failure, a hand-off) leave first."""
        self._front.close(linger=linger_ms)
        self._inbox.close(linger=0)
        for push in self._peers.values():
            push.close(linger=linger_ms)
        self._context.term()
