"""CPU devices: one device process using every core (`--gpus cpu`) against one per core (`--gpus cpu:N`).

    python -m bench.cpu_devices [--seconds 4] [--rounds 3] [--sessions 1,2,4]

Writes a random Llama checkpoint (4 layers, hidden 1024, f32, as bench/pool.py's concurrency
part) and starts, side by side, `cakemp run --gpus cpu` (one device process, its torch threads
one per core, the default) and `cakemp run --gpus cpu:N` for N the cores (layers split into
contiguous runs, one torch thread each, the default), and `--gpus cpu --cpu-threads 1` (one
process, one thread: what the threads alone change). For each count of Cake-style masters
decoding at once (bench.pool.Session: a connection per layer, one Batch through all 4 layers per
token), each node in turn serves them for --seconds; the rounds alternate the nodes, and each
cell is the median of the rounds. Printed: aggregate decode steps/s of each, and its ratio to
`--gpus cpu`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from bench.pool import LAYERS, MAX_POSITIONS, machine_line, start_cakemp, throughput
from tests.support.checkpoints import make_checkpoint

HIDDEN = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="wall window per (sessions, node)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the nodes; cells are medians")
    parser.add_argument("--sessions", default="1,2,4", help="masters decoding at once")
    args = parser.parse_args()
    cores = os.cpu_count()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_checkpoint(work, "llama", hidden_size=HIDDEN, intermediate_size=2816, num_attention_heads=16,
                                num_key_value_heads=4, num_hidden_layers=LAYERS, max_position_embeddings=MAX_POSITIONS)
        nodes = {}
        variants = {"--gpus cpu": ("cpu",), f"--gpus cpu:{cores}": (f"cpu:{cores}",),
                    "--gpus cpu --cpu-threads 1": ("cpu", "--cpu-threads", "1")}
        try:
            for name, flags in variants.items():
                nodes[name] = start_cakemp(model, work, *flags)
            print(f"\n{LAYERS} layers, hidden {HIDDEN}, f32; {args.seconds:g} s per cell, median of {args.rounds} round(s)")
            for count in (int(c) for c in args.sessions.split(",")):
                rates = {name: [] for name in nodes}
                for _ in range(args.rounds):
                    for name, (_, port) in nodes.items():
                        rates[name].append(asyncio.run(throughput(port, HIDDEN, count, args.seconds)))
                medians = {name: statistics.median(values) for name, values in rates.items()}
                base = medians["--gpus cpu"]
                print(f"  {count} master(s): " + ", ".join(f"{name} {rate:.1f} steps/s ({rate / base:.2f}x)"
                                                           for name, rate in medians.items()), flush=True)
        finally:
            for process, _ in nodes.values():
                process.terminate()
                process.wait()


if __name__ == "__main__":
    main()
