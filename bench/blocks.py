"""Block and loading benchmark: cakemp's decoder layer against HF transformers' on the same weights.

    python -m bench.blocks [--threads N] [--device cpu|cuda] [--dtypes f32,bf16]

Writes a random Llama checkpoint (hidden 2048, 16 heads on 4 kv heads, intermediate 5632:
TinyLlama-1.1B's layer shape; 8 layers, bf16, 4 shards) to a temp dir, then in one process,
with the same thread count for both:

* decode: one new token at context 512 (then 513, ...) through all 8 layers, cakemp's
  BlockRunner.run against HF's LlamaDecoderLayers called with HF's DynamicCache, eager
  attention (HF's reference path) and sdpa (HF's default), reported per layer; 8 layers
  (0.7-1.4 GB) so the weights stream from memory rather than sit in a large L3 as one
  layer would; steps alternate between the implementations and the best (minimum) of each
  is reported: the machine may be shared, and interference only ever adds time;
* prefill: 128 tokens into an empty cache, the same way;
* the memory-bandwidth floor for decode: the layer's weight bytes / a measured read bandwidth;
* fusion: q/k/v and gate/up as one GEMM each (what cakemp does) against separate GEMMs;
* load: BlockRunner.load of the 8-layer span against reading the same tensor bytes from the
  shard files with os.preadv into a new buffer per tensor, each in a fresh process (as a
  device process starting up); all from the page cache: the files were just written and
  read once before timing. On CPU much of either is first-touch page faults of the new
  memory.

HF's causal mask and rotary tables are built outside its timed call (HF builds them once per
model forward); cakemp's timing includes its own (per request), its input checks and KV
bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask

from cakemp.compute.runner import BlockRunner
from tests.support.checkpoints import CACHE_ARGUMENT

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_hidden_layers=8,
    vocab_size=256,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)
CONTEXT = 512
PREFILL = 128
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def write_checkpoint(directory: Path) -> None:
    config = transformers.LlamaConfig(**SHAPE)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    # ~90 MiB per layer in bf16: 200 MB shards put the 8 layers in 4 files.
    model.save_pretrained(directory, max_shard_size="200MB")


class HFLayers:
    """HF's decoder layers with their own DynamicCache, called as LlamaModel.forward calls them."""

    def __init__(self, model, attention: str):
        self.model = model.model
        self.config = model.config
        self.attention = attention
        self.cache = DynamicCache(config=self.config)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)

    def prepare(self, x: torch.Tensor, index_pos: int) -> Callable[[], torch.Tensor]:
        """The timed call, with mask and cos/sin prepared outside it."""
        self.config._attn_implementation = self.attention
        positions = torch.arange(index_pos, index_pos + x.shape[1])[None]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=None, position_ids=positions,
            **{CACHE_ARGUMENT: self.cache})
        cos_sin = self.model.rotary_emb(x, position_ids=positions)

        def run() -> torch.Tensor:
            h = x
            for layer in self.model.layers:
                h = layer(h, attention_mask=mask, position_embeddings=cos_sin, position_ids=positions,
                          **{CACHE_ARGUMENT: self.cache})
            return h

        return run


