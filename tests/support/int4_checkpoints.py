"""GPTQ and MLX checkpoints of random 4-bit codes, for the int4 path (tests/model/test_int4.py,
tools/gpu_check.py).

    path = random_gptq(tmp_path / "gptq", plain, group_size=128)   # plain: a make_checkpoint directory

Every decoder-layer matrix of `plain` is replaced by random packed words and random positive
scales (zero points, biases) of its shape; the rest is kept. No oracle writes them because none
is needed: the int4 path is checked against the project's own dequantization of the same stored
tensors, and that dequantization is checked against GPTQModel's and MLX's own in
tests/model/test_gptq.py and test_mlx.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from tests.support.quantized import GptqSpec, _write_like, layer_matrix


def _tensors(plain: Path) -> dict[str, torch.Tensor]:
    with safe_open(plain / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _words(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64).to(torch.int32)


def _scales(generator: torch.Generator, rows: int, cols: int, inputs: int) -> torch.Tensor:
    """Scales that keep a 4-bit weight's values about 1/sqrt(inputs) (a layer's outputs stay O(1))."""
    return (torch.rand(rows, cols, generator=generator) + 0.5) / (8 * inputs**0.5)


def random_gptq(path: Path, plain: Path, group_size: int, desc_act: bool = False, seed: int = 0) -> Path:
    """A 4-bit GPTQ (v1, asymmetric) copy of `plain` at `path`; with `desc_act`, g_idx puts the
    inputs in groups out of order (act-order)."""
    generator = torch.Generator().manual_seed(seed)
    stored = {}
    for name, tensor in _tensors(plain).items():
        if not layer_matrix(name, tensor):
            stored[name] = tensor.half()
            continue
        out_features, in_features = tensor.shape
        groups = in_features // group_size
        module = name.removesuffix(".weight")
        order = torch.randperm(in_features, generator=generator) if desc_act else torch.arange(in_features)
        stored |= {f"{module}.qweight": _words(generator, in_features // 8, out_features),
                   f"{module}.qzeros": _words(generator, groups, out_features // 8),
                   f"{module}.scales": _scales(generator, groups, out_features, in_features).half(),
                   f"{module}.g_idx": (order // group_size).to(torch.int32)}
    config = GptqSpec("llama", group_size=group_size, desc_act=desc_act, sym=False).config()
    return _write_like(plain, path, stored, {"quantization_config": config})


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
