"""Resident bytes, a decode step and a 128-token prompt chunk of the same 4-bit layers kept int4
(the CPU default) and dequantized to f32 (--dequantize-4bit), side by side in one run.

    python -m bench.quantized_decode [--layers 2] [--threads 1] [--steps 20]

The checkpoints are bench/quantized_load.py's: Llama layers of TinyLlama-1.1B's shape (hidden 2048,
32 query heads on 4 kv heads, intermediate 5632) as GPTQ 4-bit (groups of 128), MLX affine 4-bit
(groups of 64) and GGUF Q4_K (groups of 32, its sub-blocks). Each (format, path) loads in a fresh
process (BlockRunner.load onto the CPU, f32 compute, MKL packing as a node does): the resident
growth over the load (RSS after minus before) and what LoadPlan.nbytes counts for the layers; then
a 128-token prompt chunk at position 0 (best of 3, each a new session) and a decode step at
position 128 (median of --steps). Ratios are kept over dequantized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.quantized_load import FORMATS, write
from cakemp.compute.loading import LoadPlan, kept_kernels
from cakemp.compute.runner import BlockRunner
from cakemp.model.weights.readers import open_checkpoint
from cakemp.rss import resident_bytes

MEASURED = ("gptq 4-bit g128", "mlx 4-bit g64", "gguf Q4_K")
PROMPT = 128


def once(path: Path, layers_served: int, keep: bool, steps: int) -> dict[str, float]:
    """In this (fresh) process: load, then time a prompt chunk and decode steps."""
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    layers = [config.layer_name(i) for i in range(layers_served)]
    device, dtype = torch.device("cpu"), torch.float32
    kernels = kept_kernels(checkpoint, device, dtype) if keep else frozenset()
    counted = LoadPlan.of(config, checkpoint, layers).nbytes(checkpoint, dtype, kernels=kernels)
    before = resident_bytes()
    runner = BlockRunner.load(path, layers, device, dtype, keep_int4=keep)
    grown = resident_bytes() - before
    generator = torch.Generator().manual_seed(0)
    hidden = config.hidden_size
    prompt = torch.randn(1, PROMPT, hidden, generator=generator)
    prefill = []
    for session in range(3):
        start = time.perf_counter()
        runner.run(session, prompt, runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
        prefill.append(time.perf_counter() - start)
    decode = []
    for step in range(steps):
        x = torch.randn(1, 1, hidden, generator=generator)
        ops = runner.ops([(layer, PROMPT + step, i) for i, layer in enumerate(layers)])
        start = time.perf_counter()
        runner.run(0, x, ops)
        decode.append(time.perf_counter() - start)
    return {"resident": grown, "counted": counted, "prefill": min(prefill), "decode": statistics.median(decode)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--once", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.once:
        print(json.dumps(once(args.once, args.layers, bool(args.keep), args.steps)))
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MEASURED:
            path = write(Path(tmp) / name.replace(" ", "-"), args.layers, FORMATS[name])
            rows[name] = [json.loads(subprocess.run(
                [sys.executable, "-m", "bench.quantized_decode", "--once", str(path), "--keep", str(keep),
                 "--layers", str(args.layers), "--threads", str(args.threads), "--steps", str(args.steps)],
                capture_output=True, text=True, check=True).stdout) for keep in (1, 0)]
    print(f"{args.layers} layers of TinyLlama-1.1B's shape on the CPU, f32 compute, {args.threads} thread(s): "
          "kept int4 vs dequantized f32 (--dequantize-4bit)")
    print("| stored as | resident MiB kept / deq | ratio | counted MiB kept / deq | decode ms kept / deq | ratio "
          f"| {PROMPT}-token chunk ms kept / deq | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (kept, plain) in rows.items():
        print(f"| {name} | {kept['resident'] / 2**20:.0f} / {plain['resident'] / 2**20:.0f} | "
              f"{kept['resident'] / plain['resident']:.2f} | {kept['counted'] / 2**20:.0f} / {plain['counted'] / 2**20:.0f} | "
              f"{kept['decode'] * 1e3:.2f} / {plain['decode'] * 1e3:.2f} | {kept['decode'] / plain['decode']:.2f} | "
              f"{kept['prefill'] * 1e3:.1f} / {plain['prefill'] * 1e3:.1f} | {kept['prefill'] / plain['prefill']:.2f} |")


if __name__ == "__main__":
    main()
