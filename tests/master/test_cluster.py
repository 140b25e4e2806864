"""The master's zero-config half: Cake's layer assignment, and `cakemp generate --discover` against a live node."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer

from cakemp.cli import cli
from cakemp.demo.synthetic import write_checkpoint
from cakemp.master.cluster import assign_layers, max_layers
from cakemp.master.discovery import DiscoveredWorker
from cakemp.wire.discovery import Announcement, GpuInfo
from tests.front.node import ZeroConfigNode

transformers = pytest.importorskip("transformers")

GIB = 1 << 30
PROMPT = "Once upon a time"
STEPS = 8


def worker(name: str, *gpus: tuple[str, int, float]) -> DiscoveredWorker:
    return DiscoveredWorker("10.0.0.1", Announcement("h", name, 10128, tuple(GpuInfo(*g) for g in gpus)))


def test_layers_go_by_tflops_fastest_first_in_contiguous_runs_and_the_master_keeps_the_rest():
    """32 layers, master 10 TFLOPS, workers 30 and 20: round(50/60 x 32) = 27 to the workers, 16 then 11."""
    slow, fast = worker("slow", ("A", 80 * GIB, 20.0)), worker("fast", ("B", 80 * GIB, 30.0))
    (first, a), (second, b) = assign_layers([slow, fast], 32, 10.0, 1 << 20)
    assert (first.name, second.name) == ("fast", "slow")
    assert a == tuple(f"model.layers.{i}" for i in range(0, 16)) and b == tuple(f"model.layers.{i}" for i in range(16, 27))


def test_a_worker_gets_no_more_layers_than_its_memory_holds():
    """A 24 GiB CUDA device keeps max(5 %, 768 MiB) and holds 11 layers of 2 GiB; a CPU keeps 20 %."""
    small = worker("small", ("RTX", 24 * GIB, 1000.0))
    assert max_layers(small.announcement.gpus, 2 * GIB) == 11
    assert max_layers((GpuInfo("CPU (x86_64)", 10 * GIB, 2.0),), GIB) == 8
    ((_, layers),) = assign_layers([small], 40, 1.0, 2 * GIB)
    assert len(layers) == 11


def test_without_tflops_the_workers_split_half_the_layers():
    a, b = worker("a", ("A", 80 * GIB, 0.0)), worker("b", ("B", 80 * GIB, 0.0))
    assert [len(layers) for _, layers in assign_layers([a, b], 9, 0.0, 0)] == [2, 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic")
    write_checkpoint(path)
    return path


def test_cakemp_generate_discovers_sets_up_and_generates_hfs_greedy_text(checkpoint, tmp_path):
    """`cakemp generate --discover` finds a waiting zero-config node, gives it the first half of the
    layers (equal TFLOPS), pushes them, and prints HF's greedy continuation."""
    node = ZeroConfigNode(tmp_path)
    try:
        result = CliRunner().invoke(cli, [
            "generate", "--model", str(checkpoint), "--discover", "127.0.0.1", "--discovery-port",
            str(node.discovery_port), "--min-workers", "1", "--cluster-key", ZeroConfigNode.KEY, "--prompt", PROMPT,
            "--max-tokens", str(STEPS), "--temperature", "0", "--repeat-penalty", "1", "--dtype", "f32",
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert f"worker at 127.0.0.1:{node.port}: model.layers.0..model.layers.2 (3 layers)" in result.stderr
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        ids = torch.tensor([tokenizer.encode(PROMPT).ids])
        out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, attention_mask=torch.ones_like(ids))
        assert result.stdout == PROMPT + tokenizer.decode(out[0, ids.shape[1]:].tolist()) + "\n"
    finally:
        assert node.stop() == 0
