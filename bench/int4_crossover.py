"""Where a CPU product of a kept int4 weight should leave torch's int4 kernel for bf16 tiles, per shape.

    python -m bench.int4_crossover [--threads 1] [--rows 1,3,8,16,32,64,128,256] [--group 128]

TinyLlama-1.1B's four matrix shapes ([out, in]: q/o 2048x2048, k/v 256x2048, gate/up 5632x2048,
down 2048x5632), random codes in groups of --group, side by side in one process at each row count
(the activation's tokens): torch's int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations),
the tiles (model/weights/int4.py: W^T dequantized to bf16 1024 outputs at a time, one bf16 GEMM
each), and the dequantized path a node takes with --dequantize-4bit (f32 weights, MKL's packed copy:
model/weights/packed.py). Best of --repeats each; ratios over the dequantized path. "crossover": the
fewest rows from which the tiles beat the kernel; "takes": what Int4Weight.matmul picks there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from cakemp.model.weights import int4
from cakemp.model.weights.packed import PackedWeight

SHAPES = {"q/o": (2048, 2048), "k/v": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}


def best_ms(product: Callable[[], torch.Tensor], repeats: int) -> float:
    product()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def measure(rows: int, cols: int, group: int, counts: list[int], repeats: int) -> list[dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    parts = int4.Int4Parts(torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8),
                           torch.rand(rows, cols // group, generator=generator) / 64 + 1e-3,
                           torch.randn(rows, cols // group, generator=generator) / 16, group)
    weight = int4.Int4Weight.create(parts)
    dequantized = PackedWeight.create(int4.reference_weight(parts))
    results = []
    for count in counts:
        x = torch.randn(count, cols, generator=generator)
        flat = x.bfloat16()
        results.append(dict(
            rows=count,
            kernel=best_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, weight.packed, group, weight.scales_and_zeros), repeats),
            tiles=best_ms(lambda: weight._tiled(flat), repeats),
            dequantized=best_ms(lambda: dequantized.matmul(x), repeats)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,3,8,16,32,64,128,256")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(count) for count in args.rows.split(",")]
    print(f"threads={args.threads} group={args.group}; ms, best of {args.repeats}; ratios over the dequantized f32 path")
    print("| matrix | rows | kernel ms | tiles ms | dequantized ms | kernel / deq | tiles / deq | takes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    crossovers = {}
    for name, (rows, cols) in SHAPES.items():
        results = measure(rows, cols, args.group, counts, args.repeats)
        for r in results:
            takes = "tiles" if r["rows"] >= int4._DEQUANTIZED_ROWS else "kernel"
            print(f"| {name} {rows}x{cols} | {r['rows']} | {r['kernel']:.2f} | {r['tiles']:.2f} | "
                  f"{r['dequantized']:.2f} | {r['kernel'] / r['dequantized']:.2f} | "
                  f"{r['tiles'] / r['dequantized']:.2f} | {takes} |")
        crossovers[name] = next((r["rows"] for r in results if r["tiles"] < r["kernel"]), None)
    print("crossover (fewest rows where the tiles beat the kernel): " +
          ", ".join(f"{name} {rows}" for name, rows in crossovers.items()))


if __name__ == "__main__":
    main()
