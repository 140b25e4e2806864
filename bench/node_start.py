"""How long a node takes from `cakemp run` to listening, this tree against an earlier checkout.

    python -m bench.node_start --before DIR [--rounds 5] [--gpus cpu:2]

DIR is a checkout of an earlier commit (e.g. `git archive <commit> | tar -x -C DIR`). Writes a
small Llama checkpoint (2 layers, hidden 64, f32) and starts a node on it (`cakemp run --gpus
cpu:2 --dtype f32`, bench/pool.start_cakemp) from each tree in turn, --rounds times each: the wall
time from the command until its port accepts a connection (polled every 0.1 s; every device
process spawned, torch imported there and the layers loaded), and the CPU time the node's
processes took to get there (the front's and its devices', bench/route.cpu_seconds). Printed:
each tree's median of both, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.pool import machine_line, start_cakemp
from bench.route import cpu_seconds
from tests.support.checkpoints import make_checkpoint


def start_once(tree: Path, model: Path, work: Path, gpus: str) -> tuple[float, float]:
    """(wall seconds until the node from `tree` accepts a connection, CPU seconds of its processes by then)."""
    started = time.monotonic()
    node, _ = start_cakemp(model, work, gpus, source=tree, layers=2)
    try:
        return time.monotonic() - started, cpu_seconds(node.pid)
    finally:
        node.kill()
        node.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpus", default="cpu:2")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as work:
        model = make_checkpoint(Path(work), "llama", num_hidden_layers=2)
        trees = {f"before ({args.before.name})": args.before.resolve(), "this tree": Path.cwd()}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(start_once(tree, model, Path(work), args.gpus))
    medians = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for name, r in runs.items()}
    print(f"--gpus {args.gpus}, 2 layers, medians of {args.rounds} starts each")
    for name, (wall, cpu) in medians.items():
        print(f"  {name}: {wall:.2f} s to listening, {cpu:.2f} s of CPU")
    (wall_before, cpu_before), (wall_after, cpu_after) = medians.values()
    print(f"this tree / before: wall {wall_after / wall_before:.2f}, CPU {cpu_after / cpu_before:.2f}")


if __name__ == "__main__":
    main()
