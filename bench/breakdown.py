"""Where a decode Batch's time goes on `cakemp run --gpus cpu:2`: `python -m bench.route --breakdown`.

Starts, side by side in one run: bench/single_worker.py (the same 8 layers in one process, one
torch thread), `cakemp run --gpus cpu:2 --cpu-threads 1` with CAKEMP_TRACE set (its front and
devices stamp each request's stages with the monotonic clock: cakemp/ipc/trace.py), and a bare
ZeroMQ echo between two processes (PAIR sockets over ipc://, blocking calls, the [1, 1, 1024]
f32 activation's 4 KiB each way: the floor of one round trip between processes; also after
both ends slept 10 ms, as a device sleeps while the other computes), and the node's two halves
(layers 0-3, 4-7) computed in the bench's own process. They take turns in blocks of decode
steps; the master stamps each Batch as it sends it and as the reply arrives, with the same
clock. Printed: the median of each stage over the node's steps, the round trips (node,
single process, echoes) and the halves' compute, the node's extra over the single process,
and that extra in echo round trips (the target: at most 2). Then 512-token prompts, the node
and the single process in turns: each prompt's time over the single process's in its round.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import zmq

from bench.pool import pct, start_single
from bench.route_node import HIDDEN, LAYERS, Master, start_node
from cakemp.compute.runner import BlockRunner
from cakemp.ipc import trace

ECHO_BYTES = HIDDEN * 4
IDLE_S = 0.01  # about one device's decode step here: how long a device sleeps before its hop comes


def bare_echo(endpoint: str) -> None:
    """The echo process: every message straight back (blocking PAIR socket)."""
    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.connect(endpoint)
    while True:
        socket.send(socket.recv(copy=False), copy=False)


class InProcess:
    """The node's two halves (layers 0-3, 4-7) computed in this process, one torch thread: each half's µs."""

    def __init__(self, model: Path):
        torch.set_num_threads(1)
        self.halves = [BlockRunner.load(model, [f"model.layers.{i}" for i in range(first, first + 4)], "cpu",
                                        torch.float32) for first in (0, 4)]
        self.position = 0

    def step(self) -> list[float]:
        if self.position >= 4000:
            for runner in self.halves:
                runner.free_session(1)
            self.position = 0
        x, spent = torch.randn(1, 1, HIDDEN), []
        with torch.inference_mode():
            for runner in self.halves:
                start = time.perf_counter()
                x = runner.run(1, x, runner.ops([(layer, self.position, i) for i, layer in enumerate(runner.layers)]))
                spent.append((time.perf_counter() - start) * 1e6)
        self.position += 1
        return spent


class Echo:
    """The parent's end of the bare echo: one round trip per call, in µs."""

    def __init__(self, workdir: Path):
        self.socket = zmq.Context.instance().socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{workdir}/bare-echo"
        self.socket.bind(endpoint)
        self.child = multiprocessing.get_context("spawn").Process(target=bare_echo, args=(endpoint,), daemon=True)
        self.child.start()
        self.body = bytes(ECHO_BYTES)
        self.round_trip()  # the child is connected

    def round_trip(self, idle_s: float = 0.0) -> float:
        """µs of one round trip, after both ends have slept `idle_s` (as a device does while another computes)."""
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        self.socket.send(self.body, copy=False)
        self.socket.recv(copy=False)
        return (time.perf_counter() - start) * 1e6

    def close(self) -> None:
        self.child.terminate()
        self.child.join()
        self.socket.close()


