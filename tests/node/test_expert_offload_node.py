"""`cakemp run --expert-offload` over TCP: a Qwen3.5-MoE node (linear and full attention, shared
experts, 8 routed experts 2 per token) serving layers 1-3 of a plain checkpoint on one f32 CPU
device with its routed experts offloaded and a cache of 0 MiB (smaller than one expert: every
expert a token needs is read from the checkpoint, used and dropped), against HF's layers to
F32_REL as the resident node is (tests/node/test_hybrid_node.py): a prompt and 8 decode steps, a
prompt in 3-token chunks, and two sessions at once. /metrics counts the experts read and their
bytes, and none held. The exact equality with resident experts, for every family, format and a
cache of any size, is tests/compute/test_expert_offload.py's.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.checkpoints import make_checkpoint
from tests.support.node import quiescent
from tests.support.quantized_node import check_session, start

DEVICE = (("device", "cpu:0"),)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    path = make_checkpoint(tmp / "plain", "qwen3_5_moe")
    node = start(path, tmp, flags=("--expert-offload", "--expert-cache-mib", "0", "--metrics-address", "127.0.0.1:0"))
    yield node, path
    assert node.stop() == 0


def test_offloaded_experts_match_hf_and_metrics_count_their_reads(served):
    node, path = served

    async def main():
        await check_session(node.port, path, path, [7] + [1] * 8)
        await asyncio.gather(check_session(node.port, path, path, [3] * 4 + [1] * 4),
                             check_session(node.port, path, path, [5, 1, 1]))

    asyncio.run(asyncio.wait_for(main(), 120))
    metrics = quiescent(node.metrics_port())
    misses = metrics["cakemp_expert_cache_misses_total", DEVICE]
    # At least one expert per token and layer (3 layers, 2 routed per token, some shared among a prompt's tokens).
    assert misses >= 3 * (7 + 8 + 12 + 4 + 5 + 2)
    assert metrics["cakemp_expert_cache_hits_total", DEVICE] == 0
    assert metrics["cakemp_expert_read_bytes_total", DEVICE] > 0
    assert metrics["cakemp_expert_cache_bytes", DEVICE] == 0
