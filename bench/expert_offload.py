"""MoE layers with every expert resident against their experts offloaded (--expert-offload) into
caches of a few sizes, side by side in one run: bytes held, decode step time and the cache's hit rate.

    python -m bench.expert_offload [--threads 1] [--steps 48]

The checkpoint: 2 Qwen3-MoE layers (hidden 512, 8 query heads on 4 kv heads) of 64 experts of 256,
4 per token, f32 (1.5 MiB an expert, 192 MiB of experts in all), written by tests/support/checkpoints.py.
Each runner (BlockRunner.load onto the CPU, f32 compute) takes a 32-token prompt, then decode steps
at positions 32.. (median of --steps after as many unmeasured): on "repeating" inputs, the step's
hidden state cycles through 4 fixed vectors (a text whose tokens come back, and with them their
routing), on "varied" inputs each step's is new (random weights route them all but uniformly: a
worse case than real text, whose routing is skewed toward some experts). Held: the layers' weights as
LoadPlan counts them plus the bytes the cache holds at the end; the page cache the mapped checkpoint
fills is the kernel's to reclaim and not counted. Ratios are offloaded over all-resident.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cakemp.compute.loading import LoadPlan
from cakemp.compute.runner import BlockRunner
from cakemp.model.weights.readers import open_checkpoint
from tests.support.checkpoints import make_checkpoint

SHAPE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2, num_experts=64,
             num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True)
LAYERS = ("model.layers.0", "model.layers.1")
PROMPT = 32
# (label, cache policy, share of the experts the cache holds; None: all resident)
RUNS = (("all resident", "lru", None), ("offload, cache 1/2", "lru", 1 / 2), ("offload, cache 1/4", "lru", 1 / 4),
        ("offload, cache 1/4, LFU", "lfu", 1 / 4), ("offload, cache 1/8", "lru", 1 / 8), ("offload, no cache", "lru", 0))


def held_bytes(path: Path, offload: bool) -> int:
    checkpoint = open_checkpoint(path)
    return LoadPlan.of(checkpoint.config, checkpoint, LAYERS, offload_experts=offload).nbytes(checkpoint, torch.float32)


def decode(runner: BlockRunner, inputs: str, steps: int) -> float:
    """The median decode step in seconds, after a prompt and `steps` unmeasured steps."""
    generator = torch.Generator().manual_seed(0)
    hidden = runner.config.hidden_size
    runner.run(0, torch.randn(1, PROMPT, hidden, generator=generator),
               runner.ops([(layer, 0, i) for i, layer in enumerate(LAYERS)]))
    cycle = [torch.randn(1, 1, hidden, generator=generator) for _ in range(4)]
    times = []
    for step in range(2 * steps):
        x = cycle[step % 4] if inputs == "repeating" else torch.randn(1, 1, hidden, generator=generator)
        ops = runner.ops([(layer, PROMPT + step, i) for i, layer in enumerate(LAYERS)])
        start = time.perf_counter()
        runner.run(0, x, ops)
        times.append(time.perf_counter() - start)
    runner.free_session(0)
    return statistics.median(times[steps:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), "qwen3_moe", **SHAPE)
        expert = 3 * SHAPE["hidden_size"] * SHAPE["moe_intermediate_size"] * 4
        experts = SHAPE["num_experts"] * len(LAYERS)
        print(f"2 Qwen3-MoE layers, 64 experts of 256, top-4, hidden 512, f32 on the CPU, {args.threads} thread(s); "
              f"{experts} experts of {expert / 2**20:.1f} MiB; decode median of {args.steps} steps")
        print("| run | inputs | held MiB | held ratio | decode ms | speed ratio | hit rate |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for inputs in ("repeating", "varied"):
            base = None
            for label, policy, share in RUNS:
                cache = None if share is None else int(share * experts) * expert
                runner = BlockRunner.load(path, LAYERS, "cpu", torch.float32, expert_cache_bytes=cache)
                if runner.expert_cache is not None:
                    runner.expert_cache.policy = policy
                seconds = decode(runner, inputs, args.steps)
                stats = runner.expert_cache
                held = held_bytes(path, share is not None) + (stats.resident_bytes if stats else 0)
                base = base or (held, seconds)
                hits = "" if stats is None else f"{stats.hits / (stats.hits + stats.misses):.2f}"
                print(f"| {label} | {inputs} | {held / 2**20:.0f} | {held / base[0]:.2f} | {seconds * 1e3:.2f} | "
                      f"{base[1] / seconds:.2f} | {hits} |")


if __name__ == "__main__":
    main()
