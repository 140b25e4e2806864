"""tools/gpu_check's node-perf counts a node's decode rate with bench.masters: masters in several
processes. What they count must be what the node answered, or every rate it reports is a lie."""

from __future__ import annotations

import asyncio

import torch

from bench.front_floor import Floor
from bench.masters import Masters
from cakemp.compute import tensors
from cakemp.master.client import WorkerClient
from cakemp.wire import DType, RawTensor
from tests.support.checkpoints import make_checkpoint
from tests.support.node import RunningNode, scrape, write_topology

LAYERS = ["model.layers.0", "model.layers.1"]


def test_the_masters_count_what_the_node_answered_in_their_window(tmp_path):
    path = make_checkpoint(tmp_path, "llama", num_hidden_layers=2)  # TINY: hidden 64
    topology = write_topology(tmp_path / "topology.yml", ["model.layers.0-1"])
    node = RunningNode(path, topology, "--gpus", "cpu:1", "--dtype", "bf16", "--metrics-address", "127.0.0.1:0")
    try:
        port = node.metrics_port()
        masters = Masters(node.port, 3, 64, 8, LAYERS, processes=2)  # 2 and 1 masters, each 8 tokens in
        try:
            before = scrape(port)["cakemp_requests_total", ()]
            window = masters.window(0.5)
            after = scrape(port)["cakemp_requests_total", ()]
        finally:
            masters.close()
    finally:
        assert node.stop() == 0
    assert before == 3  # each master's prompt, sent as it started
    assert window.done > 3 and after - before == window.done
    assert window.wall_s >= 0.5 and window.cpu_s > 0


def test_the_floor_front_relays_each_activation_back_and_the_masters_count_it(tmp_path):
    """tools/gpu_check's node-perf times the same masters through bench/front_floor.py's floor front: each reply
    must be the master's own activation, relayed through the echo device, and every master counted."""
    floor = Floor(tmp_path, busy_s=0.0005)
    try:
        async def one_batch() -> tuple[RawTensor, RawTensor]:
            x = tensors.to_raw(torch.randn(1, 1, 64), DType.BF16)
            async with await WorkerClient.connect("127.0.0.1", floor.port) as client:
                await client.hello()
                return x, await client.batch(x, [(name, 0, i) for i, name in enumerate(LAYERS)])

        x, y = asyncio.run(one_batch())
        masters = Masters(floor.port, 3, 64, 8, LAYERS, processes=2)
        try:
            window = masters.window(0.3)
        finally:
            masters.close()
    finally:
        floor.stop()
    assert (y.dtype, y.shape, bytes(y.data)) == (x.dtype, x.shape, bytes(x.data))
    assert window.done >= 3 and window.cpu_s > 0
