"""Cake masters spread over several processes, decoding through a node at once: its rate from outside.

One Python process of masters costs about 40-60 µs of CPU a token (the Cake codec, asyncio, the
client) on this project's 2-core VM: at the tens of thousands of tokens a second a GPU node is
meant to serve, one process of them would set the rate it measured. So `Masters` starts its
`count` masters (each a WorkerClient holding a session `cached` tokens in) in up to `processes`
spawned processes, and each `window` has every one decode for the same seconds, returning the
tokens done, the window's wall time and the CPU the masters spent.

Each decode step rewrites the row after the prompt, with two tokens taking turns, so a session's
context stays `cached` however fast the node goes and no row it sends is one prefix reuse kept.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import NamedTuple

import torch

from cakemp.compute import tensors
from cakemp.master.client import WorkerClient
from cakemp.wire import DType


class Window(NamedTuple):
    done: int  # decode steps the masters had answered
    wall_s: float  # the longest any process's window took
    cpu_s: float  # the masters' processes' CPU time in it


class Masters:
    def __init__(self, port: int, count: int, hidden: int, cached: int, layers: list[str], processes: int):
        """`count` masters over `layers` (each op's block_idx its index), in min(count, processes) processes,
        each having sent its `cached`-token prompt once started (in bf16, as to a bf16 node)."""
        self.processes = min(count, processes)
        context = multiprocessing.get_context("spawn")
        self._pipes, self._processes = [], []
        for group in range(self.processes):
            parent, child = context.Pipe()
            masters = count // self.processes + (group < count % self.processes)
            process = context.Process(target=_serve, args=(child, port, masters, hidden, cached, layers), daemon=True)
            process.start()
            self._pipes.append(parent)
            self._processes.append(process)
        for pipe in self._pipes:
            pipe.recv()  # connected, greeted, prompted

    def window(self, seconds: float) -> Window:
        """Every master decodes for `seconds`, all at once."""
        for pipe in self._pipes:
            pipe.send(seconds)
        results = [pipe.recv() for pipe in self._pipes]
        return Window(sum(done for done, _, _ in results), max(wall for _, wall, _ in results),
                      sum(cpu for _, _, cpu in results))

    def close(self) -> None:
        """Each process closes its connections and ends (one that does not within 30 s, or died, is killed)."""
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:  # that process is gone already
                pass
        for process in self._processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def _serve(pipe, port: int, count: int, hidden: int, cached: int, layers: list[str]) -> None:
    asyncio.run(_masters(pipe, port, count, hidden, cached, layers))


async def _masters(pipe, port: int, count: int, hidden: int, cached: int, layers: list[str]) -> None:
    loop = asyncio.get_running_loop()

    def ops(position: int) -> list[tuple[str, int, int]]:
        return [(name, position, i) for i, name in enumerate(layers)]

    clients = []
    for _ in range(count):  # each says Hello as it connects (a handshake place is held until then)
        clients.append(client := await WorkerClient.connect("127.0.0.1", port))
        await client.hello()
        await client.batch(tensors.to_raw(torch.randn(1, cached, hidden), DType.BF16), ops(0))
    tokens = [tensors.to_raw(torch.randn(1, 1, hidden), DType.BF16) for _ in range(2)]
    pipe.send("ready")
    while (seconds := await loop.run_in_executor(None, pipe.recv)) is not None:
        done = [0] * count
        start, cpu = time.perf_counter(), time.process_time()
        deadline = start + seconds

        async def decode(i: int) -> None:
            while time.perf_counter() < deadline:
                await clients[i].batch(tokens[done[i] % 2], ops(cached))
                done[i] += 1

        await asyncio.gather(*(decode(i) for i in range(count)))
        pipe.send((sum(done), time.perf_counter() - start, time.process_time() - cpu))
    for client in clients:
        await client.close()

