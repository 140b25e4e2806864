"""`cakemp run` keeping 4-bit weights int4 on an f32 CPU device (the default), over TCP, against
HF's layers computing the oracle's dequantization of the same weights (what the node computes
with --dequantize-4bit, tests/front/test_mlx_node.py), within the bound derived for the kept
path's bf16 roundings (tests/support/tolerance.py: INT4_KEPT_REL).

MLX affine checkpoints written by mx.quantize, layers 1-3 each, one node at a time: Llama (4 bits,
groups of 64), Qwen3 (4 bits, groups of 32, sharded) and Qwen3.5-MoE (4 bits, groups of 32: its
attention and shared expert kept int4, the stacked experts and the 8-bit routers dequantized).
A prompt and 8 decode steps, a prompt in 3-token chunks, and a 70-token prompt (past the 63 rows
from which a CPU product takes the bf16 tiles instead of the int4 kernel). The bytes the device
reports its weights hold are those the zero-config master's rule counts (checkpoint/resident.py).

A GPTQ act-order Llama (random codes, groups of 32, g_idx out of input order) the same way, against
HF's layers over the project's own dequantization of it (checked against GPTQModel's in
tests/model/test_gptq.py): its inputs gathered into group order before each product.
"""

from __future__ import annotations

import asyncio

import pytest

from cakemp.checkpoint.config import ModelConfig
from cakemp.master.cluster import held_bytes
from tests.support.checkpoints import make_checkpoint
from tests.support.int4_checkpoints import gptq_reference, random_gptq
from tests.support.quantized import mlx_checkpoint, needs_mlx
from tests.support.quantized_node import LAYERS, check_session, start
from tests.support.tolerance import F32_REL, INT4_KEPT_REL

CHECKPOINTS = {
    "llama": dict(family="llama", bits=4, group_size=64),
    "qwen3": dict(family="qwen3", bits=4, group_size=32, shards=2),
    "qwen3_5_moe": dict(family="qwen3_5_moe", bits=4, group_size=32),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request, tmp_path_factory):
    path, reference = mlx_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])
    node = start(path, tmp_path_factory.mktemp("topo"), flags=KEPT)
    yield node, path, reference
    assert node.stop() == 0


def check_kept(node, path, reference, bound: float = INT4_KEPT_REL) -> None:
    """A prompt and decode steps, a chunked prompt and a long one, each within `bound` of HF's layers over `reference`."""
    async def main():
        errors = await check_session(node.port, path, reference, [7] + [1] * 8, bound)
        errors += await check_session(node.port, path, reference, [3] * 4 + [1] * 8, bound)
        errors += await check_session(node.port, path, reference, [70, 1], bound)
        return errors

    errors = asyncio.run(asyncio.wait_for(main(), 120))
    # Kept, not dequantized: the kept path's roundings show (a dequantized f32 node is within F32_REL).
    assert max(errors) > F32_REL, max(errors)


# Kept 4-bit (no --dequantize-4bit). The tiny f32 matrices beside them stay plain (MKL's packed layout
# would hold far more than 1.1x their bytes, model/weights/packed.py): the bytes the master's rule counts.
KEPT: tuple[str, ...] = ()


def check_weight_bytes(node, path) -> None:
    """The bytes the node's device reports its layers' weights hold are what the zero-config master
    counts a CPU worker computing in f32 to hold of layers 1-3 (master/cluster.held_bytes, from the
    headers alone), and less than a GPU's count, which dequantizes them."""
    config = ModelConfig.from_dir(path)
    ready = node.wait_for(lambda e: e.get("event") == "device ready")
    counted = held_bytes(path, "f32", [config.layer_name(i) for i in LAYERS])
    assert ready["weight_bytes"] == counted.cpu < counted.cuda


@needs_mlx
def test_the_kept_path_matches_the_dequantized_one_within_its_bound(served):
    check_kept(*served)
    check_weight_bytes(served[0], served[1])


def test_a_gptq_act_order_checkpoint_kept_int4_matches_its_dequantization_within_the_bound(tmp_path):
    plain = make_checkpoint(tmp_path / "plain", "llama")
    path = random_gptq(tmp_path / "gptq", plain, 32, desc_act=True)
    node = start(path, tmp_path, flags=())
    try:
        check_kept(node, path, gptq_reference(tmp_path / "reference", plain, path))
    finally:
        assert node.stop() == 0
