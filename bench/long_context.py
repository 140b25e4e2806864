"""Long-context batched decode: the CPU time of a decode step of several sessions far into their
contexts, in-process, this tree against an earlier checkout, side by side in one run.

    python -m bench.long_context --before DIR [--counts 1,8,32] [--contexts 512,2048] [--steps 10]
                                 [--rounds 2] [--hidden 512] [--spread] [--long 0] [--window 0]

DIR is a checkout of an earlier commit (e.g. `git worktree add DIR <commit>`). One child process
per tree, case and round, importing its own tree's cakemp (PYTHONPATH), writes a random 2-layer
Llama of --hidden (intermediate 3x; query heads of 64 on 4 KV heads of 64: a small model's layers,
whose KV rows per token are a large share of its weights' bytes), f32, loads both layers as a CPU
device does (f32 packed, one torch thread), prefills each of N sessions to C positions in 256-row
chunks taken in turn (so that the sessions' KV blocks interleave in the pools, as concurrent
sessions leave them), then times --steps decode steps of all N sessions at once
(BlockRunner.run_batch): CPU time (time.process_time), the median step, and the minor page faults a
step (getrusage). The trees take turns, --rounds each; printed: each tree's ms and faults a step
(the median over rounds, and the least and most ms), and this tree's ms over the other's.

Contexts unlike: with --spread, session i of N is at C * (i + 1) // N positions rather than C; with
--long P, one more session, prefilled to P positions after the others, decodes in every step (one long
context among short ones); with --window W, the checkpoint is a Mistral's, its layers attending over a
sliding window of W positions.

Where a step's memory comes from depends on what its process allocated and freed before. The
children run as a script file; the same code run with `python -c` left the earlier tree's heap a
freed region its large gathers fitted in, and both trees took the same time there: a history as
possible as this one, which the kept gather space makes irrelevant.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pool import machine_line

HERE = Path(__file__).resolve().parents[1]

CHILD = """
import resource, statistics, sys, tempfile, time, torch
from cakemp.compute.runner import BlockRunner, Request
from tests.support.checkpoints import make_checkpoint
torch.set_num_threads(1)
n, context, steps, hidden, spread, long, window = map(int, sys.argv[1:8])
contexts = [context * (i + 1) // n if spread else context for i in range(n)] + ([long] if long else [])
family, windowed = ("mistral", {"sliding_window": window}) if window else ("llama", {})
with tempfile.TemporaryDirectory() as tmp:
    path = make_checkpoint(tmp, family, num_hidden_layers=2, vocab_size=64, hidden_size=hidden,
                           intermediate_size=3 * hidden, num_attention_heads=hidden // 64, num_key_value_heads=4,
                           max_position_embeddings=max(contexts) + steps + 8, **windowed)
    runner = BlockRunner.load(path, ["model.layers.0", "model.layers.1"], "cpu", torch.float32, pack_weights=True)
ops = lambda position: runner.ops([(f"model.layers.{i}", position, i) for i in range(2)])
with torch.inference_mode():
    for position in range(0, max(contexts), 256):
        for session, length in enumerate(contexts):
            if position < length:
                runner.run(session, torch.randn(1, min(256, length - position), hidden), ops(position))
    xs = [torch.randn(1, 1, hidden) for _ in contexts]
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for k in range(steps):
        start = time.process_time()
        runner.run_batch([Request(session, xs[session], ops(length + k)) for session, length in enumerate(contexts)])
        times.append(time.process_time() - start)
print(statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps)
"""


def step(child: Path, tree: Path, n: int, context: int, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU seconds, minor page faults) of a median decode step of `n` sessions at `context` in `tree`."""
    values = (n, context, args.steps, args.hidden, int(args.spread), args.long, args.window)
    out = subprocess.run([sys.executable, str(child), *map(str, values)],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    seconds, faults = out.stdout.split()[-2:]
    return float(seconds), float(faults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--counts", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--spread", action="store_true", help="session i of N at C * (i + 1) // N positions")
    parser.add_argument("--long", type=int, default=0, help="one more session, at this many positions")
    parser.add_argument("--window", type=int, default=0, help="a Mistral's layers, of this sliding window")
    args = parser.parse_args()
    print(machine_line())
    print(f"2 layers, hidden {args.hidden}, {args.hidden // 64} query heads on 4 KV heads of 64, f32, one thread"
          + (f", a sliding window of {args.window}" if args.window else "") + "; a decode step of every session"
          + (" (contexts spread to C)" if args.spread else "") + (f" and one at {args.long}" if args.long else "")
          + f", median of {args.steps} steps, {args.rounds} rounds")
    print("| sessions | context | before: ms (least-most), faults | now: ms (least-most), faults | now / before |")
    print("|---:|---:|---:|---:|---:|")
    trees = {"before": args.before.resolve(), "now": HERE}
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "child.py"
        child.write_text(CHILD)
        for n, context in itertools.product((int(c) for c in args.counts.split(",")),
                                            (int(c) for c in args.contexts.split(","))):
            measure(child, trees, n, context, args)


def measure(child: Path, trees: dict[str, Path], n: int, context: int, args: argparse.Namespace) -> None:
    """One row of the table: `n` sessions at `context` in each tree, --rounds times, taking turns."""
    runs = {name: [] for name in trees}
    for r in range(args.rounds):  # each tree first in turn
        for name in list(trees)[r % 2:] + list(trees)[: r % 2]:
            runs[name].append(step(child, trees[name], n, context, args))
    cells = {}
    for name, measured in runs.items():
        ms = [seconds * 1e3 for seconds, _ in measured]
        faults = statistics.median(f for _, f in measured)
        cells[name] = statistics.median(ms), f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}), {faults:,.0f}"
    print(f"| {n} | {context} | {cells['before'][1]} | {cells['now'][1]} | {cells['now'][0] / cells['before'][0]:.2f}x |")


if __name__ == "__main__":
    main()
