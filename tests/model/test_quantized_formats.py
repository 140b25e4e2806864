"""The formats stored as several parts plug in at one place: each torch-free config with parts has
its one row in checkpoint/quantization.METHODS, naming its torch side, and the readers and the
sizing name no format."""

from __future__ import annotations

import ast
import importlib
import inspect

from cakemp.checkpoint import quantization
from cakemp.checkpoint.gguf_model import GGML_FAMILIES
from cakemp.master import cluster
from cakemp.model.weights import ggml, gguf, quantized, safetensors, source

FORMAT_NAMES = {"Gptq", "GptqParts", "GptqWeight", "MlxAffine", "MlxParts", "MlxWeight", "gptq", "mlx",
                "Fp8", "Fp8Parts", "StoredFp8", "Fp8Weight", "fp8", "fp8_block", "keep_fp8"}


def names_in(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
        {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} | \
        {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_each_config_stored_as_parts_has_one_row():
    assert [method.config for method in quantization.METHODS] == [quantization.MlxAffine, quantization.Fp8,
                                                                  quantization.Gptq]
    fp8 = quantization.Fp8((128, 128))
    gptq = quantization.Gptq(4, 128, False, True, True)
    mlx = quantization.MlxAffine(4, 64)
    for config, stored in ((fp8, {"m.weight", "m.weight_scale_inv"}), (gptq, {"m.qweight", "m.qzeros", "m.scales"}),
                           (mlx, {"m.weight", "m.scales", "m.biases"})):
        weight = quantized.parts_of(config, "m.weight", stored.__contains__)
        assert set(weight.parts.stored) == stored and type(weight) is quantized.torch_side(config)
    assert quantized.parts_of(fp8, "m.norm.weight", {"m.norm.weight"}.__contains__) is None  # no scales: as stored
    assert quantized.parts_of(None, "m.weight", lambda name: True) is None


def test_the_readers_and_the_sizing_name_no_format():
    for module in (safetensors, gguf, source, cluster):  # the master sizes workers through the readers
        assert not names_in(module) & FORMAT_NAMES, module.__name__


def test_each_ggml_family_is_one_module_and_one_row():
    """Each GGML_FAMILIES row names exactly the types its module dequantizes (and keeps int4 only among
    them); no type is in two families; every dequantized type has its block size from the file format's table."""
    seen = []
    for family in GGML_FAMILIES:
        module = importlib.import_module(family.module)
        assert tuple(module.DEQUANTIZERS) == family.types and set(module.INT4) <= set(family.types), family.name
        seen += family.types
    assert len(seen) == len(set(seen)) and set(ggml.DEQUANTIZERS) == set(seen)
    assert set(ggml.INT4_TYPES) == {"Q4_0", "Q4_1", "Q4_K"}
