"""Front floor: the least a front of cakemp's design costs per decode request, to measure the real
front against (bench/request_cost.py --floor).

A process made of the front's own parts and nothing more: an asyncio.Protocol on uvloop that
decodes Cake frames as their bytes arrive (`wire.FrameDecoder`, the wire codec), passes each
Batch's activation to a device process over cakemp's ZeroMQ channel (`ipc.FrontChannel`; the
requests one wake-up finds in one `Hops` message, as the front sends them) and writes the answer
back as a TensorMessage from its callback, with no task woken and no future made per request, as
the front's connections do. The device is an echo: it answers every message with its own bytes
after busy work as long as a decode step's compute. What the real front does besides (admission,
the buffer budget, deadlines, routing, the pool's bookkeeping, metrics, logs) is absent, so the
real front's CPU per request over this one's is what its own Python costs.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import platform
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from cakemp import heap
from cakemp.ipc import Activation, Answers, DeviceChannel, FrontChannel, Hop, Hops, Stage, encode, joined, rows
from cakemp.wire import Batch, FrameDecoder, RawTensor, Revision, TensorMessage, WorkerInfo, encode_frame

REVISION = Revision.V2
# How long the echo waits for its last step's sessions to come back (a device's least window until it
# knows its steps' fixed cost: device/scheduler.py's Gathering).
GATHER_S = 0.005
_INFO = WorkerInfo("floor", "f32", platform.system().lower(), platform.machine(), "cpu", 0, 0)


class Floor:
    """The floor front and its echo device (answering after `busy_s` of busy work), started: the
    front's `port`, and both `pids` as "front" and "device" (bench/request_cost.py's names)."""

    def __init__(self, workdir: Path, busy_s: float):
        context = multiprocessing.get_context("spawn")
        endpoint = f"ipc://{workdir}/floor"
        ports = context.Queue()
        self._front = context.Process(target=serve, args=(endpoint, ports), daemon=True)
        self._front.start()
        self.port = ports.get(timeout=60)
        # The echo's parent-death pipe: it reads EOF once this end is closed.
        reader, self._writer = context.Pipe(duplex=False)
        self._device = context.Process(target=echo_device, args=(endpoint, reader, busy_s), daemon=True)
        self._device.start()
        reader.close()
        self.pids = {"front": self._front.pid, "device": self._device.pid}

    def stop(self) -> None:
        self._writer.close()
        for process in (self._front, self._device):
            process.kill()
            process.join()


def echo_device(endpoint: str, parent_pipe, busy_s: float) -> None:
    """A device process that answers what it received with its own bytes, as one step: after `busy_s`
    of busy work, in one message. As a device gathers its sessions (device/scheduler.py's Gathering),
    it first waits up to GATHER_S for as many requests as its last step answered."""
    channel = DeviceChannel(endpoint, parent_pipe.fileno())
    last = 0
    while (messages := channel.receive()) is not None:
        deadline = time.monotonic() + GATHER_S
        while sum(len(message.hops) for message in messages) < last and (left := deadline - time.monotonic()) > 0:
            if (more := channel.receive(left)) is None:
                return
            messages += more
        hops = tuple(hop for message in messages for hop in message.hops)
        busy(busy_s)
        channel.send(Answers(tuple(Activation(hop.request_id, hop.dtype, hop.nbytes, hop.chunk, hop.shape) for hop in hops),
                             data=joined([message.data for message in messages])))
        last = len(hops)


def busy(seconds: float) -> None:
    """Occupy this core for `seconds`, as a decode's compute does (a sleep would not: the core halts)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Relay:
    """The floor front's ZeroMQ side: each Batch's activation queued for the echo device (the requests of
    one wake-up in one Hops message, sent once the loop has run them all), its answer handed to the
    callback it was queued with."""

    def __init__(self, endpoint: str):
        self._loop = asyncio.get_running_loop()
        self._owed: dict[int, Callable[[memoryview], None]] = {}  # request id -> what takes its answer
        self._queued: list[tuple[Hop, memoryview]] = []
        self._request_ids = itertools.count(1)
        self._sending: set[asyncio.Task] = set()  # sends waiting for the socket (held: tasks are weakly kept)
        self._channel = FrontChannel(endpoint, self._answered, lambda error: None)

    def forward(self, x: RawTensor, answer: Callable[[memoryview], None]) -> None:
        request_id = next(self._request_ids)
        data = memoryview(x.data)
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append((Hop(0, request_id, x.dtype, data.nbytes, 0, 1, x.shape, (Stage(0, 0, (0,), (0,), (0,)),)),
                             data))
        self._owed[request_id] = answer

    def _answered(self, answers: Answers) -> None:
        for activation, body in zip(answers.activations, rows(answers.activations, answers.data)):
            self._owed.pop(activation.request_id)(body)

    def _flush(self) -> None:
        frames = encode(Hops(tuple(hop for hop, _ in self._queued), joined([data for _, data in self._queued])))
        self._queued.clear()
        if not self._channel.try_send(frames):  # the echo not connected yet, as the front waits for a device
            self._sending.add(task := self._loop.create_task(self._send_when_writable(frames)))
            task.add_done_callback(self._sending.discard)

    async def _send_when_writable(self, frames: list) -> None:
        while not self._channel.try_send(frames):
            await self._channel.writable()


def _reply(message) -> TensorMessage | WorkerInfo | None:
    """What the floor answers at once (Hello's and Goodbye's WorkerInfo, as the node's; an empty Batch's
    x); None for a Batch with layers, which goes to the echo."""
    if not isinstance(message, Batch):
        return _INFO
    return None if message.batch else TensorMessage(message.x)


def serve(endpoint: str, ports: multiprocessing.Queue) -> None:
    """The floor front's process: listen on a free port (put on `ports`) until killed (the masters'
    frames are written whole at once: a master's next Batch comes after its reply, so no flow control
    is needed here); its freed memory kept for reuse, as the front's (cakemp/heap.py)."""
    heap.keep_freed_memory()
    uvloop.run(_serve(endpoint, ports))


class _Connection(asyncio.Protocol):
    """One master's connection: each whole frame's message answered as it arrives, a Batch's from its
    answer's callback."""

    def __init__(self, relay: _Relay):
        self._relay = relay
        self._decoder = FrameDecoder(REVISION)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._decoder.feed(data)
        while (message := self._decoder.next_message()) is not None:
            reply = _reply(message)
            if reply is None:
                x = message.x
                self._relay.forward(x, lambda body, x=x: self._write(TensorMessage(RawTensor(body, x.dtype, x.shape))))
            else:
                self._write(reply)

    def _write(self, message) -> None:
        if not self._transport.is_closing():
            self._transport.writelines(encode_frame(message, REVISION))


async def _serve(endpoint: str, ports: multiprocessing.Queue) -> None:
    relay = _Relay(endpoint)
    server = await asyncio.get_running_loop().create_server(lambda: _Connection(relay), "127.0.0.1", 0)
    ports.put(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


