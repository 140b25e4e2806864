"""Front floor: the least a front of cakemp's design costs per decode request, to measure the real
front against (bench/request_cost.py --floor).

A process made of the front's own parts and nothing more: an asyncio server on uvloop reading Cake
frames (`streams.FrameReader`, the wire codec), each Batch's activation passed to a device process
over cakemp's ZeroMQ channel (`ipc.FrontChannel`; the requests one wake-up finds in one `Hops`
message, as the front sends them) and the answer written back as a TensorMessage. The device is
bench/pool.py's echo: it answers every message with its own bytes after busy work as long as a
decode step's compute. What the real front does besides (admission, the buffer budget, deadlines,
routing, the pool's bookkeeping, metrics, logs) is absent, so the real front's CPU per request
over this one's is what its own Python costs.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import platform
import time
from pathlib import Path

import uvloop

from cakemp.ipc import Activation, Answers, DeviceChannel, FrontChannel, Hop, Hops, Op, Stage, encode, joined, rows
from cakemp.streams import FrameReader
from cakemp.wire import Batch, RawTensor, Revision, TensorMessage, WorkerInfo, encode_frame

REVISION = Revision.V2
GATHER_S = 0.005  # how long the echo waits for its last step's sessions to come back (the device's least window)
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


def serve(endpoint: str, ports: multiprocessing.Queue) -> None:
    """The floor front's process: listen on a free port (put on `ports`) until killed."""
    uvloop.run(_serve(endpoint, ports))


async def _serve(endpoint: str, ports: multiprocessing.Queue) -> None:
    loop = asyncio.get_running_loop()
    owed: dict[int, asyncio.Future] = {}  # request id -> its waiter
    queued: list[tuple[Hop, memoryview]] = []  # this wake-up's requests, sent as one Hops message
    request_ids = itertools.count(1)
    sending: set[asyncio.Task] = set()  # sends waiting for the socket (held: tasks are weakly kept)

    def answered(answers) -> None:
        for activation, body in zip(answers.activations, rows(answers.activations, answers.data)):
            owed.pop(activation.request_id).set_result(body)

    channel = FrontChannel(endpoint, answered, lambda error: None)

    async def send_when_writable(frames: list) -> None:  # the echo not connected yet, as the front waits for a device
        while not channel.try_send(frames):
            await channel.writable()

    def flush() -> None:
        frames = encode(Hops(tuple(hop for hop, _ in queued), joined([data for _, data in queued])))
        queued.clear()
        if not channel.try_send(frames):
            sending.add(task := loop.create_task(send_when_writable(frames)))
            task.add_done_callback(sending.discard)

    async def forward(x: RawTensor) -> RawTensor:
        request_id = next(request_ids)
        data = memoryview(x.data)
        hop = Hop(0, request_id, x.dtype, data.nbytes, 0, 1, x.shape, (Stage(0, 0, (Op(0, 0, 0),)),))
        if not queued:
            loop.call_soon(flush)
        queued.append((hop, data))
        owed[request_id] = waiter = loop.create_future()
        return RawTensor(await waiter, x.dtype, x.shape)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(reader, REVISION)
        while await frames.header() is not None:
            message = await frames.message()
            # A Batch's answer; Hello's and Goodbye's, WorkerInfo, as the node's.
            reply = TensorMessage(await forward(message.x) if message.batch else message.x) \
                if isinstance(message, Batch) else _INFO
            writer.writelines(encode_frame(reply, REVISION))
            if writer.transport.get_write_buffer_size():
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    ports.put(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()