async def decode_rounds(masters: dict, echo: Echo, local: InProcess, steps: int, block: int) -> tuple[dict, list]:
    """Round trips in µs of every worker and of the echo, and each half's compute in this process,
    blocks of `block` taking turns; and the traced node's (sent, got) master stamps of each of its
    steps, in order."""
    times: dict[str, list[float]] = {name: [] for name in (*masters, "echo", "echo after idle", "half 0", "half 1")}
    sent_got: list[tuple[int, int]] = []
    for _ in range(steps // block):
        for name, master in masters.items():
            for _ in range(block):
                sent = trace.now()
                await master.batch(1)
                got = trace.now()
                times[name].append((got - sent) / 1e3)
                if name == "node":
                    sent_got.append((sent, got))
        times["echo"] += [echo.round_trip() for _ in range(block)]
        times["echo after idle"] += [echo.round_trip(IDLE_S) for _ in range(block)]
        for _ in range(block):
            for half, spent in enumerate(local.step()):
                times[f"half {half}"].append(spent)
    return times, sent_got


async def measure(ports: dict[str, int], model: Path, workdir: Path, steps: int, block: int, prompts: int):
    masters = {name: await Master.open(port) for name, port in ports.items()}
    for master in masters.values():  # warm-up: a prompt and a few steps
        await master.prompt()
        for _ in range(5):
            await master.batch(1)
    echo, local = Echo(workdir), InProcess(model)
    try:
        for _ in range(block):
            echo.round_trip()
            local.step()
        times, sent_got = await decode_rounds(masters, echo, local, steps, block)
    finally:
        echo.close()
    prompt_ms = {name: [] for name in masters}
    for _ in range(prompts):
        for name, master in masters.items():
            prompt_ms[name].append(await master.prompt() * 1e3)
    for master in masters.values():
        await master.client.close()
    return times, sent_got, prompt_ms


def stages(lines: list[list[int]], sent_got: list[tuple[int, int]]) -> dict[str, list[float]]:
    """µs of each stage of each traced decode step: master send to front read, then each stamp to the
    next, then the front's write to the master's read."""
    names = ["master sent", *trace.stamp_names(len(lines[0])), "master got"]
    spans: dict[str, list[float]] = {f"{a} → {b}": [] for a, b in zip(names, names[1:])}
    for stamps, (sent, got) in zip(lines, sent_got, strict=True):
        full = [sent, *stamps, got]
        for key, a, b in zip(spans, full, full[1:]):
            spans[key].append((b - a) / 1e3)
    return spans


def run(model: Path, workdir: Path, steps: int, block: int, prompts: int, extra: tuple[str, ...] = ()) -> None:
    trace_path = workdir / "trace.txt"
    single, single_port = start_single(model, threads=1, layers=LAYERS)
    os.environ[trace.ENV] = str(trace_path)
    try:
        node, node_port = start_node(model, workdir, Path(__file__).resolve().parent.parent, *extra)
    finally:
        del os.environ[trace.ENV]
    try:
        times, sent_got, prompt_ms = asyncio.run(
            measure({"single": single_port, "node": node_port}, model, workdir, steps, block, prompts))
    finally:
        node.send_signal(signal.SIGTERM)  # the front writes out its trace file as it stops
        single.terminate()
        node.wait()
        single.wait()
    lines = [[int(v) for v in line.split()] for line in trace_path.read_text().splitlines()]
    end = len(lines) - prompts  # one line per Batch: the warm-up, the decode steps, then the prompts
    decode_lines = lines[end - len(sent_got):end]
    print_table(stages(decode_lines, sent_got), times, steps, block, extra)
    print_prompts(prompt_ms)


def print_table(spans: dict[str, list[float]], times: dict[str, list[float]], steps: int, block: int,
                extra: tuple[str, ...]) -> None:
    print(f"\ndecode Batch [1, 1, {HIDDEN}] f32 through 8 layers; node: cakemp run --gpus cpu:2 --cpu-threads 1 "
          f"{' '.join(extra)} (4 layers per device process), traced; {steps} steps each, blocks of {block}, "
          "single process, node and bare echo taking turns")
    print("| stage | median µs | p90 µs |\n|---|---:|---:|")
    for name, values in spans.items():
        print(f"| {name} | {statistics.median(values):.0f} | {pct(values, 90):.0f} |")
    compute = sum(statistics.median(v) for k, v in spans.items() if "stepping →" in k)
    node, single, echo = (statistics.median(times[name]) for name in ("node", "single", "echo"))
    print(f"| sum of the stage medians | {sum(statistics.median(v) for v in spans.values()):.0f} | |")
    print("\n| round trip | median µs | p90 µs |\n|---|---:|---:|")
    for name, label in (("node", "node (traced), cpu:2"), ("single", "single process (8 layers, TCP)"),
                        ("echo", "bare ZeroMQ ipc echo"),
                        ("echo after idle", f"bare ZeroMQ ipc echo, both ends asleep {IDLE_S * 1e3:g} ms before"),
                        ("half 0", "in this process: layers 0-3 (d0's)"),
                        ("half 1", "in this process: layers 4-7 (d1's)")):
        print(f"| {label} | {statistics.median(times[name]):.0f} | {pct(times[name], 90):.0f} |")
    local = statistics.median(times["half 0"]) + statistics.median(times["half 1"])
    print(f"node's device steps (both devices' stepping → stepped): {compute:.0f} µs, against {local:.0f} µs for "
          f"the same layers in this process; the rest of the node's round trip: {node - compute:.0f} µs")
    idle = statistics.median(times["echo after idle"])
    print(f"decode extra over one process: {node - single:+.0f} µs = {(node - single) / echo:.2f} echo round trips "
          f"(target <= 2); {(node - single) / idle:.2f} round trips of the echo after idling")


def print_prompts(prompt_ms: dict[str, list[float]]) -> None:
    if not prompt_ms["node"]:
        return
    ratios = [n / s for n, s in zip(prompt_ms["node"], prompt_ms["single"])]
    print(f"\n512-token prompt, node / single process, each round: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f} (target <= 0.60); "
          f"ms median: node {statistics.median(prompt_ms['node']):.0f}, single {statistics.median(prompt_ms['single']):.0f}")
