"""Load time and resident memory of the same layers stored plain (bf16), as GPTQ, as MLX affine and as GGUF.

    python -m bench.quantized_load [--layers 4] [--repeats 3] [--dtype bf16] [--threads 2]

The checkpoints hold Llama layers of TinyLlama-1.1B's shape (hidden 2048, 32 query heads on 4
kv heads, intermediate 5632): plain bf16; GPTQ 4-bit, groups of 128, v1, f16 scales; GPTQ
8-bit act-order (g_idx); MLX affine 4-bit, groups of 64, bf16 scales and biases. The packed
codes are random words: any word is a valid code, and a load benchmark needs no quantizer.
GGUF files (written by gguf-py, tests/support/gguf_files.py) hold every matrix as Q8_0 or Q4_K, and a
third one the Q4_K layers four times over (4x --layers layers) of which only the first
--layers are loaded: a node reads only the layers it serves (Cake dequantizes the whole file).

Each load runs in a fresh process (as a device process starting up) from a warm page cache:
BlockRunner.load of every layer onto the CPU in the compute dtype. Reported per format: the
layers' bytes on disk, the best load time of `repeats`, the process's resident growth over
the load (RSS after minus before), and what Checkpoint.nbytes counts for them (what the KV
budget and the fit check subtract). On a CPU every format is dequantized at load, so resident
memory is the plain matrices' whatever the disk format: the saving is disk and push bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute.loading import LoadPlan
from cakemp.compute.runner import BlockRunner
from cakemp.model.weights.readers import open_checkpoint
from cakemp.rss import resident_bytes

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=256, max_position_embeddings=2048)
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
MATRICES = {"self_attn.q_proj": (2048, 2048), "self_attn.k_proj": (256, 2048), "self_attn.v_proj": (256, 2048),
            "self_attn.o_proj": (2048, 2048), "mlp.gate_proj": (5632, 2048), "mlp.up_proj": (5632, 2048),
            "mlp.down_proj": (2048, 5632)}
FORMATS = {
    "bf16": None,
    "gptq 4-bit g128": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "gptq 8-bit act-order g128": {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": True, "sym": False,
                                  "checkpoint_format": "gptq_v2"},
    "mlx 4-bit g64": {"bits": 4, "group_size": 64, "mode": "affine"},
    "gguf Q8_0": ("Q8_0", 1),
    "gguf Q4_K": ("Q4_K", 1),
    "gguf Q4_K, 1/4 of the file's layers": ("Q4_K", 4),
}
GGUF_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_words(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator)


def layer_tensors(layer: int, quantization: dict | None, generator: torch.Generator) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}"
    tensors = {f"{prefix}.{norm}.weight": torch.ones(2048, dtype=torch.bfloat16)
               for norm in ("input_layernorm", "post_attention_layernorm")}
    for name, (out, inp) in MATRICES.items():
        module = f"{prefix}.{name}"
        if quantization is None:
            tensors[f"{module}.weight"] = (torch.randn(out, inp, generator=generator) / inp**0.5).bfloat16()
        elif quantization.get("quant_method") == "gptq":
            bits, groups = quantization["bits"], inp // quantization["group_size"]
            g_idx = torch.arange(inp, dtype=torch.int32) // quantization["group_size"]
            if quantization["desc_act"]:
                g_idx = g_idx[torch.randperm(inp, generator=generator)]
            tensors |= {f"{module}.qweight": random_words((inp * bits // 32, out), generator),
                        f"{module}.qzeros": random_words((groups, out * bits // 32), generator),
                        f"{module}.scales": torch.rand(groups, out, generator=generator).half() / 64,
                        f"{module}.g_idx": g_idx}
        else:
            bits, groups = quantization["bits"], inp // quantization["group_size"]
            tensors |= {f"{module}.weight": random_words((out, inp * bits // 32), generator).view(torch.uint32),
                        f"{module}.scales": (torch.rand(out, groups, generator=generator) / 64).bfloat16(),
                        f"{module}.biases": (torch.rand(out, groups, generator=generator) / 64).bfloat16()}
    return tensors


def write_gguf_file(directory: Path, layers: int, kind: str, times: int) -> Path:
    from tests.support.gguf_files import GgufSpec, write_gguf

    directory.mkdir()
    spec = GgufSpec("llama", hidden=2048, ffn=5632, heads=32, kv_heads=4, layers=layers * times, vocab=256,
                    types=dict.fromkeys(GGUF_MATRICES, kind) | {"token_embd": "F16", "output": "F16"})
    return write_gguf(directory / "model.gguf", spec)


def write(directory: Path, layers: int, quantization: dict | tuple | None) -> Path:
    if isinstance(quantization, tuple):
        return write_gguf_file(directory, layers, *quantization)
    config = transformers.LlamaConfig(**SHAPE, num_hidden_layers=layers)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    if quantization is not None:
        raw["quantization" if "mode" in quantization else "quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(raw))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        tensors |= layer_tensors(layer, quantization, generator)
    save_file(tensors, directory / "model.safetensors")
    return directory


def once(path: Path, dtype: torch.dtype, served: int) -> dict[str, float]:
    """One load of the first `served` layers in this (fresh) process: seconds, resident growth and counted bytes."""
    config = ModelConfig.from_dir(path)
    layers = [config.layer_name(i) for i in range(served)]
    checkpoint = open_checkpoint(path, config)
    counted = LoadPlan.of(config, checkpoint, layers).nbytes(checkpoint, dtype)
    before = resident_bytes()
    start = time.perf_counter()
    runner = BlockRunner.load(path, layers, "cpu", dtype, pack_weights=False)
    seconds = time.perf_counter() - start
    grown = resident_bytes() - before
    assert len(runner.blocks) == len(layers)
    return {"seconds": seconds, "resident": grown, "counted": counted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each loading process")
    parser.add_argument("--once", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.once:
        print(json.dumps(once(args.once, DTYPES[args.dtype], args.layers)))
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, quantization in FORMATS.items():
            path = write(Path(tmp) / name.replace(" ", "-").replace(",", "").replace("/", "-"), args.layers, quantization)
            stored = path if path.is_file() else path / "model.safetensors"
            disk = stored.stat().st_size
            stored.read_bytes()  # warm the page cache
            command = [sys.executable, "-m", "bench.quantized_load", "--once", str(path), "--dtype", args.dtype,
                       "--threads", str(args.threads), "--layers", str(args.layers)]
            runs = [json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
                    for _ in range(args.repeats)]
            rows[name] = (disk, min(r["seconds"] for r in runs), min(r["resident"] for r in runs), runs[0]["counted"])
    base = rows["bf16"]
    print(f"{args.layers} layers of TinyLlama-1.1B's shape, loaded in {args.dtype} on the CPU ({args.threads} threads), "
          f"fresh process each, best of {args.repeats}")
    print("| stored as | file MiB | load ms | vs bf16 | resident MiB | vs bf16 | counted MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (disk, seconds, resident, counted) in rows.items():
        print(f"| {name} | {disk / 2**20:.0f} | {seconds * 1e3:.0f} | {seconds / base[1]:.2f} | "
              f"{resident / 2**20:.0f} | {resident / base[2]:.2f} | {counted / 2**20:.0f} |")


if __name__ == "__main__":
    main()
