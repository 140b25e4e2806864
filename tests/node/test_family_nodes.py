"""`cakemp run --gpus cpu:2` serving the later families with layers of two kinds, over TCP.

One node per family (a node serves one checkpoint), each started once for this module and
serving layers 1-3 of a hub-keyed checkpoint (tests/support/families.py), layers 1-2 on device 0 and
layer 3 on device 1:
* Gemma 3: global, local, global; local layers rotate with their own base, (1 + w) norms
  folded in the device processes, tied embeddings;
* EXAONE 4: local, local, global; device 1 serves only a layer without rotary;
* Phi-3/4: fused qkv_proj and gate_up_proj, partial rotary, longrope past its original
  context (16 positions, so both factor sets are used), a window;
* OLMo 2: norms after attention and after the MLP, q/k norm over the whole projection;
* Falcon 3: Llama with its own rope_theta and head_dim;
* Qwen3-MoE: sparse, dense, sparse (`mlp_only_layers`), 8 experts with 2 per token, so a
  7-token prompt routes to several experts on each device.
Through a Cake-style master, a prompt, 8 decode steps and then a prompt sent in 3-token
chunks (a second session) match HF's own decoder layers in f32 to the runner parity bound
(the wire carries f32 exactly, so the node adds no error to the block's ~7e-7).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.families import HUB_FAMILIES
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, write_topology
from tests.support.tolerance import F32_REL, rel_error

LAYERS = [1, 2, 3]
# name -> (family, config overrides, hub config keys) as tests/support/families.py gives them
NODE_FAMILIES = {**HUB_FAMILIES, "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [2]}, None)}


@pytest.fixture(scope="module", params=["gemma3", "exaone4", "phi3", "olmo2", "falcon3", "qwen3_moe"])
def served(request, tmp_path_factory):
    """(node, its checkpoint) for one family; pytest starts the next family's after this one's tests."""
    family, overrides, hub_config = NODE_FAMILIES[request.param]
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), family, shards=2, hub_config=hub_config,
                           **overrides)
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.1-3"])
    node = RunningNode(path, topology, "--gpus", "cpu:2", "--dtype", "f32")
    yield node, path
    assert node.stop() == 0


async def check_session(port: int, reference: HFLayers, chunks: list[int]) -> None:
    """Send `chunks` tokens at a time through layers 1-3 as one session; each reply matches HF's."""
    master = await CakeMaster.connect(port, LAYERS)
    generator = torch.Generator().manual_seed(len(chunks))
    position = 0
    for T in chunks:
        x = torch.randn(1, T, reference.config.hidden_size, generator=generator)
        ours, theirs = await master.forward(x, position), reference(x, position)
        assert rel_error(ours, theirs) <= F32_REL, f"tokens {position}..{position + T - 1}"
        position += T
    await master.goodbye()
    await master.close()


def test_prompt_decode_and_chunked_prompt_match_hf_across_both_devices(served):
    """A 7-token prompt with 8 decode steps, then in a new session a 12-token prompt in 3-token
    chunks and 8 decode steps, match HF's layers 1-3 in f32."""
    node, path = served

    async def main():
        await check_session(node.port, HFLayers(path, LAYERS, torch.float32), [7] + [1] * 8)
        await check_session(node.port, HFLayers(path, LAYERS, torch.float32), [3] * 4 + [1] * 8)

    asyncio.run(asyncio.wait_for(main(), 120))
