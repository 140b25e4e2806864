"""tools/gpu_check's node-perf counts a node's decode rate with bench.masters: masters in several
processes. What they count must be what the node answered, or every rate it reports is a lie."""

from __future__ import annotations

from bench.masters import Masters
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
