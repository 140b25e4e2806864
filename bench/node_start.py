"""How long a node takes from `cakemp run` to listening, this tree against an earlier checkout.

    python -m bench.node_start --before DIR [--rounds 5] [--gpus cpu:2]

DIR is a checkout of an earlier commit (e.g. `git archive <commit> | tar -x -C DIR`). Writes a
small Llama checkpoint (2 layers, hidden 64, f32) and starts a node on it (`cakemp run --gpus
cpu:2 --dtype f32`) from each tree in turn (PYTHONPATH, run from the tree), --rounds times each:
the wall time from the command to its "listening" event (every device process spawned, torch
imported there and the layers loaded), and the CPU time the node's processes took to get there
(the front's and its devices', utime + stime from /proc, read before it is stopped). Printed: each
tree's median of both, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.pool import machine_line
from tests.support.checkpoints import make_checkpoint
from tests.support.node import children, write_topology

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start_once(tree: Path, model: Path, topology: Path, gpus: str) -> tuple[float, float]:
    """(wall seconds to "listening", CPU seconds of the node's processes by then) for one start from `tree`."""
    started = time.monotonic()
    node = subprocess.Popen([sys.executable, "-m", "cakemp", "run", "--model", str(model), "--topology", str(topology),
                             "--name", "worker", "--address", "127.0.0.1:0", "--gpus", gpus, "--dtype", "f32",
                             "--metrics-address", "127.0.0.1:0", "--log-format", "json"],
                            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in node.stdout:
            if '"listening"' in line and json.loads(line[line.find("{"):]).get("event") == "listening":
                wall = time.monotonic() - started
                return wall, sum(cpu_seconds(pid) for pid in {node.pid} | children(node.pid))
        raise RuntimeError(f"the node from {tree} exited before listening")
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
        topology = write_topology(Path(work) / "topology.yml", ["model.layers.0-1"])
        trees = {f"before ({args.before.name})": args.before.resolve(), "this tree": Path.cwd()}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(start_once(tree, model, topology, args.gpus))
    medians = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for name, r in runs.items()}
    print(f"--gpus {args.gpus}, 2 layers, medians of {args.rounds} starts each")
    for name, (wall, cpu) in medians.items():
        print(f"  {name}: {wall:.2f} s to listening, {cpu:.2f} s of CPU")
    (wall_before, cpu_before), (wall_after, cpu_after) = medians.values()
    print(f"this tree / before: wall {wall_after / wall_before:.2f}, CPU {cpu_after / cpu_before:.2f}")


if __name__ == "__main__":
    main()
