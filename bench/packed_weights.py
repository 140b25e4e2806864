"""Packed weights: what MKL's packed layout costs in memory and saves in time, per layer shape.

    python -m bench.packed_weights [--rounds 5] [--threads 1] [--shapes demo,tinyllama,llama3-8b]

For each shape (the demo's checkpoint, 6 layers; TinyLlama-1.1B's layer shape, 4 layers; one
Llama-3-8B-shaped layer), a random f32 checkpoint is loaded into this process three ways:
plain (`pack_weights=False`), as a CPU node loads it (each matrix packed only where the packed
buffer holds at most 1.1x its plain bytes, model/weights/packed.py), and with every matrix packed.
Printed: each matrix's packed / plain bytes; each way's weight bytes (what the node's "device
ready" line reports) and the RSS its load added; and, the ways alternating over --rounds, a
decode step of one session, a step of 8 sessions and a 128-token prompt chunk through
BlockRunner, as medians and as ratios to plain.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.pool import machine_line
from cakemp.compute.runner import BlockRunner, Request
from cakemp.model.weights import packed
from cakemp.rss import resident_bytes
from tests.support.checkpoints import make_checkpoint

SHAPES = {
    "demo": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 num_hidden_layers=6),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=64, num_hidden_layers=4),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=1),
}
WAYS = {"plain": (False, packed.MAX_GROWTH), "as a node": (True, packed.MAX_GROWTH), "all packed": (True, float("inf"))}
SESSIONS = 8
CHUNK = 128


def load(model: Path, layers: list[str], way: str) -> tuple[BlockRunner, int]:
    """The runner loaded `way`, and the RSS its load added."""
    pack, growth = WAYS[way]
    packed.MAX_GROWTH = growth
    before = resident_bytes()
    runner = BlockRunner.load(model, layers, "cpu", torch.float32, pack_weights=pack)
    packed.MAX_GROWTH = WAYS["plain"][1]
    return runner, resident_bytes() - before


def timings(runner: BlockRunner, layers: list[str], hidden: int) -> dict[str, float]:
    """Seconds of a decode step of one session, of a step of SESSIONS sessions, and of a CHUNK-token chunk."""
    def step(count: int, position: int) -> None:
        ops = runner.ops([(layer, position, i) for i, layer in enumerate(layers)])
        runner.run_batch([Request(s, torch.randn(1, 1, hidden), ops) for s in range(1, count + 1)])

    out = {}
    with torch.inference_mode():
        for name, count in (("decode, 1 session", 1), (f"decode step, {SESSIONS} sessions", SESSIONS)):
            for s in range(1, count + 1):
                runner.run(s, torch.randn(1, 8, hidden), runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
            step(count, 8)  # warm-up
            start = time.perf_counter()
            for position in range(9, 14):
                step(count, position)
            out[name] = (time.perf_counter() - start) / 5
            for s in range(1, count + 1):
                runner.free_session(s)
        start = time.perf_counter()
        runner.run(1, torch.randn(1, CHUNK, hidden), runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
        out[f"{CHUNK}-token chunk"] = time.perf_counter() - start
        runner.free_session(1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the three ways; figures are medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    for shape in args.shapes.split(","):
        config = SHAPES[shape]
        with tempfile.TemporaryDirectory() as tmp:
            model = make_checkpoint(Path(tmp), "llama", **config)
            layers = [f"model.layers.{i}" for i in range(config["num_hidden_layers"])]
            print(f"\n{shape}: {len(layers)} layer(s), hidden {config['hidden_size']}, intermediate "
                  f"{config['intermediate_size']}, f32, {args.threads} thread(s)")
            runners = {}
            for way in WAYS:
                runners[way], added = load(model, layers, way)
                print(f"  {way:>10}: weight bytes {runners[way].weight_bytes:,}, RSS added {added:,}", flush=True)
            block = runners["all packed"].blocks[0]
            for key, weight in {**vars(block), **vars(block.mlp)}.items():
                if isinstance(weight, packed.PackedWeight):
                    plain = weight.shape.numel() * 4
                    print(f"  {key} {tuple(weight.shape)}: packed / plain bytes {weight.packed.nbytes / plain:.3f}")
            times = {way: {} for way in WAYS}
            for _ in range(args.rounds):
                for way, runner in runners.items():
                    for what, seconds in timings(runner, layers, config["hidden_size"]).items():
                        times[way].setdefault(what, []).append(seconds)
            for what in times["plain"]:
                base = statistics.median(times["plain"][what])
                print(f"  {what}: " + ", ".join(
                    f"{way} {statistics.median(times[way][what]) * 1e3:.1f} ms "
                    f"({statistics.median(times[way][what]) / base:.2f}x)" for way in WAYS))


if __name__ == "__main__":
    main()
