"""Step host benchmark: the host's work per request around a batched decode step's compute, as a GPU
pays it, this tree against an earlier checkout, side by side in one run.

    python -m bench.step_host --before DIR [--layers 4,16] [--counts 1,8,32] [--steps 64] [--rounds 3]
                              [--prefix-reuse] [--paged]

On a GPU a decode step's compute is one CUDA graph's replay (compute/decode_graph.py), launched in
microseconds; what the device's CPU does around it, per request, is what bounds its rate: checking
each request, planning its slots, building the step's positions, slot ids and tables, advancing its
slots after. This measures that work on a CPU, where the same fixed-shape step runs without a graph:
`BlockRunner.run_batch` over a random tiny Llama (hidden 64, 4 query heads on 2 kv heads of 16,
--layers layers, f32, one torch thread) loaded with decode graphs (`graph_batch` 32) and a KV budget
as a GPU's device loads it, each of N sessions 16 tokens in, stepping every session once a step; the
fixed-shape step's own compute (`DecodeGraph._compute`, what a replay does on a GPU) is timed apart and
taken out; and again with that compute skipped (the step's input returned as its output), where the
host's work runs warm, as beside a GPU, not after a CPU's compute has evicted it from the caches.
Figures are CPU µs per request (process time), the rest of `run_batch`, before -> now; a step's requests
cross into a new KV block every 16 steps, as a decode's do, so --steps is best a multiple of 16.

With --paged, the runner is loaded without decode graphs, as a CPU device loads it: its steps are the
paged step (compute/paged_step.py), whose compute is not apart, and the figure is run_batch's whole CPU
per request.

DIR is a checkout of an earlier commit (`git worktree add DIR <commit>`). One child process per tree
and layer count, each importing its own tree's cakemp (PYTHONPATH); the children take turns, --rounds
each, and each figure is the median of its rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.block_step import start_child
from bench.pool import REUSE_BUDGET, machine_line
from bench.step_growth import SHAPES
from tests.support.checkpoints import make_checkpoint

GRAPH_BATCH = 32  # the most requests a fixed-shape step takes (--max-batch's default)
CACHED = 16  # tokens each session holds before its decode steps

# What each child runs, with only the APIs both trees have: one line on stdin (sessions and steps) ->
# one line on stdout (the steps' CPU seconds, then the fixed-shape compute's within them).
CHILD = """
import sys, time, torch
from cakemp.compute import decode_graph
from cakemp.compute.runner import BlockRunner, Request
torch.set_num_threads(1)
layers = [f"model.layers.{i}" for i in range({layers})]
runner = BlockRunner.load(sys.argv[1], layers, "cpu", torch.float32, kv_budget_bytes={budget},
                          prefix_reuse={reuse}, graph_batch={graph_batch})  # (None: the paged step)
hidden = runner.config.hidden_size
computed = [0.0]
compute = decode_graph.DecodeGraph._compute
def timed(graph):
    start = time.process_time()
    try:
        return compute(graph)
    finally:
        computed[0] += time.process_time() - start
def replay(graph):
    return graph.x  # a CUDA graph's replay leaves the CPU nothing to compute
print("ready", flush=True)
for line in sys.stdin:
    sessions, steps, skip = map(int, line.split())
    decode_graph.DecodeGraph._compute = replay if skip else timed
    for s in range(sessions):
        runner.free_session(s)
        runner.run(s, torch.randn(1, {cached}, hidden), runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
    xs = torch.randn(steps, sessions, 1, 1, hidden)
    batches = []  # made before the clock starts: only run_batch is timed
    for step in range(steps):
        ops = runner.ops([(layer, {cached} + step, i) for i, layer in enumerate(layers)])
        # Each row's bytes ride along, as a device's requests carry what it received (prefix reuse names rows by them).
        batches.append([Request(s, x, ops, memoryview(x.numpy()).cast("B")) for s, x in enumerate(xs[step].unbind(0))])
    computed[0], start = 0.0, time.process_time()
    for batch in batches:
        runner.run_batch(batch)
    print(time.process_time() - start, computed[0], flush=True)
"""


def start(tree: Path, model: Path, layers: int, prefix_reuse: bool, paged: bool) -> subprocess.Popen:
    code = (CHILD.replace("{layers}", str(layers)).replace("{budget}", str(REUSE_BUDGET))
            .replace("{reuse}", str(prefix_reuse)).replace("{graph_batch}", str(None if paged else GRAPH_BATCH))
            .replace("{cached}", str(CACHED)))
    return start_child(code, tree, model)


def host_micros(child: subprocess.Popen, sessions: int, steps: int, skip: bool) -> float:
    """CPU µs per request of `steps` decode steps of `sessions` sessions, their compute taken out (`skip`:
    not computed at all)."""
    child.stdin.write(f"{sessions} {steps} {int(skip)}\n")
    child.stdin.flush()
    whole, computed = map(float, child.stdout.readline().split())
    return (whole - computed) / (steps * sessions) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--layers", default="4,16", help="layer counts, comma-separated")
    parser.add_argument("--counts", default="1,8,32", help="session counts, comma-separated")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-reuse", action="store_true", help="follow the sessions for prefix reuse")
    parser.add_argument("--paged", action="store_true", help="no decode graphs: the paged step, as a CPU device's")
    args = parser.parse_args()
    counts = [int(n) for n in args.counts.split(",")]
    print(machine_line())
    print(f"tiny layers, f32, {CACHED} cached tokens, {args.steps} steps a round, median of {args.rounds}, "
          f"prefix reuse {'on' if args.prefix_reuse else 'off'}: the host's CPU µs per request, before -> now")
    trees = {"before": args.before.resolve(), "now": Path.cwd()}
    with tempfile.TemporaryDirectory() as work:
        for layers in (int(n) for n in args.layers.split(",")):
            model = make_checkpoint(Path(work) / str(layers), "llama", num_hidden_layers=layers, **SHAPES["tiny"])
            children = {name: start(tree, model, layers, args.prefix_reuse, args.paged) for name, tree in trees.items()}
            for child in children.values():
                host_micros(child, max(counts), 16, False)  # warm-up
            for n in counts:
                line = f"  {layers:3d} layers, {n:3d} sessions:"
                sides = ((False, "the paged step, all of it"),) if args.paged else \
                    ((False, "beside compute"), (True, "compute skipped"))
                for skip, name in sides:
                    rounds = {tree: [] for tree in children}
                    for _ in range(args.rounds):
                        for tree, child in children.items():
                            rounds[tree].append(host_micros(child, n, args.steps, skip))
                    before, now = (statistics.median(rounds[tree]) for tree in trees)
                    line += f"  {name}: {before:6.1f} -> {now:6.1f} ({now / before:.2f}x)"
                print(line)
            for child in children.values():
                child.stdin.close()
                child.wait()


if __name__ == "__main__":
    main()
