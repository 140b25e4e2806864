"""model/weights/ggml.py's dequantization against gguf-py's (gguf.quants.dequantize, numpy), bit for bit
in f32: blocks quantized by gguf-py where it can (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ1_0, TQ2_0,
BF16, F16), and for the K-quants and IQ4_NL/IQ4_XS, which it cannot quantize, blocks whose every
byte is random but the f16 scales (so every code, sub-block scale, min and high bit is drawn;
tests/support/gguf_files.py), over 6 rows of 2 or 16 blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cakemp.checkpoint.gguf import GGML_TYPES
from cakemp.checkpoint.gguf_model import DEQUANTIZED_TYPES
from cakemp.model.weights import ggml
from tests.support.gguf_files import RANDOM_BLOCKS, needs_gguf, random_blocks

QUANTIZED_BY_GGUF_PY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "BF16", "F16", "F32")
SHAPE = (6, 512)


def _ours(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    return ggml.dequantize(torch.from_numpy(raw.reshape(-1).copy()), kind, shape).numpy()


@needs_gguf
@pytest.mark.parametrize("kind", QUANTIZED_BY_GGUF_PY)
def test_types_gguf_py_quantizes_dequantize_as_gguf_py_does(kind):
    import gguf

    values = (0.05 * np.random.default_rng(1).standard_normal(SHAPE)).astype(np.float32)
    values[0, :256] = 0  # an all-zero block (scale 0)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    np.testing.assert_array_equal(_ours(raw.view(np.uint8), kind, SHAPE), expected)


@needs_gguf
@pytest.mark.parametrize("kind", list(RANDOM_BLOCKS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_types_gguf_py_cannot_quantize_dequantize_as_gguf_py_does(kind, seed):
    import gguf

    raw = random_blocks(np.random.default_rng(seed), kind, SHAPE)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    np.testing.assert_array_equal(_ours(raw, kind, SHAPE), expected)


def test_the_types_refused_at_start_are_those_not_dequantized_here():
    """checkpoint/gguf_model.py refuses, before a device starts, exactly the types this module lacks."""
    assert set(DEQUANTIZED_TYPES) == set(ggml.DEQUANTIZERS) | {"F32", "F16", "BF16"}
    for kind, (block_bytes, _) in ggml.DEQUANTIZERS.items():
        assert next(t for t in GGML_TYPES.values() if t.name == kind).block_bytes == block_bytes


@needs_gguf
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(ggml.DEQUANTIZERS) + ["F16", "BF16"])
def test_on_a_gpu_the_bytes_dequantize_to_what_gguf_py_gives(kind):
    """A GGUF tensor's bytes are dequantized where they are loaded: on CUDA, the same f32 values."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in RANDOM_BLOCKS:
        raw = random_blocks(np.random.default_rng(3), kind, SHAPE)
    else:
        raw = gguf.quants.quantize((0.05 * np.random.default_rng(3).standard_normal(SHAPE)).astype(np.float32), qtype)
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    got = ggml.dequantize(torch.from_numpy(raw.view(np.uint8).reshape(-1).copy()).cuda(), kind, SHAPE)
    assert got.device.type == "cuda"
    np.testing.assert_array_equal(got.cpu().numpy(), expected)
