"""Block and loading benchmark: cakemp's decoder layer against HF transformers' on the same weights.

    python bench/blocks.py [--threads N] [--device cpu|cuda] [--dtypes f32,bf16]

Writes a random Llama checkpoint (hidden 2048, 16 heads on 4 kv heads, intermediate 5632:
TinyLlama-1.1B's layer shape; 4 layers, bf16, 2 shards) to a temp dir, then in one process,
with the same thread count for both:

* decode: one new token at context 512 (then 513, ...) through layer 0, cakemp's
  BlockRunner.forward against HF's LlamaDecoderLayer called with HF's DynamicCache, eager
  attention (HF's reference path) and sdpa (HF's default); steps alternate between the
  implementations and the median is reported;
* prefill: 128 tokens into an empty cache, the same way;
* the memory-bandwidth floor for decode: the layer's weight bytes / a measured read bandwidth;
* fusion: q/k/v and gate/up as one GEMM each (what cakemp does) against separate GEMMs;
* load: BlockRunner.load of the 4-layer span against reading the same tensor bytes from the
  shard files with os.preadv, into a fresh buffer per tensor (what any loader must allocate)
  and into one reused buffer (the copy alone); all from the page cache: the files were just
  written and read once before timing. On CPU, most of a load is first-touch page faults
  of the new memory; run with THP_MEM_ALLOC_ENABLE=1 (torch then asks for huge pages) to
  see that part shrink.

HF's causal mask and rotary tables are built outside its timed call (HF builds them once per
model forward); cakemp's timing includes its own (per request), its input checks and KV
bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask

from cakemp.device.runner import BlockRunner

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_hidden_layers=4,
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
    # ~90 MiB per layer in bf16: 200 MB shards put the 4 layers in 2 files.
    model.save_pretrained(directory, max_shard_size="200MB")


class HFLayer:
    """HF's decoder layer 0 with its own DynamicCache, called as LlamaModel.forward calls it."""

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
            config=self.config, inputs_embeds=x, attention_mask=None, cache=self.cache, position_ids=positions
        )
        cos_sin = self.model.rotary_emb(x, position_ids=positions)
        layer = self.model.layers[0]
        return lambda: layer(
            x, attention_mask=mask, position_embeddings=cos_sin, position_ids=positions, cache=self.cache
        )


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(path: Path, dtype: torch.dtype, device: torch.device, steps: int) -> dict[str, dict[str, float]]:
    """Median ms per layer call for decode and prefill: cakemp, HF eager, HF sdpa."""
    runner = BlockRunner.load(path, ["model.layers.0"], device, dtype)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    hf = {name: HFLayer(model, name) for name in ("eager", "sdpa")}
    generator = torch.Generator().manual_seed(1)

    def tokens(T: int) -> torch.Tensor:
        return torch.randn(1, T, SHAPE["hidden_size"], generator=generator).to(device, dtype)

    results = {"decode": {}, "prefill": {}}
    with torch.inference_mode():
        context = tokens(CONTEXT)
        runner.forward(0, context, [("model.layers.0", 0, 0)])
        for layer in hf.values():
            layer.prepare(context, 0)()
        samples = {"cakemp": [], "eager": [], "sdpa": []}
        for step in range(steps + 2):  # two warm-up steps
            x, position = tokens(1), CONTEXT + step
            t = {"cakemp": timed(lambda: runner.forward(0, x, [("model.layers.0", position, 0)]), device)}
            for name, layer in hf.items():
                t[name] = timed(layer.prepare(x, position), device)
            if step >= 2:
                for name in samples:
                    samples[name].append(t[name])
        results["decode"] = {name: statistics.median(v) * 1e3 for name, v in samples.items()}

        samples = {"cakemp": [], "eager": [], "sdpa": []}
        for step in range(max(3, steps // 4) + 1):
            x = tokens(PREFILL)
            runner.clear_session(0)
            t = {"cakemp": timed(lambda: runner.forward(0, x, [("model.layers.0", 0, 0)]), device)}
            for name, layer in hf.items():
                layer.reset()
                t[name] = timed(layer.prepare(x, 0), device)
            if step >= 1:
                for name in samples:
                    samples[name].append(t[name])
        results["prefill"] = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    return results


def layer_weight_bytes(dtype: torch.dtype) -> int:
    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"]
    d = h // SHAPE["num_attention_heads"]
    params = h * (h + 2 * kv * d) + h * h + 3 * h * i + 2 * h
    return params * torch.empty((), dtype=dtype).element_size()


def read_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large read-only reduction, the best of 5."""
    x = torch.ones(256 * 2**20 // 4, device=device)  # 256 MiB f32
    best = min(timed(lambda: x.sum(), device) for _ in range(5))
    return x.numel() * 4 / best


def fusion(dtype: torch.dtype, device: torch.device, steps: int) -> dict[str, tuple[float, float]]:
    """Median ms of (separate, fused) GEMMs for q/k/v and gate/up at T=1 and T=PREFILL."""
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
                out[f"{name} T={T}"] = tuple(statistics.median(t) * 1e3 for t in times)
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


def read_bytes(ranges: list[tuple[Path, int, int]], fresh: bool) -> int:
    """pread every range into memory: a new buffer per tensor (fresh), or one reused buffer."""
    reused = memoryview(bytearray(max(length for _, _, length in ranges)))
    total = 0
    for file, offset, length in ranges:
        view = memoryview(bytearray(length)) if fresh else reused[:length]
        fd = os.open(file, os.O_RDONLY)
        try:
            total += os.preadv(fd, [view], offset)
        finally:
            os.close(fd)
    return total


def load_times(path: Path, dtype: torch.dtype, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Median seconds of BlockRunner.load of the span and of pread of its tensor bytes."""
    layers = [f"model.layers.{i}" for i in range(SHAPE["num_hidden_layers"])]
    ranges = tensor_ranges(path, tuple(layer + "." for layer in layers))
    read_bytes(ranges, fresh=False)  # warm the page cache for all
    times = {"load": [], "pread fresh": [], "pread reused": []}
    for _ in range(repeats):
        times["load"].append(timed(lambda: BlockRunner.load(path, layers, device, dtype), device))
        times["pread fresh"].append(timed(lambda: read_bytes(ranges, fresh=True), torch.device("cpu")))
        times["pread reused"].append(timed(lambda: read_bytes(ranges, fresh=False), torch.device("cpu")))
    return {name: statistics.median(t) for name, t in times.items()} | {"bytes": sum(n for _, _, n in ranges)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
            print(f"\n{name}: ms per layer call (median), ratio = cakemp / HF")
            print("| phase | cakemp | HF eager | HF sdpa | vs eager | vs sdpa |")
            print("|---|---:|---:|---:|---:|---:|")
            for phase, label in (("decode", f"decode T=1 @ctx {CONTEXT}"), ("prefill", f"prefill T={PREFILL}")):
                m = r[phase]
                print(
                    f"| {label} | {m['cakemp']:.2f} | {m['eager']:.2f} | {m['sdpa']:.2f} "
                    f"| {m['cakemp'] / m['eager']:.2f} | {m['cakemp'] / m['sdpa']:.2f} |"
                )
            print(f"decode floor (weight bytes / bandwidth): {floor:.2f} ms; cakemp at {r['decode']['cakemp'] / floor:.2f}x")
            print("fusion: ms separate -> fused: " + ", ".join(
                f"{k} {a:.2f} -> {b:.2f}" for k, (a, b) in fusion(dtype, device, args.steps).items()
            ))
        print(f"\nload of 4 layers ({layer_weight_bytes(torch.bfloat16) * 4 / 2**20:.0f} MiB) from the bf16 checkpoint, "
              f"warm page cache, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
        print("| load as | BlockRunner.load ms | pread into fresh buffers ms | pread into one reused buffer ms | load / fresh | load / reused |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in ("bf16", "f16"):
            t = load_times(path, DTYPES[name], device)
            load, fresh, reused = t["load"], t["pread fresh"], t["pread reused"]
            print(f"| {name} | {load * 1e3:.0f} | {fresh * 1e3:.0f} | {reused * 1e3:.0f} | {load / fresh:.2f} | {load / reused:.2f} |")


if __name__ == "__main__":
    main()
