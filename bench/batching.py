"""Batching benchmark: aggregate decode rate of several sessions sharing one device.

    python -m bench.batching [--seconds 4] [--rounds 1] [--counts 1,2,4,8,16] [--threads 1]
                             [--before DIR] [--steps 200] [--prefills 3] [--packing] [--in-process]

Writes a random Llama checkpoint with TinyLlama-1.1B's layer shape (hidden 2048, intermediate
5632, 32 query heads on 4 kv heads of 64; 4 layers, f32, ~0.7 GB) and starts, side by side in
one run, each with the same --threads torch threads:

* the single-process worker (bench/single_worker.py: Cake's design, each connection's step
  computed on its own, inline; weights plain);
* `cakemp run --gpus cpu:1 --max-batch 1` (cakemp computing each request alone);
* `cakemp run --gpus cpu:1` (batching: every waiting decode step in one step of the device).

Both nodes keep f32 matrices packed for MKL's GEMM where that costs at most 1.1x their bytes
(cakemp/model/weights/packed.py): at this shape, none.

For each count of sessions (--counts), each worker in turn serves that many Cake-style
masters (bench.pool.Session: a connection per layer, an 8-token prompt, then one Batch through
all 4 layers per token), all decoding at once: one warm-up step each, all together, then
tokens/s over a --seconds wall window (every step finished, over the time until the last one
finished); with --rounds R, R passes through every count, each cell the median of its R
rates. Printed per count: each worker's aggregate tokens/s, the batched node's mean requests
per device step in its windows (from its /metrics), and the ratios: batched / its own
1-session rate (the target is >= 4x at 8 sessions), batched / --max-batch 1, batched / single
process.

With --before DIR (a git worktree of the commit before batching, e.g. `git worktree add
--detach ../before-15 92002a9`), `cakemp run --gpus cpu:1` from DIR (PYTHONPATH=DIR, no
--max-batch: it has none) and this tree's node each serve one session, alternating in blocks
of 20 decode steps (--steps each), then in turns --prefills prompts of 512 tokens each, each
node's first block a warm-up; ratios are medians over rounds (a block of each node, back to
back). A session alone must be no slower than before (5% allowed).

With --packing, the same layers are also loaded into this process twice, plain and as a node
loads them (`pack_weights`, cakemp/model/weights/packed.py), and one session's decode steps (--steps) and 128-token prompt chunks
(--prefills; the piece of a prompt a device runs per step) through BlockRunner.run are
timed, the two alternating (bench/packed_weights.py compares shapes where packing is used).

With --in-process, the batched computation alone: BlockRunner.run_batch in this process, loaded
as the batched node loads it, over each count's sessions' one-token requests at
once, step after step for --seconds; and the batched node's rate over it (the target: >= 0.85x
at 8 sessions).

One torch thread by default: on a small shared VM, torch's intra-op threads stall whenever
another job takes a core (docs/benchmarks.md, Pool), which would drown the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from bench.pool import (
    LAYERS,
    MAX_POSITIONS,
    Session,
    alternate,
    free_port,
    machine_line,
    start_cakemp,
    start_single,
    throughput,
)
from cakemp.compute.runner import BlockRunner, Request
from tests.support.checkpoints import make_checkpoint

HIDDEN = 2048
SHAPE = dict(hidden_size=HIDDEN, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
             num_hidden_layers=LAYERS, max_position_embeddings=MAX_POSITIONS)
BLOCK = 20  # decode steps per block when the before-node and this tree's alternate
PROMPT = 512
CHUNK = 128  # cakemp run's default --prefill-chunk: the piece of a prompt a device runs per step
SINGLE, ALONE, BATCHED = "single process", "cakemp --max-batch 1", "cakemp batched"


def batch_size_totals(metrics_port: int) -> tuple[float, float]:
    """(requests run, steps run) summed over the node's devices, from cakemp_device_batch_size
    (0, 0 where the node has no such metric: a tree before batching, or no step run yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for suffix in totals:
            if name.startswith(f"cakemp_device_batch_size{suffix}{{"):
                totals[suffix] += float(value)
    return totals["_sum"], totals["_count"]


def sweep(ports: dict[str, int], metrics_port: int, counts: list[int], seconds: float, rounds: int) -> tuple[dict, dict]:
    """{count: {worker: median tokens/s}} over `rounds` passes through every count, and {count:
    mean requests per step of the batched node in its windows} (absent where it has no batch metrics)."""
    rates = {count: {name: [] for name in ports} for count in counts}
    readings = {count: [] for count in counts}  # the batched node's (requests, steps) as each window opens and closes
    for _ in range(rounds):
        for count in counts:
            for name, port in ports.items():
                mark = (lambda: readings[count].append(batch_size_totals(metrics_port))) if name == BATCHED else None
                rates[count][name].append(asyncio.run(throughput(port, HIDDEN, count, seconds, mark or (lambda: None))))
                print(f"  {count} session(s), {name}: {rates[count][name][-1]:.1f} tokens/s", flush=True)
    medians = {count: {name: statistics.median(values) for name, values in row.items()} for count, row in rates.items()}
    per_step = {}
    for count, marks in readings.items():
        requests, steps = (sum(close[i] - open_[i] for open_, close in zip(marks[::2], marks[1::2])) for i in (0, 1))
        if steps:
            per_step[count] = requests / steps
    return medians, per_step


def in_process(model: Path, threads: int, counts: list[int], seconds: float) -> dict[int, float]:
    """{count: tokens/s} of BlockRunner.run_batch in this process, as the batched node loads it, over
    `count` sessions' one-token requests at once, step after step for `seconds` (after an 8-token
    prompt each, as the masters send): the same batched computation, without front, ZeroMQ or TCP."""
    torch.set_num_threads(threads)
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    runner = BlockRunner.load(model, layers, "cpu", torch.float32, pack_weights=True, prefix_reuse=True)
    rates = {}
    for count in counts:
        sessions = range(1, count + 1)
        with torch.inference_mode():
            for session in sessions:
                runner.free_session(session)
                runner.run(session, torch.randn(1, 8, HIDDEN), runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
            steps, position = 0, 8
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                ops = runner.ops([(layer, position, i) for i, layer in enumerate(layers)])
                runner.run_batch([Request(session, torch.randn(1, 1, HIDDEN), ops) for session in sessions])
                steps, position = steps + 1, position + 1
            rates[count] = steps * count / (time.perf_counter() - start)
        for session in sessions:
            runner.free_session(session)
    return rates


def in_ms(times: dict[str, list[float]]) -> dict[str, list[float]]:
    return {name: [t / 1e3 for t in values] for name, values in times.items()}


async def alone(ports: dict[str, int], steps: int, prefills: int) -> tuple[dict, dict]:
    """One session per node, alternating: decode step times and 512-token prompt times, in ms."""
    sessions = {name: await Session.open(port, HIDDEN) for name, port in ports.items()}
    decode = await alternate({name: lambda i, s=session: s.step() for name, session in sessions.items()},
                             steps, 0.0, BLOCK)
    prefill = await alternate({name: lambda i, s=session: s.restart(PROMPT) for name, session in sessions.items()},
                              prefills, 0.0, 1)
    for session in sessions.values():
        await session.close()
    return in_ms(decode), in_ms(prefill)


async def packing(model: Path, threads: int, steps: int, chunks: int) -> tuple[dict, dict]:
    """In this process, one session through BlockRunner.run with the f32 weights plain and as a node
    loads them (packed where that costs little): decode step and 128-token prompt chunk times in ms,
    the two alternating."""
    torch.set_num_threads(threads)
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    runners = {f"weights {'packed' if pack else 'plain'}": BlockRunner.load(model, layers, "cpu", torch.float32,
                                                                            pack_weights=pack) for pack in (False, True)}

    def way(runner: BlockRunner, tokens: int) -> Callable[[int], Awaitable[None]]:
        """Call i: a decode step at position i (tokens 1), or a chunk at position 0 of a cleared session."""
        async def run(i: int) -> None:
            if tokens > 1 or i == 0:
                runner.free_session(1)
            position = i if tokens == 1 else 0
            with torch.inference_mode():
                runner.run(1, torch.randn(1, tokens, HIDDEN), runner.ops([(layer, position, n) for n, layer in enumerate(layers)]))
        return run

    decode = await alternate({name: way(runner, 1) for name, runner in runners.items()}, steps, 0.0, BLOCK)
    chunk = await alternate({name: way(runner, CHUNK) for name, runner in runners.items()}, chunks, 0.0, 1)
    return in_ms(decode), in_ms(chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="wall window per (count, worker)")
    parser.add_argument("--rounds", type=int, default=1, help="passes through every count; cells are medians")
    parser.add_argument("--counts", default="1,2,4,8,16", help="concurrent sessions to measure")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every worker's compute")
    parser.add_argument("--before", type=Path, help="checkout of the commit before batching (a git worktree)")
    parser.add_argument("--steps", type=int, default=200, help="decode steps of each node alone (with --before)")
    parser.add_argument("--prefills", type=int, default=3, help="512-token prompts of each node alone (with --before)")
    parser.add_argument("--in-process", action="store_true",
                        help="also the batched node's computation alone: BlockRunner.run_batch in this process over the "
                             "same sessions' one-token requests, and the node's rate over it")
    parser.add_argument("--packing", action="store_true",
                        help="also time one session in this process with the weights plain and packed (--steps, --prefills)")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    print(machine_line())
    threads = ("--cpu-threads", str(args.threads))
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_checkpoint(work, "llama", **SHAPE)
        try:
            single, single_port = start_single(model, threads=args.threads)
            metrics_port = free_port()
            batched, batched_port = start_cakemp(model, work, "cpu:1", *threads,
                                                 "--metrics-address", f"127.0.0.1:{metrics_port}")
            unbatched, unbatched_port = start_cakemp(model, work, "cpu:1", *threads, "--max-batch", "1")
            processes += [single, batched, unbatched]
            ports = {SINGLE: single_port, ALONE: unbatched_port, BATCHED: batched_port}
            print(f"\n{LAYERS} layers, TinyLlama shape (hidden {HIDDEN}), f32, {args.threads} torch thread(s) each; "
                  f"{args.seconds:g} s per cell, median of {args.rounds} round(s); each cell's sessions started together "
                  "after an 8-token prompt and a warm-up step")
            rates, batch = sweep(ports, metrics_port, counts, args.seconds, args.rounds)
            if args.before is not None:
                before, before_port = start_cakemp(model, work, "cpu:1", *threads, source=args.before.resolve())
                processes.append(before)
                decode, prefill = asyncio.run(alone({f"before ({args.before.name})": before_port,
                                                     "this tree": batched_port}, args.steps, args.prefills))
        finally:
            for process in processes:
                process.terminate()
                process.wait()
        if args.packing:
            packed_decode, packed_chunk = asyncio.run(packing(model, args.threads, args.steps, args.prefills))
        if args.in_process:
            local = in_process(model, args.threads, counts, args.seconds)
    print_sweep(rates, batch, counts)
    if args.in_process:
        print(f"\nthe batched node against BlockRunner.run_batch in this process (loaded as the node, {args.threads} torch "
              f"thread(s)) over the same sessions' one-token requests, {args.seconds:g} s each")
        print(f"| sessions | in-process tokens/s | {BATCHED} | node / in-process |\n|---:|---:|---:|---:|")
        for count in counts:
            print(f"| {count} | {local[count]:.1f} | {rates[count][BATCHED]:.1f} | "
                  f"{rates[count][BATCHED] / local[count]:.2f}x |")
    if args.before is not None:
        print_alone(decode, prefill, args)
    if args.packing:
        print_packing(packed_decode, packed_chunk, args)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def print_sweep(rates: dict, batch: dict, counts: list[int]) -> None:
    first = rates[counts[0]][BATCHED]
    print(f"\naggregate decode tokens/s; ratios of the batched node (its own rate at {counts[0]} session(s) first)")
    print(f"| sessions | {SINGLE} | {ALONE} | {BATCHED} | requests per step | batched / own {counts[0]}-session | "
          f"batched / {ALONE} | batched / single |")
    print("|---:|" + "---:|" * 7)
    for count in counts:
        row = rates[count]
        per_step = f"{batch[count]:.2f}" if count in batch else "-"
        print(f"| {count} | {row[SINGLE]:.1f} | {row[ALONE]:.1f} | {row[BATCHED]:.1f} | {per_step} | "
              f"{row[BATCHED] / first:.2f}x | {row[BATCHED] / row[ALONE]:.2f}x | {row[BATCHED] / row[SINGLE]:.2f}x |")


def print_alone(decode: dict, prefill: dict, args) -> None:
    print(f"\none session alone, the two nodes alternating: {args.steps} decode steps each in blocks of {BLOCK}, "
          f"{args.prefills} prompts of {PROMPT} tokens each (after one warm-up block of each)")
    print("| node | decode p50 ms | decode tokens/s | prefill 512 median ms |\n|---|---:|---:|---:|")
    for name in decode:
        print(f"| {name} | {statistics.median(decode[name]):.1f} | {len(decode[name]) / sum(decode[name]) * 1e3:.2f} "
              f"| {statistics.median(prefill[name]):.0f} |")
    old, new = decode
    # Per round (a block of each node, back to back), so that drift of the machine cancels out.
    blocks = [(sum(decode[old][i:i + BLOCK]), sum(decode[new][i:i + BLOCK])) for i in range(0, len(decode[new]), BLOCK)]
    print(f"decode tokens/s, this tree / before: {statistics.median(o / n for o, n in blocks):.3f}x "
          f"(median over {len(blocks)} rounds; the target: >= 0.95x)")
    print(f"prefill time, this tree / before: "
          f"{statistics.median(n / o for o, n in zip(prefill[old], prefill[new])):.3f}x "
          f"(median over {len(prefill[new])} rounds; the target: <= 1.05x)")


def print_packing(decode: dict, chunk: dict, args) -> None:
    print(f"\none session in this process (BlockRunner.run, {args.threads} torch thread(s)), weights plain and "
          f"packed alternating: {args.steps} decode steps each in blocks of {BLOCK}, {args.prefills} chunks of "
          f"{CHUNK} tokens each (after one warm-up block of each)")
    print(f"| weights | decode p50 ms | {CHUNK}-token chunk median ms |\n|---|---:|---:|")
    for name in decode:
        print(f"| {name} | {statistics.median(decode[name]):.1f} | {statistics.median(chunk[name]):.0f} |")
    plain, packed = decode
    print(f"packed / plain: decode {statistics.median(decode[packed]) / statistics.median(decode[plain]):.3f}x, "
          f"{CHUNK}-token chunk {statistics.median(chunk[packed]) / statistics.median(chunk[plain]):.3f}x (time)")


if __name__ == "__main__":
    main()