def print_comparison(name: str, r: dict[str, dict[str, float]], context: int, prefill: int) -> None:
    """`measure`'s result for dtype `name` as a table: ms per layer call and cakemp / HF."""
    print(f"\n{name}: ms per layer call (best of the interleaved samples), ratio = cakemp / HF")
    print("| phase | cakemp | HF eager | HF sdpa | vs eager | vs sdpa |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase, label in (("decode", f"decode T=1 @ctx {context}"), ("prefill", f"prefill T={prefill}")):
        m = r[phase]
        print(
            f"| {label} | {m['cakemp']:.2f} | {m['eager']:.2f} | {m['sdpa']:.2f} "
            f"| {m['cakemp'] / m['eager']:.2f} | {m['cakemp'] / m['sdpa']:.2f} |"
        )


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 1) -> float:
    """Best of `repeats` wall times of fn(), in seconds, synchronised on a GPU."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def compare(path: Path, dtype: torch.dtype, device: torch.device, steps: int) -> dict[str, dict[str, float]]:
    """Best ms per layer for decode and prefill: cakemp, HF eager, HF sdpa."""
    layers = SHAPE["num_hidden_layers"]
    runner = BlockRunner.load(path, [f"model.layers.{i}" for i in range(layers)], device, dtype)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    hf = {name: HFLayers(model, name) for name in ("eager", "sdpa")}
    return measure(runner, hf, layers, SHAPE["hidden_size"], dtype, device, steps, CONTEXT, PREFILL)


def measure(runner: BlockRunner, hf: dict, layers: int, hidden: int, dtype: torch.dtype, device: torch.device,
            steps: int, context: int, prefill: int) -> dict[str, dict[str, float]]:
    """Best ms per layer of `runner` and each of `hf` (name -> HFLayers-like: `prepare(x, pos)`
    returns the timed call, `reset()` empties its cache), steps alternating between them:
    decode one token at context `context` (then + 1, ...), and prefill `prefill` tokens into
    an empty cache."""

    def ops(index_pos: int) -> list[tuple[str, int, int]]:
        return [(f"model.layers.{i}", index_pos, i) for i in range(layers)]

    generator = torch.Generator().manual_seed(1)

    def tokens(T: int) -> torch.Tensor:
        return torch.randn(1, T, hidden, generator=generator).to(device, dtype)

    results = {}
    names = ["cakemp", *hf]
    with torch.inference_mode():
        first = tokens(context)
        runner.run(0, first, runner.ops(ops(0)))
        for layer in hf.values():
            layer.prepare(first, 0)()
        samples = {name: [] for name in names}
        for step in range(steps + 2):  # two warm-up steps
            x, position = tokens(1), context + step
            t = {"cakemp": timed(lambda: runner.run(0, x, runner.ops(ops(position))), device)}
            for name, layer in hf.items():
                t[name] = timed(layer.prepare(x, position), device)
            if step >= 2:
                for name in samples:
                    samples[name].append(t[name])
        results["decode"] = {name: min(v) * 1e3 / layers for name, v in samples.items()}

        samples = {name: [] for name in names}
        for step in range(max(3, steps // 2) + 1):
            x = tokens(prefill)
            runner.free_session(0)
            t = {"cakemp": timed(lambda: runner.run(0, x, runner.ops(ops(0))), device)}
            for name, layer in hf.items():
                layer.reset()
                t[name] = timed(layer.prepare(x, 0), device)
            if step >= 1:
                for name in samples:
                    samples[name].append(t[name])
        results["prefill"] = {name: min(v) * 1e3 / layers for name, v in samples.items()}
    return results


def layer_weight_bytes(dtype: torch.dtype) -> int:
    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"]
    d = h // SHAPE["num_attention_heads"]
    params = h * (h + 2 * kv * d) + h * h + 3 * h * i + 2 * h
    return params * torch.empty((), dtype=dtype).element_size()


def read_bandwidth(device: torch.device) -> float:
    """Bytes/s of the fastest of three streaming reads of 1 GiB, each the best of 5.

    A reduction, a copy (counted as read + write) and a matrix-vector product; which one
    streams fastest depends on the machine, and the floor should be the best achievable.
    """
    x = torch.ones(2**30 // 4, device=device)  # 1 GiB f32, more than any L3
    y = torch.empty_like(x)
    matrix, vector = x.view(-1, 4096), torch.ones(4096, device=device)
    rates = [
        x.numel() * 4 / timed(lambda: x.sum(), device, repeats=5),
        2 * x.numel() * 4 / timed(lambda: y.copy_(x), device, repeats=5),
        x.numel() * 4 / timed(lambda: torch.mv(matrix, vector), device, repeats=5),
    ]
    return max(rates)


def fusion(dtype: torch.dtype, device: torch.device, steps: int) -> dict[str, tuple[float, float]]:
    """Best ms of (separate, fused) GEMMs for q/k/v and gate/up at T=1 and T=PREFILL."""
    h, i = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = SHAPE["num_key_value_heads"] * h // SHAPE["num_attention_heads"]
    w = {name: torch.randn(rows, h, device=device).to(dtype) for name, rows in
         (("q", h), ("k", kv), ("v", kv), ("gate", i), ("up", i))}
    qkv, gate_up = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["gate"], w["up"]])
    out = {}
    with torch.inference_mode():
        for T in (1, PREFILL):
            x = torch.randn(1, T, h, device=device).to(dtype)
            calls = {
                "qkv": (lambda: [F.linear(x, w[p]) for p in "qkv"], lambda: F.linear(x, qkv)),
                "gate_up": (
                    lambda: F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]),
                    lambda: (lambda g, u: F.silu(g) * u)(*F.linear(x, gate_up).chunk(2, dim=-1)),
                ),
            }
            for name, (separate, fused) in calls.items():
                times = ([], [])
                for step in range(steps + 2):
                    for k, fn in enumerate((separate, fused)):
                        t = timed(fn, device)
                        if step >= 2:
                            times[k].append(t)
                out[f"{name} T={T}"] = tuple(min(t) * 1e3 for t in times)
    return out


def tensor_ranges(path: Path, prefixes: tuple[str, ...]) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of every tensor under `prefixes`, from the safetensors headers."""
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    ranges = []
    for file in sorted({f for name, f in index.items() if name.startswith(prefixes)}):
        with open(path / file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, meta in header.items():
            if name.startswith(prefixes):
                begin, end = meta["data_offsets"]
                ranges.append((path / file, 8 + header_len + begin, end - begin))
    return ranges


def read_bytes(ranges: list[tuple[Path, int, int]]) -> int:
    """pread every range into a new buffer of its own, as any loader must allocate."""
    total = 0
    for file, offset, length in ranges:
        fd = os.open(file, os.O_RDONLY)
        try:
            total += os.preadv(fd, [memoryview(bytearray(length))], offset)
        finally:
            os.close(fd)
    return total


def span(path: Path) -> tuple[list[str], list[tuple[Path, int, int]]]:
    layers = [f"model.layers.{i}" for i in range(SHAPE["num_hidden_layers"])]
    return layers, tensor_ranges(path, tuple(layer + "." for layer in layers))


def once(what: str, path: Path, dtype: str, device: str) -> float:
    """Seconds of one load (or pread) of the span: what a freshly started device process pays."""
    layers, ranges = span(path)
    if what == "pread":
        return timed(lambda: read_bytes(ranges), torch.device("cpu"))
    return timed(lambda: BlockRunner.load(path, layers, device, DTYPES[dtype]), torch.device(device))


def load_times(path: Path, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Best seconds of each way of loading the span, each run in a fresh process.

    In one long-lived process the allocator would hand the second load memory the first one
    already faulted in, which a device process starting up never has.
    """
    read_bytes(span(path)[1])  # warm the page cache for all
    runs = {"pread": ("pread", "bf16"), "load bf16": ("load", "bf16"), "load f16 (cast)": ("load", "f16")}
    best = {}
    for name, (what, dtype) in runs.items():
        command = [sys.executable, "-m", "bench.blocks", "--once", what, "--model", str(path), "--dtypes", dtype,
                   "--device", str(device)]
        outputs = [subprocess.run(command, capture_output=True, text=True, check=True).stdout for _ in range(repeats)]
        best[name] = min(float(out) for out in outputs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--once", choices=["load", "pread"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.once:
        print(once(args.once, args.model, args.dtypes, args.device))
        return
    device = torch.device(args.device)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, {device}")
    print(f"layer: hidden {SHAPE['hidden_size']}, heads 16/4 kv, intermediate {SHAPE['intermediate_size']}")
    bandwidth = read_bandwidth(device)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_checkpoint(path)
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            r = compare(path, dtype, device, args.steps)
            floor = layer_weight_bytes(dtype) / bandwidth * 1e3
            print_comparison(name, r, CONTEXT, PREFILL)
            print(f"decode floor (weight bytes / bandwidth): {floor:.2f} ms; cakemp at {r['decode']['cakemp'] / floor:.2f}x")
            print("fusion: ms separate -> fused: " + ", ".join(
                f"{k} {a:.2f} -> {b:.2f}" for k, (a, b) in fusion(dtype, device, args.steps).items()
            ))
        t = load_times(path, device)
        size = layer_weight_bytes(torch.bfloat16) * SHAPE["num_hidden_layers"]
        print(f"\nload of {SHAPE['num_hidden_layers']} layers ({size / 2**20:.0f} MiB) from the bf16 checkpoint, "
              "warm page cache, each in a fresh process")
        print("| how | ms | GB/s | vs pread |")
        print("|---|---:|---:|---:|")
        for name, seconds in t.items():
            print(f"| {name} | {seconds * 1e3:.0f} | {size / seconds / 1e9:.1f} | {seconds / t['pread']:.2f} |")


if __name__ == "__main__":
    main()
