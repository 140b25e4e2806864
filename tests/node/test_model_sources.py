"""Where a node finds its model: by its Hugging Face id, completing a topology whose nodes list
no layers as Cake (HEAD) does, and in a `cake split` bundle.

`cakemp run --model tiny-org/llama4` from a hub cache (built in a temporary directory,
HF_HUB_OFFLINE=1) that holds config.json, the index and only the shards of the layers this node
ends up serving, with a topology whose one node lists no layers. Then `cakemp generate --model
tiny-org/llama4` from a full cache, with the same topology, computes the same assignment and
generates HF's greedy text through the node. A second node, started only for the last test, is
`cakemp run --model <bundle>` with a bundle as `cake split` writes it (config.json copied in).

The assignment, worked by hand from Cake's rule (docs/protocol.md, Layer assignment): 4 layers, the node 2 TFLOPS, the
master 2 (a CPU as Cake counts one): the workers get round(2/4 x 4) = 2 layers, the node being
the only one takes them from layer 0 (model.layers.0-1), the master keeps 2-3.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from cakemp.cli import cli
from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from cakemp.errors import RemoteWorkerError
from tests.support.checkpoints import HFLayers
from tests.support.hub_cache import write_snapshot
from tests.support.master import CakeMaster
from tests.support.node import RunningNode
from tests.support.tolerance import assert_close

transformers = pytest.importorskip("transformers")

REPO = "tiny-org/llama4"
SPEC = SyntheticSpec(num_hidden_layers=4, shards=6)
SERVED = ["model.layers.0", "model.layers.1"]  # the assignment worked in the module's docstring
PROMPT = "Once upon a time"
STEPS = 6


def topology(port: int = 10128) -> str:
    return yaml.safe_dump({"worker": {"host": f"127.0.0.1:{port}", "layers": [], "tflops": 2.0}})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    write_checkpoint(path, SPEC)
    return path


@pytest.fixture(scope="module")
def worker_cache(checkpoint, tmp_path_factory):
    """A hub cache holding config.json, the index and the shards with a tensor of layers 0-1 (not the others)."""
    weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {shard for name, shard in weight_map.items() if name.startswith(("model.layers.0.", "model.layers.1."))}
    assert needed != set(weight_map.values())  # some shards are left out
    cache = tmp_path_factory.mktemp("worker-hub")
    write_snapshot(cache, REPO, {name: checkpoint / name for name in ["config.json", "model.safetensors.index.json",
                                                                       *sorted(needed)]})
    return cache


@pytest.fixture(scope="module")
def node(worker_cache, tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "topology.yml"
    path.write_text(topology())
    running = RunningNode(REPO, path, "--gpus", "cpu", "--dtype", "f32", "--master-tflops", "2",
                          env={"HF_HUB_CACHE": str(worker_cache), "HF_HUB_OFFLINE": "1"})
    yield running
    assert running.stop() == 0


def test_the_node_takes_the_layers_cakes_rule_gives_it_and_says_every_node_must_agree(node):
    warning = next(e for e in node.events() if e.get("event", "").startswith("the topology lists no layers"))
    assert (warning["level"], warning["master_tflops"], warning["num_layers"]) == ("warning", 2.0, 4)
    assigned = next(e for e in node.events() if e.get("event") == "layers assigned")
    assert (assigned["layers"], assigned["count"]) == (["model.layers.0-1"], 2)


def test_the_node_serves_exactly_those_layers_from_the_shards_it_has(node, checkpoint, worker_cache):
    """Layers 0-1 answer as HF's layers; layer 2 is refused; nothing was added to the cache."""
    files = set(worker_cache.rglob("*"))
    ref = HFLayers(checkpoint, [0, 1], torch.float32)

    async def main():
        master = await CakeMaster.connect(node.port, [0, 1])
        x = torch.randn(1, 5, SPEC.hidden_size)
        assert_close(await master.forward(x, 0), ref(x, 0))
        await master.close()
        beyond = await CakeMaster.connect(node.port, [2])
        with pytest.raises(RemoteWorkerError, match="model.layers.2"):
            await beyond.forward(torch.randn(1, 1, SPEC.hidden_size), 0)
        await beyond.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert set(worker_cache.rglob("*")) == files


def test_cakemp_generate_by_name_assigns_the_same_layers_and_generates_hfs_greedy_text(node, checkpoint, tmp_path):
    """The master, from its own full cache, completes the same topology the same way (the node at
    its real address) and its greedy text through the node is HF's."""
    cache = tmp_path / "master-hub"
    write_snapshot(cache, REPO, {path.name: path for path in checkpoint.iterdir()})
    (tmp_path / "topology.yml").write_text(topology(node.port))
    result = CliRunner(env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}).invoke(cli, [
        "generate", "--model", REPO, "--topology", str(tmp_path / "topology.yml"), "--master-tflops", "2",
        "--prompt", PROMPT, "--max-tokens", str(STEPS), "--temperature", "0", "--repeat-penalty", "1",
        "--dtype", "f32",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"worker at 127.0.0.1:{node.port}: model.layers.0..model.layers.1 (2 layers)" in result.stderr
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, attention_mask=torch.ones_like(ids))
    assert result.stdout == PROMPT + tokenizer.decode(out[0, ids.shape[1]:].tolist()) + "\n"


@pytest.fixture(scope="module")
def bundle(checkpoint, tmp_path_factory):
    """`cake split`'s w1-node/ for layers 2-3: model/ holding an index of only `weight_map`, every
    entry in reduced.safetensors (the tensors named "<layer>." of its layers), and config.json copied
    in by hand; topology.yml holding only this node, with the fields Cake writes."""
    root = tmp_path_factory.mktemp("split") / "w1-node"
    (root / "model").mkdir(parents=True)
    layers = ["model.layers.2", "model.layers.3"]
    tensors = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors |= {name: t for name, t in load_file(shard).items() if any(name.startswith(f"{l}.") for l in layers)}
    save_file(tensors, root / "model" / "reduced.safetensors")
    (root / "model" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(sorted(tensors), "reduced.safetensors")}, indent=2))
    (root / "model" / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    (root / "topology.yml").write_text(yaml.safe_dump({"w1": {
        "host": "127.0.0.1:10128", "description": None, "layers": layers, "vram_bytes": 0, "tflops": 0.0,
        "backend": "", "hostname": "", "os": ""}}))
    return root


def test_a_bundle_given_as_model_serves_its_layers_from_its_reduced_file(bundle, checkpoint):
    """`--model <bundle>`, no --topology: layers 2-3 answer as HF's layers over the full checkpoint."""
    running = RunningNode(None, None, "--model", str(bundle), "--gpus", "cpu", "--dtype", "f32", name="w1")
    try:
        ref = HFLayers(checkpoint, [2, 3], torch.float32)

        async def main():
            master = await CakeMaster.connect(running.port, [2, 3])
            x = torch.randn(1, 4, SPEC.hidden_size)
            assert_close(await master.forward(x, 0), ref(x, 0))
            await master.close()

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        assert running.stop() == 0
