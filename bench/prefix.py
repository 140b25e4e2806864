"""Prefix reuse benchmark: a chat's second turn, with reuse and without, side by side in one run.

    python -m bench.prefix [--rounds 8] [--threads 1] [--history 1024] [--new 32]

Writes a random Llama checkpoint with TinyLlama-1.1B's layer shape (hidden 2048, intermediate
5632, 32 query heads on 4 kv heads of 64; 4 layers, f32) and starts two `cakemp run --gpus cpu:1`
nodes on it, each with the same --threads torch threads: one as it starts by default (prefix
reuse on) and one with --no-prefix-reuse. Each round, each node in turn (the order alternating
from round to round) serves one chat as a Cake master serving its API sends it, on a fresh set
of connections (one per layer, the run as one Batch on the first):

* turn 1: a prompt of --history minus --new rows from position 0 (the first prefill), then
  --new decode steps of one row each (the history is then --history rows), Goodbye;
* turn 2: the whole history and --new new rows from position 0 (the second prefill).

Each figure is the worker time as the master sees it: a Batch's round trip through the node
(TCP, front, ZeroMQ, device and back). Printed per node: the best first and second prefill over
the rounds and the median decode step; then the ratios of the reuse node to the other: the
second prefill (the target is <= 0.15), and the cost of keeping prefixes for a session alone,
its first prefill and decode steps (within 3%). The rows are random, so only the history a
turn sends again can be reused.

The same chats are then run in this process, through two BlockRunners over the same layers
(prefix reuse on and off), the prompt in the chunks the front cuts (--prefill-chunk's
default), the two alternating chat by chat: the bookkeeping's own cost, without the node's
transfers and a shared machine's noise around it.

One torch thread by default: on a small shared VM torch's intra-op threads stall whenever
another job takes a core (docs/benchmarks.md, Pool), which would drown a 3% comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from bench.pool import LAYERS, MAX_POSITIONS, free_port, machine_line, raw, start_cakemp
from cakemp.compute.runner import BlockRunner
from cakemp.front.router import chunk_bounds
from cakemp.ipc.spec import PREFILL_CHUNK
from cakemp.master.client import WorkerClient
from tests.support.checkpoints import make_checkpoint

HIDDEN = 2048
SHAPE = dict(hidden_size=HIDDEN, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
             num_hidden_layers=LAYERS, max_position_embeddings=MAX_POSITIONS)
REUSE, OFF = "reuse on", "--no-prefix-reuse"


def rows(count: int, seed: int) -> torch.Tensor:
    return torch.randn(1, count, HIDDEN, generator=torch.Generator().manual_seed(seed))


async def timed_batch(client: WorkerClient, x: torch.Tensor, index_pos: int) -> float:
    """Seconds for one Batch of x through every layer at index_pos."""
    ops = [(f"model.layers.{i}", index_pos, i) for i in range(LAYERS)]
    start = time.perf_counter()
    await client.batch(raw(x), ops)
    return time.perf_counter() - start


async def chat(port: int, history: int, new: int, seed: int) -> dict[str, list[float]]:
    """One two-turn chat on fresh connections: seconds of its first prefill, decode steps, second prefill."""
    clients = []
    for _ in range(LAYERS):
        client = await WorkerClient.connect("127.0.0.1", port)
        await client.hello()
        clients.append(client)
    prompt, decoded = rows(history - new, seed), rows(new, seed + 1)
    first = await timed_batch(clients[0], prompt, 0)
    decode = [await timed_batch(clients[0], decoded[:, i:i + 1], history - new + i) for i in range(new)]
    for client in clients:
        await client.goodbye()
    second = await timed_batch(clients[0], torch.cat([prompt, decoded, rows(new, seed + 2)], dim=1), 0)
    for client in clients:
        await client.close()
    return {"first": [first], "decode": decode, "second": [second]}


async def rounds(ports: dict[str, int], count: int, history: int, new: int) -> dict[str, dict[str, list[float]]]:
    times = {name: {"first": [], "decode": [], "second": []} for name in ports}
    names = list(ports)
    for r in range(count):
        for name in names if r % 2 == 0 else reversed(names):
            for kind, values in (await chat(ports[name], history, new, seed=10 * r)).items():
                times[name][kind] += values
    return times


def in_process(model: Path, threads: int, count: int, history: int, new: int) -> dict[str, dict[str, list[float]]]:
    """The chats of `rounds` through two runners in this process, reuse on and off, alternating."""
    torch.set_num_threads(threads)
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    runners = {name: BlockRunner.load(model, layers, "cpu", torch.float32, prefix_reuse=name == REUSE)
               for name in (REUSE, OFF)}

    def prompt(runner: BlockRunner, x: torch.Tensor) -> float:
        start = time.perf_counter()
        for a, b in chunk_bounds(x.shape[1], PREFILL_CHUNK):
            runner.run(1, x[:, a:b], runner.ops([(layer, a, i) for i, layer in enumerate(layers)]))
        return time.perf_counter() - start

    def decode(runner: BlockRunner, x: torch.Tensor, index_pos: int) -> float:
        start = time.perf_counter()
        runner.run(1, x, runner.ops([(layer, index_pos, i) for i, layer in enumerate(layers)]))
        return time.perf_counter() - start

    times = {name: {"first": [], "decode": [], "second": []} for name in runners}
    for r in range(count):
        for name in list(runners) if r % 2 == 0 else reversed(list(runners)):
            runner, t = runners[name], times[name]
            first, decoded = rows(history - new, 10 * r), rows(new, 10 * r + 1)
            t["first"].append(prompt(runner, first))
            t["decode"] += [decode(runner, decoded[:, i:i + 1], history - new + i) for i in range(new)]
            runner.clear_session(1)
            t["second"].append(prompt(runner, torch.cat([first, decoded, rows(new, 10 * r + 2)], dim=1)))
            runner.free_session(1)
    return times


def summary(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """ms: the best first and second prefill, the median decode step, by node."""
    return {name: {"first": min(t["first"]) * 1e3, "decode": statistics.median(t["decode"]) * 1e3,
                   "second": min(t["second"]) * 1e3} for name, t in times.items()}


def print_figures(figures: dict[str, dict[str, float]]) -> None:
    print("| runs | first prefill (best, ms) | decode step (median, ms) | second prefill (best, ms) |")
    print("|---|---:|---:|---:|")
    for name, f in figures.items():
        print(f"| {name} | {f['first']:.1f} | {f['decode']:.2f} | {f['second']:.1f} |")
    on, no = figures[REUSE], figures[OFF]
    print(f"second prefill, reuse / off: {on['second'] / no['second']:.3f} (target <= 0.15)")
    print(f"keeping prefixes, reuse / off: first prefill {on['first'] / no['first']:.3f}, "
          f"decode step {on['decode'] / no['decode']:.3f} (target within 3%)")


def reused_tokens(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("cakemp_prefix_reused_tokens_total{"):
                return float(line.split()[-1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="chats per node")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each node's device")
    parser.add_argument("--history", type=int, default=1024, help="rows of history turn 2 sends again")
    parser.add_argument("--new", type=int, default=32, help="generated rows of turn 1, new rows of turn 2")
    args = parser.parse_args()
    print(machine_line())
    threads = ("--cpu-threads", str(args.threads))
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_checkpoint(work, "llama", **SHAPE)
        try:
            metrics_port = free_port()
            reuse, reuse_port = start_cakemp(model, work, "cpu:1", *threads,
                                             "--metrics-address", f"127.0.0.1:{metrics_port}")
            processes.append(reuse)
            off, off_port = start_cakemp(model, work, "cpu:1", *threads, "--no-prefix-reuse")
            processes.append(off)
            times = asyncio.run(rounds({REUSE: reuse_port, OFF: off_port}, args.rounds, args.history, args.new))
            reused = reused_tokens(metrics_port)
        finally:
            for process in processes:
                process.terminate()
                process.wait()
        print(f"\n{LAYERS} layers, TinyLlama shape (hidden {HIDDEN}), f32, {args.threads} torch thread(s) per node; "
              f"{args.rounds} chats per node, alternating; turn 1 {args.history - args.new} rows + {args.new} decode "
              f"steps, turn 2 {args.history} + {args.new} rows; positions reused on the reuse node: {reused:g}")
        print_figures(summary(times))
        print(f"load average {os.getloadavg()[0]:.1f}; in this process, the same chats through BlockRunner:")
        print_figures(summary(in_process(model, args.threads, args.rounds, args.history, args.new)))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
