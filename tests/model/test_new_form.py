"""A new stored weight form is one file and one row: tests/support/rowwise_int8.py, its row added to
checkpoint/quantization.METHODS, is parsed from config.json, read by the unchanged readers and loader,
dequantized, or kept for torch's int8 matmul, and counted by the resident rule."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from cakemp.checkpoint import quantization
from cakemp.compute.loading import LoadPlan
from cakemp.model.weights import int8
from cakemp.model.weights.readers import open_checkpoint
from tests.support import rowwise_int8
from tests.support.checkpoints import make_checkpoint
from tests.support.quantized import layer_matrix

LAYER = "model.layers.1"


def rowwise_checkpoint(tmp_path):
    """A tiny Llama whose layer matrices are stored as rowwise int8, and each matrix's value q * s."""
    plain = make_checkpoint(tmp_path / "plain", "llama")
    stored, values = {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, tensor in load_file(plain / "model.safetensors").items():
        if not layer_matrix(name, tensor):
            stored[name] = tensor
            continue
        codes = torch.randint(-127, 128, tensor.shape, generator=generator, dtype=torch.int8)
        scale = torch.rand(tensor.shape[0], generator=generator) / 64 + 1e-3
        stored[name], stored[f"{name}_row_scale"] = codes, scale
        values[name] = codes.float() * scale[:, None]
    path = tmp_path / "rowwise"
    path.mkdir()
    config = json.loads((plain / "config.json").read_text()) | {"quantization_config": {"quant_method": "rowwise_int8"}}
    (path / "config.json").write_text(json.dumps(config))
    save_file(stored, path / "model.safetensors")
    return path, values


def test_a_new_form_is_one_file_and_one_row(tmp_path, monkeypatch):
    """Dequantized, every matrix is q * s exactly; kept, an Int8Weight holding q and s; counted, the
    bytes the kept weights hold."""
    monkeypatch.setattr(quantization, "METHODS", quantization.METHODS + (rowwise_int8.ROW,))
    path, values = rowwise_checkpoint(tmp_path)
    checkpoint = open_checkpoint(path)
    assert checkpoint.config.quantization == rowwise_int8.RowwiseInt8()
    plan = LoadPlan.of(checkpoint.config, checkpoint, [LAYER])
    names = plan.groups[LAYER]
    matrices = [key for key, members in names.items() if f"{LAYER}.{members[0]}" in values]
    assert set(matrices) == {"w_qkv", "w_o", "w_gate_up", "w_down"}

    dequantized = plan.read(checkpoint, torch.device("cpu"), torch.float32, None)
    kept_kernels = frozenset({int8.KERNEL})
    kept = plan.read(checkpoint, torch.device("cpu"), torch.bfloat16, None, kernels=kept_kernels)
    for key in matrices:
        expected = torch.cat([values[f"{LAYER}.{name}"] for name in names[key]])
        assert torch.equal(dequantized[(LAYER, key)], expected)
        weight = kept[(LAYER, key)]
        assert isinstance(weight, int8.Int8Weight)
        assert torch.equal(weight.scales[:, None] * weight.codes.float() + weight.corrections[:, None], expected)
    assert plan.nbytes(checkpoint, torch.bfloat16, kept_kernels) == sum(w.nbytes for w in kept.values())
