"""A decode step of the same GGUF layers in llama.cpp (llama-cpp-python) and in cakemp's kept path,
side by side in one run and one process, at the same thread count; then where cakemp's step goes.

    python -m bench.llama_cpp [--layers 4] [--threads 1] [--steps 32] [--rounds 3]

Each file is written by gguf-py (tests/support/gguf_files.py): Llama layers of TinyLlama-1.1B's
shape (hidden 2048, 32 query heads on 4 kv heads of 64, intermediate 5632), every matrix in one
ggml type: Q4_0 (gguf-py's own quantizer: cakemp keeps it int4), Q4_K (random valid blocks, which
gguf-py cannot quantize: cakemp keeps it int4) and Q8_0 (gguf-py's quantizer: cakemp dequantizes
its 32-value blocks to f32, MKL-packed). The vocabulary is SentencePiece's 3 control tokens and
256 byte tokens, the embeddings and head F16: the head's 259 x 2048 weights are 0.3 % of one
layer's, so llama.cpp's step (which includes the embedding row and the head) is compared to
cakemp's layers as is, not corrected.

llama.cpp: `Llama(path, n_threads=T, n_threads_batch=T, n_ctx=256)` (its defaults otherwise: f16
KV), a 16-token prompt, then one token per `eval`. cakemp: `BlockRunner.load` of the same file
onto the CPU in f32 (kept int4 where the format maps onto torch's int4 kernel), a 16-row prompt
of random hidden states, then one row per `run`, the KV growing as llama.cpp's does; torch at
T threads. The two take turns, `--steps` steps each per round; a step's time is the median over
every round. Last, torch.profiler over `--steps` more cakemp steps: self CPU time of the weight
products (the int4 kernel, MKL's packed GEMM) against everything else.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.quantized_load import GGUF_MATRICES
from cakemp.compute.runner import BlockRunner
from cakemp.master.gguf_tokenizer.vocab import BYTE, CONTROL, UNKNOWN

TYPES = ("Q4_0", "Q4_K", "Q8_0")
PROMPT = 16
# The SentencePiece vocabulary llama.cpp needs to load a model: <unk> <s> </s> and the byte tokens.
TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
VOCABULARY = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS,
              "tokenizer.ggml.scores": [0.0] * len(TOKENS),
              "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256,
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.unknown_token_id": 0}
# Weight products by the op torch.profiler names them: kept int4, kept int8, MKL's packed f32 GEMM, plain.
WEIGHT_PRODUCTS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::mkl_linear",
                   "aten::_mkl_linear", "aten::addmm", "aten::mm")


def write(directory: Path, kind: str, layers: int) -> Path:
    from tests.support.gguf_files import GgufSpec, write_gguf

    spec = GgufSpec("llama", hidden=2048, ffn=5632, heads=32, kv_heads=4, layers=layers, vocab=len(TOKENS),
                    types=dict.fromkeys(GGUF_MATRICES, kind) | {"token_embd": "F16", "output": "F16"},
                    global_metadata=VOCABULARY)
    return write_gguf(directory / f"{kind}.gguf", spec)


class LlamaCpp:
    """llama.cpp's model of the file: a prompt, then one token per step."""

    def __init__(self, path: Path, threads: int):
        import llama_cpp

        self.model = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=256, verbose=False)
        self.model.eval([1] + [3 + i for i in range(PROMPT - 1)])

    def steps(self, count: int) -> list[float]:
        times = []
        for step in range(count):
            start = time.perf_counter()
            self.model.eval([3 + step % 256])
            times.append(time.perf_counter() - start)
        return times


class Cakemp:
    """cakemp's layers of the same file in-process: a prompt, then one hidden row per step."""

    def __init__(self, path: Path, layers: int):
        self.layers = [f"model.layers.{i}" for i in range(layers)]
        self.runner = BlockRunner.load(path, self.layers, "cpu", torch.float32)
        self.generator = torch.Generator().manual_seed(0)
        self.position = 0
        self._run(PROMPT)

    def _run(self, rows: int) -> None:
        x = torch.randn(1, rows, 2048, generator=self.generator)
        ops = self.runner.ops([(layer, self.position, i) for i, layer in enumerate(self.layers)])
        self.runner.run(0, x, ops)
        self.position += rows

    def steps(self, count: int) -> list[float]:
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self._run(1)
            times.append(time.perf_counter() - start)
        return times

    def profile(self, count: int) -> tuple[float, list[tuple[str, float]]]:
        """Self CPU µs a step: of the weight products, and of the costliest ops (all included)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.steps(count)
        ops = sorted(((e.key, e.self_cpu_time_total / count) for e in prof.key_averages()), key=lambda o: -o[1])
        return sum(t for name, t in ops if name in WEIGHT_PRODUCTS), ops


def compare(path: Path, args: argparse.Namespace) -> dict:
    ours, theirs = Cakemp(path, args.layers), LlamaCpp(path, args.threads)
    ours.steps(3), theirs.steps(3)  # warm both
    times: dict[str, list[float]] = {"cakemp": [], "llama.cpp": []}
    for _ in range(args.rounds):
        times["llama.cpp"] += theirs.steps(args.steps)
        times["cakemp"] += ours.steps(args.steps)
    weights, ops = ours.profile(args.steps)
    return {name: statistics.median(t) for name, t in times.items()} | {"weights": weights, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    assert PROMPT + 3 + (args.rounds + 1) * args.steps <= 256, "the steps must fit llama.cpp's n_ctx of 256"
    torch.set_num_threads(args.threads)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in TYPES:
            rows[kind] = compare(write(Path(tmp), kind, args.layers), args)
    print(f"{args.layers} Llama layers of TinyLlama-1.1B's shape, {args.threads} thread(s), decode step at "
          f"positions {PROMPT}-{PROMPT + 3 + args.rounds * args.steps}, median of {args.rounds} x {args.steps}")
    print("| GGUF type | cakemp path | cakemp ms | llama.cpp ms | cakemp / llama.cpp | weight products ms (profiled) "
          "| rest ms (profiled) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, row in rows.items():
        path = "dequantized f32" if kind == "Q8_0" else "kept int4"
        rest = sum(t for _, t in row["ops"]) - row["weights"]
        print(f"| {kind} | {path} | {row['cakemp'] * 1e3:.2f} | {row['llama.cpp'] * 1e3:.2f} | "
              f"{row['cakemp'] / row['llama.cpp']:.2f} | {row['weights'] / 1e3:.2f} | {rest / 1e3:.2f} |")
    for kind, row in rows.items():
        print(f"{kind}: cakemp's costliest ops, self CPU µs a step: " +
              ", ".join(f"{name} {t:.0f}" for name, t in row["ops"][:8]))


if __name__ == "__main__":
    main()
