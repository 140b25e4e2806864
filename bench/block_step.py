"""Block step benchmark: the CPU time of one decode step through a tiny model's layers in-process,
this tree against an earlier checkout, side by side in one run.

    python -m bench.block_step --before DIR [--steps 400] [--rounds 6] [--hidden 256] [--prompt 8]

DIR is a checkout of an earlier commit (e.g. `git archive <commit> | tar -x -C DIR`). The
checkpoint is bench/request_cost.py's random 2-layer Llama (hidden 256, intermediate 768, 4 query
heads on 2 kv heads, f32; --hidden scales all three widths). One child process per tree, each
importing its own tree's cakemp (PYTHONPATH), loads both layers as a node's CPU device does (f32
packed, no prefix reuse, one torch thread) and, when told, runs --steps one-token requests of one
session through both (BlockRunner.run_batch, contexts P to P + steps after a --prompt of P tokens, then the
session is freed and starts over: a later conversation of a lone session)
and reports its CPU time (time.process_time), then that of the same steps' four matrix products
alone on the layers' own weights (the floor no cut of the small ops goes below). The children
take turns, --rounds each; the figures are each tree's total CPU µs per step, its products'
share, and the trees' ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pool import machine_line
from bench.request_cost import LAYERS, SHAPE
from tests.support.checkpoints import make_checkpoint

# What each child runs, with only the APIs both trees have: one line on stdin (a count of steps)
# -> one line on stdout (the CPU seconds the steps took, then the seconds of their products alone).
CHILD = """
import sys, time, torch
from cakemp.compute.runner import BlockRunner, Request
from cakemp.model.linear import linear
torch.set_num_threads(1)
layers = [f"model.layers.{i}" for i in range({layers})]
runner = BlockRunner.load(sys.argv[1], layers, "cpu", torch.float32)
hidden = runner.config.hidden_size
print("ready", flush=True)
with torch.inference_mode():
    for line in sys.stdin:
        runner.free_session(1)
        runner.run(1, torch.randn(1, {prompt}, hidden), runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
        inputs = [torch.randn(1, 1, hidden) for _ in range(int(line))]
        start = time.process_time()
        for position, x in enumerate(inputs, {prompt}):
            runner.run_batch([Request(1, x, runner.ops([(layer, position, i) for i, layer in enumerate(layers)]))])
        steps = time.process_time() - start
        # The floor: the same steps' four matrix products alone (q/k/v, o, gate/up, down of each layer,
        # on the layers' own weights, one token), what no cut of the small ops can go below.
        start = time.process_time()
        for x in inputs:
            for block in runner.blocks:
                linear(x, block.w_qkv), linear(x, block.w_o)  # H_q * D == H in this model
                gate, up = linear(x, block.mlp.w_gate_up).chunk(2, dim=-1)
                linear(up, block.mlp.w_down)
        print(steps, time.process_time() - start, flush=True)
"""


def start(tree: Path, model: Path, prompt: int) -> subprocess.Popen:
    return start_child(CHILD.replace("{layers}", str(LAYERS)).replace("{prompt}", str(prompt)), tree, model)


def start_child(code: str, tree: Path, model: Path) -> subprocess.Popen:
    """A Python child running `code` over `model` with the cakemp of the checkout `tree` (PYTHONPATH), its
    stdin and stdout lines the bench's, once it prints "ready" (after any log lines of its loading)."""
    child = subprocess.Popen([sys.executable, "-c", code, str(model)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree,
                             env={**os.environ, "PYTHONPATH": str(tree)})
    for line in child.stdout:
        if line.strip() == "ready":
            return child
    raise RuntimeError(f"the child from {tree} did not start")


def step_seconds(child: subprocess.Popen, steps: int) -> tuple[float, float]:
    """(CPU seconds of `steps` decode steps, of the same steps' matrix products alone)."""
    child.stdin.write(f"{steps}\n")
    child.stdin.flush()
    whole, products = child.stdout.readline().split()
    return float(whole), float(products)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    parser.add_argument("--prompt", type=int, default=8, help="tokens cached before the decode steps")
    args = parser.parse_args()
    scale = args.hidden / SHAPE["hidden_size"]
    shape = {**SHAPE, "hidden_size": args.hidden, "intermediate_size": int(SHAPE["intermediate_size"] * scale)}
    print(machine_line())
    with tempfile.TemporaryDirectory() as work:
        model = make_checkpoint(Path(work), "llama", **shape)
        trees = {f"before ({args.before.name})": args.before.resolve(), "this tree": Path.cwd()}
        children = {name: start(tree, model, args.prompt) for name, tree in trees.items()}
        totals = {name: [0.0, 0.0] for name in children}
        for child in children.values():
            step_seconds(child, 20)  # warm-up
        for _ in range(args.rounds):
            for name, child in children.items():
                for i, seconds in enumerate(step_seconds(child, args.steps)):
                    totals[name][i] += seconds
        for child in children.values():
            child.stdin.close()
            child.wait()
    micros = {name: [s / (args.rounds * args.steps) * 1e6 for s in pair] for name, pair in totals.items()}
    print(f"hidden {args.hidden}, {LAYERS} layers, {args.prompt}-token prompt, CPU µs per decode step "
          f"(sum of {args.rounds} rounds of {args.steps})")
    for name, (whole, products) in micros.items():
        print(f"  {name}: {whole:.1f}; its matrix products alone {products:.1f} ({products / whole:.2f} of it)")
    (before, _), (after, _) = micros.values()
    print(f"this tree / before: {after / before:.3f}")

if __name__ == "__main__":
    main()
