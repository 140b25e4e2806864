"""GPTQ and MLX checkpoints of random 4-bit (or 8-bit) codes, for the kept paths (tests/model/test_int4.py,
test_int8.py, tools/gpu_check.py).

    path = random_gptq(tmp_path / "gptq", plain, group_size=128)   # plain: a make_checkpoint directory

Every decoder-layer matrix of `plain` is replaced by random packed words and random positive
scales (zero points, biases) of its shape; the rest is kept. No oracle writes them because none
is needed: the int4 path is checked against the project's own dequantization of the same stored
tensors, and that dequantization is checked against GPTQModel's and MLX's own in
tests/model/test_gptq.py and test_mlx.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from cakemp.checkpoint.quantization import Gptq
from cakemp.model.weights import gptq
from tests.support.quantized import GptqSpec, _write_like, layer_matrix

# One layer of a make_checkpoint Llama and its fused weight groups, as the loader reads them.
LAYER = "model.layers.1"
GROUPS = {"w_qkv": [f"{LAYER}.self_attn.{p}_proj.weight" for p in "qkv"],
          "w_gate_up": [f"{LAYER}.mlp.{p}_proj.weight" for p in ("gate", "up")],
          "w_down": [f"{LAYER}.mlp.down_proj.weight"], "input_norm": [f"{LAYER}.input_layernorm.weight"]}


def _tensors(plain: Path) -> dict[str, torch.Tensor]:
    with safe_open(plain / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _words(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64).to(torch.int32)


def _scales(generator: torch.Generator, rows: int, cols: int, inputs: int) -> torch.Tensor:
    """Scales that keep a 4-bit weight's values about 1/sqrt(inputs) (a layer's outputs stay O(1))."""
    return (torch.rand(rows, cols, generator=generator) + 0.5) / (8 * inputs**0.5)


def random_gptq(path: Path, plain: Path, group_size: int, desc_act: bool = False, seed: int = 0,
                order_per_matrix: bool = False, bits: int = 4) -> Path:
    """A `bits`-bit GPTQ (v1, asymmetric) copy of `plain` at `path` (group_size -1: one group a row);
    with `desc_act`, g_idx puts the inputs in groups out of order (act-order), in one random order per
    layer and input size, as GPTQ's act-order gives matrices of one input (q/k/v, gate/up: one
    Hessian, one order); with `order_per_matrix`, one order per matrix instead."""
    generator = torch.Generator().manual_seed(seed)
    stored, orders = {}, {}
    for name, tensor in _tensors(plain).items():
        if not layer_matrix(name, tensor):
            stored[name] = tensor.half()
            continue
        out_features, in_features = tensor.shape
        size = in_features if group_size == -1 else group_size
        groups = in_features // size
        module = name.removesuffix(".weight")
        layer = name.rsplit(".", 3)[0] if not order_per_matrix else module
        if (layer, in_features) not in orders:
            orders[layer, in_features] = torch.randperm(in_features, generator=generator) if desc_act \
                else torch.arange(in_features)
        order = orders[layer, in_features]
        scales = _scales(generator, groups, out_features, in_features) * 15 / ((1 << bits) - 1)
        stored |= {f"{module}.qweight": _words(generator, in_features * bits // 32, out_features),
                   f"{module}.qzeros": _words(generator, groups, out_features * bits // 32),
                   f"{module}.scales": scales.half(),
                   f"{module}.g_idx": (order // size).to(torch.int32)}
    config = GptqSpec("llama", bits=bits, group_size=group_size, desc_act=desc_act, sym=False).config()
    return _write_like(plain, path, stored, {"quantization_config": config})


def gptq_reference(path: Path, plain: Path, quantized: Path) -> Path:
    """`plain` at `path` with each matrix of `quantized` (a `random_gptq` copy of it) as the project
    dequantizes it, in f32: what a node dequantizing its 4-bit weights computes with."""
    stored = _tensors(quantized)
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    spec = Gptq(config["bits"], config["group_size"], config["desc_act"], config["sym"], True)
    tensors = {}
    for name in _tensors(plain):
        module = name.removesuffix(".weight")
        if f"{module}.qweight" not in stored:
            tensors[name] = stored[name].float()
            continue
        parts = (stored[f"{module}.{part}"] for part in ("qweight", "qzeros", "scales", "g_idx"))
        tensors[name] = gptq.dequantize(*parts, spec)
    return _write_like(plain, path, tensors)


def random_mlx(path: Path, plain: Path, group_size: int, bits: int = 4, seed: int = 0) -> Path:
    """A `bits`-bit MLX affine copy of `plain` at `path` (bf16 scales and biases, mlx-lm's names)."""
    generator = torch.Generator().manual_seed(seed)
    stored = {}
    for name, tensor in _tensors(plain).items():
        if not layer_matrix(name, tensor):
            stored[name] = tensor.bfloat16()
            continue
        rows, cols = tensor.shape
        module = name.removesuffix(".weight")
        scales = _scales(generator, rows, cols // group_size, cols)
        stored |= {name: _words(generator, rows, cols * bits // 32).view(torch.uint32),
                   f"{module}.scales": scales.bfloat16(),
                   f"{module}.biases": (-scales * ((1 << bits) - 1) / 2).bfloat16()}
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
    return _write_like(plain, path, stored, {"quantization": quantization, "quantization_config": quantization})
