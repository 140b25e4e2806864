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

    python -m bench.front_floor [--rounds 3] [--steps 200] [--counts 1,8,32]

measures this floor beside a floor front of another design (`callbacks`): an asyncio.Protocol
that decodes frames as their bytes arrive (`wire.FrameDecoder`) and writes each reply from its
answer's callback, with no task woken and no future made per request (and no asyncio streams).
Their CPU per request side by side is what that design would save a front of cakemp's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from cakemp.ipc import Activation, Answers, DeviceChannel, FrontChannel, Hop, Hops, Op, Stage, encode, joined, rows
from cakemp.streams import FrameReader
from cakemp.wire import Batch, FrameDecoder, RawTensor, Revision, TensorMessage, WorkerInfo, encode_frame

REVISION = Revision.V2
GATHER_S = 0.005  # how long the echo waits for its last step's sessions to come back (the device's least window)
_INFO = WorkerInfo("floor", "f32", platform.system().lower(), platform.machine(), "cpu", 0, 0)


class Floor:
    """The floor front and its echo device (answering after `busy_s` of busy work), started: the
    front's `port`, and both `pids` as "front" and "device" (bench/request_cost.py's names)."""

    def __init__(self, workdir: Path, busy_s: float, callbacks: bool = False):
        """`callbacks`: the front driven by callbacks (`serve_callbacks`), not by a task a connection."""
        context = multiprocessing.get_context("spawn")
        endpoint = f"ipc://{workdir}/floor{'-callbacks' if callbacks else ''}"
        ports = context.Queue()
        self._front = context.Process(target=serve_callbacks if callbacks else serve, args=(endpoint, ports),
                                      daemon=True)
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
    """The floor fronts' ZeroMQ side: each Batch's activation queued for the echo device (the requests of
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
        self._queued.append((Hop(0, request_id, x.dtype, data.nbytes, 0, 1, x.shape, (Stage(0, 0, (Op(0, 0, 0),)),)),
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
    """The floor front's process: listen on a free port (put on `ports`) until killed."""
    uvloop.run(_serve(endpoint, ports))


async def _serve(endpoint: str, ports: multiprocessing.Queue) -> None:
    loop = asyncio.get_running_loop()
    relay = _Relay(endpoint)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(reader, REVISION)
        while await frames.header() is not None:
            message = await frames.message()
            reply = _reply(message)
            if reply is None:
                relay.forward(message.x, (answered := loop.create_future()).set_result)
                reply = TensorMessage(RawTensor(await answered, message.x.dtype, message.x.shape))
            writer.writelines(encode_frame(reply, REVISION))
            if writer.transport.get_write_buffer_size():
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    ports.put(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


def serve_callbacks(endpoint: str, ports: multiprocessing.Queue) -> None:
    """The callback-driven floor front's process (the masters' frames are written whole at once: a
    master's next Batch comes after its reply, so no flow control is needed here)."""
    uvloop.run(_serve_callbacks(endpoint, ports))


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


async def _serve_callbacks(endpoint: str, ports: multiprocessing.Queue) -> None:
    relay = _Relay(endpoint)
    server = await asyncio.get_running_loop().create_server(lambda: _Connection(relay), "127.0.0.1", 0)
    ports.put(server.sockets[0].getsockname()[1])
    await asyncio.Event().wait()


async def _measure(counts: list[int], steps: int, rounds: int) -> dict[int, dict[str, float]]:
    """{count: {floor: its front's CPU µs per decode request}}, the two floors' windows taking turns."""
    from bench.pool import Session
    from bench.request_cost import FLOOR_BUSY_S, node_window  # (it imports this module: here, not at the top)

    figures: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        floors = {"tasks": Floor(Path(tmp), FLOOR_BUSY_S), "callbacks": Floor(Path(tmp), FLOOR_BUSY_S, callbacks=True)}
        try:
            for count in counts:
                sessions = {name: [await Session.open(floor.port, HIDDEN) for _ in range(count)]
                            for name, floor in floors.items()}
                for name, floor in floors.items():
                    await node_window(sessions[name], 5, floor.pids)  # warm-up
                spent = dict.fromkeys(floors, 0.0)
                for _ in range(rounds):
                    for name, floor in floors.items():
                        spent[name] += (await node_window(sessions[name], steps, floor.pids))["front (process)"]
                figures[count] = {name: seconds / (rounds * steps * count) * 1e6 for name, seconds in spent.items()}
                for session in (session for group in sessions.values() for session in group):
                    await session.close()
        finally:
            for floor in floors.values():
                floor.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="windows per count, the two floors taking turns")
    parser.add_argument("--steps", type=int, default=200, help="decode Batches per session per window")
    parser.add_argument("--counts", default="1,8,32", help="concurrent sessions to measure")
    args = parser.parse_args()
    from bench.request_cost import FLOOR_BUSY_S

    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    figures = asyncio.run(_measure([int(c) for c in args.counts.split(",")], args.steps, args.rounds))
    print(f"\nthe floor front's CPU µs per decode request (hidden {HIDDEN}, f32; its echo device busy "
          f"{FLOOR_BUSY_S * 1e3:g} ms a step), a task a connection against callbacks; {args.rounds} windows of "
          f"{args.steps} Batches a session")
    print("| sessions | tasks | callbacks | callbacks / tasks |")
    print("|---:|---:|---:|---:|")
    for count, cost in figures.items():
        print(f"| {count} | {cost['tasks']:.1f} | {cost['callbacks']:.1f} | {cost['callbacks'] / cost['tasks']:.2f} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


HIDDEN = 256  # the activation's width, as bench/request_cost.py's default model's

if __name__ == "__main__":
    main()
