"""Cake's topology file: parsing, range expansion, the worker's entry, layer placement."""

from __future__ import annotations

import pytest

from cakemp.errors import ConfigError
from cakemp.topology import (
    Capacity,
    Node,
    Topology,
    collapse_layers,
    default_assignment,
    expand_layers,
    place_layers,
)

EXAMPLE = """
linux_server_1:
  host: 'linux_server.host:10128'
  description: 'NVIDIA Titan X Pascal (12GB)'
  layers:
    - 'model.layers.0-5'
iphone:
  host: 'iphone.host:10128'
  layers:
    - 'model.layers.17'
  vram_bytes: 8000000000
"""


def test_cakes_documented_example_parses_with_ranges_expanded():
    """Cake's clustering example gives two nodes in file order, 0-5 expanded inclusively."""
    topology = Topology.parse(EXAMPLE)
    assert [name for name, _ in topology.nodes] == ["linux_server_1", "iphone"]
    server = topology.worker("linux_server_1")[1]
    assert server.layers == tuple(f"model.layers.{i}" for i in range(6))
    assert server.description == "NVIDIA Titan X Pascal (12GB)"
    assert topology.worker("iphone")[1] == Node("iphone.host:10128", ("model.layers.17",), vram_bytes=8000000000)


@pytest.mark.parametrize("entry, expected", [
    ("model.layers.3-3", ("model.layers.3",)),
    ("model.language_model.layers.10-12", tuple(f"model.language_model.layers.{i}" for i in (10, 11, 12))),
    ("model.layers.7", ("model.layers.7",)),
    ("lm_head", ("lm_head",)),
    ("12-14", ("12-14",)),  # Cake's regex needs a non-digit before the first number
])
def test_range_expansion_follows_cakes_regex(entry, expected):
    """Entries matching `(.+[^\\d])(\\d+)-(\\d+)` expand inclusively; others are kept as written."""
    assert expand_layers([entry]) == expected


def test_a_descending_range_is_an_error():
    """`model.layers.5-2` is refused, as Cake refuses it."""
    with pytest.raises(ConfigError, match="5-2"):
        expand_layers(["model.layers.5-2"])


def test_an_unknown_name_among_several_entries_is_an_error():
    """A name not in a file of several entries is refused, naming the entries there are."""
    with pytest.raises(ConfigError, match="'nobody' is not in the topology .*linux_server_1"):
        Topology.parse(EXAMPLE).worker("nobody")


def test_an_unknown_name_falls_back_to_the_only_entry():
    """With one entry, a name not in the file resolves to it, and the caller learns which one."""
    assert Topology.parse("w1: {host: 'h:1', layers: [model.layers.0]}\n").worker("nobody")[0] == "w1"


@pytest.mark.parametrize("text", ["", "{}\n"])
def test_an_empty_topology_is_an_error(text):
    """An empty file has no entry to fall back to."""
    with pytest.raises(ConfigError, match="empty"):
        Topology.parse(text).worker("w")


@pytest.mark.parametrize("text, match", [
    ("- a\n- b\n", "must map"),
    ("w: {layers: []}\n", "host"),
    ("w: {host: 'h:1', layers: 'model.layers.0'}\n", "list"),
    ("w: [unclosed\n", "YAML"),
])
def test_malformed_topologies_are_config_errors(text, match):
    """Wrong shapes and bad YAML are reported as ConfigError naming the problem."""
    with pytest.raises(ConfigError, match=match):
        Topology.parse(text)


def test_a_missing_file_is_a_config_error(tmp_path):
    """A topology path that does not exist is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="nope.yml"):
        Topology.load(tmp_path / "nope.yml")


@pytest.mark.parametrize("layers, devices, expected", [
    (4, 2, [[0, 1], [2, 3]]),
    (5, 2, [[0, 1, 2], [3, 4]]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
    (3, 1, [[0, 1, 2]]),
    (2, 4, [[0], [], [1], []]),
])
def test_layer_i_of_n_goes_to_device_i_times_d_over_n(layers, devices, expected):
    """Placement is contiguous, with layer i of n on device i*D//n, as Cake's multi-GPU worker splits them."""
    names = [f"model.layers.{i}" for i in range(layers)]
    assert place_layers(names, devices) == tuple(tuple(names[i] for i in run) for run in expected)


@pytest.mark.parametrize("layers, expected", [
    ([f"model.layers.{i}" for i in range(16)], ("model.layers.0-15",)),
    (["model.layers.0", "model.layers.1", "model.layers.3", "lm_head"], ("model.layers.0-1", "model.layers.3", "lm_head")),
    (["a.1", "a.2", "b.3", "b.4", "a.3"], ("a.1-2", "b.3-4", "a.3")),
    (["model.layers.07", "model.layers.8"], ("model.layers.07", "model.layers.8")),
    ([], ()),
])
def test_collapse_layers_writes_consecutive_layers_as_ranges(layers, expected):
    """Consecutive numbered layers of one base become one Cake range, which expands back to them."""
    assert collapse_layers(layers) == expected
    assert expand_layers(collapse_layers(layers)) == tuple(layers)


# Cake's default strategy (docs/protocol.md, Layer assignment), worked by hand from the rule:
# workers together get round(workers' TFLOPS / all TFLOPS x layers), halves away from zero; each
# in turn (fastest first) round(its TFLOPS / the TFLOPS left x the layers left), at least one,
# capped by its memory; the last what is left; the master keeps the rest.
GIB = 1 << 30
CAKES_EXAMPLE = """
bahamut:
  host: "192.168.50.147:10128"
  description: "2x TITAN X Pascal"
  layers: []
  vram_bytes: 25769803776
  tflops: 40.0
stevie:
  host: "192.168.50.32:10128"
  description: "Apple M3 Pro"
  layers: []
  vram_bytes: 38654705664
  tflops: 14.0
"""


def layers(first: int, last: int, prefix: str = "model.layers") -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(first, last + 1))


def assigned(text: str, num_layers: int, master_tflops: float, layer_bytes: int = 0) -> dict[str, tuple[str, ...]]:
    topology = Topology.parse(text)
    assert topology.needs_assignment
    return {name: node.layers for name, node in topology.assigned(num_layers, "model.layers", master_tflops,
                                                                  layer_bytes).nodes}


def test_cakes_own_topology_example_is_split_by_tflops_and_the_master_keeps_the_rest():
    """Cake's test file, 24 layers, master 30: workers round(54/84 x 24) = round(15.43) = 15;
    bahamut round(40/54 x 15) = round(11.1) = 11 (0-10), stevie the other 4 (11-14); master 15-23."""
    assert assigned(CAKES_EXAMPLE, 24, 30.0) == {"bahamut": layers(0, 10), "stevie": layers(11, 14)}


def test_a_nodes_memory_caps_its_share_at_85_percent():
    """Layers of 2 GiB: bahamut holds int(24 GiB x 0.85) // 2 GiB = 10 (0-9), of its 11; stevie gets
    what is left, 5 (10-14), within its 15."""
    assert assigned(CAKES_EXAMPLE, 24, 30.0, 2 * GIB) == {"bahamut": layers(0, 9), "stevie": layers(10, 14)}


def test_ties_go_in_name_order_and_halves_round_away_from_zero():
    """17 layers, master 0: the workers get all 17; "a" (first by name, though second in the file)
    round(20/40 x 17) = round(8.5) = 9 (Python's round would give 8), "b" the other 8."""
    text = "b: {host: 'b:1', layers: [], tflops: 20}\na: {host: 'a:1', layers: [], tflops: 20}\n"
    assert assigned(text, 17, 0.0) == {"b": layers(9, 16), "a": layers(0, 8)}


def test_nodes_without_tflops_are_guessed_from_their_memory_and_maker():
    """NVIDIA 8 GiB: 3/GiB = 24; Apple 16 GiB: 0.4/GiB = 6.4; anything else with memory: 2. Master 0,
    10 layers: nv round(24/32.4 x 10) = 7 (0-6), mac round(6.4/8.4 x 3) = round(2.29) = 2 (7-8), phone 1."""
    text = (f"nv: {{host: 'a:1', layers: [], vram_bytes: {8 * GIB}, description: NVIDIA GeForce RTX 4060}}\n"
            f"mac: {{host: 'b:1', layers: [], vram_bytes: {16 * GIB}, backend: Apple M2}}\n"
            f"phone: {{host: 'c:1', layers: [], vram_bytes: {4 * GIB}, hostname: pixel}}\n")
    assert assigned(text, 10, 0.0) == {"nv": layers(0, 6), "mac": layers(7, 8), "phone": layers(9, 9)}


def test_bare_nodes_get_nothing_beside_a_master_with_tflops_and_half_the_layers_beside_one_without():
    """Nodes giving neither tflops nor memory weigh 0: beside a 2-TFLOPS master (a CPU, as Cake counts
    it) they get round(0) = 0 layers; with no TFLOPS anywhere, half the layers (4 of 9), split evenly
    in name order with the remainder to the last: 1, 1, 2."""
    text = "c: {host: 'c:1', layers: []}\na: {host: 'a:1', layers: []}\nb: {host: 'b:1', layers: []}\n"
    assert assigned(text, 9, 2.0) == {"c": (), "a": (), "b": ()}
    assert assigned(text, 9, 0.0) == {"c": layers(2, 3), "a": layers(0, 0), "b": layers(1, 1)}


def test_workers_weighing_nothing_after_the_last_with_tflops_do_not_break_the_division():
    """Workers of 10, 0 and 0 TFLOPS, master 0, 6 layers: the first takes all 6; then 0/0 TFLOPS is
    NaN in Cake (rounded to 0, raised to 1, capped by the 0 layers left): the others get none."""
    text = "x: {host: 'a:1', layers: [], tflops: 10}\ny: {host: 'b:1', layers: []}\nz: {host: 'c:1', layers: []}\n"
    assert assigned(text, 6, 0.0) == {"x": layers(0, 5), "y": (), "z": ()}


def test_cakes_zero_config_examples():
    """From Cake's default.rs tests: one worker as fast as the master gets half of 24 (12); a worker
    whose memory holds none gets none; with no TFLOPS at all, half (12)."""
    assert default_assignment([Capacity("w1", 10.0)], 24, 10.0) == [(0, range(0, 12))]
    assert default_assignment([Capacity("small", 1000.0, max_layers=0)], 24, 1.0) == []
    assert default_assignment([Capacity("w1", 0.0)], 24, 0.0) == [(0, range(0, 12))]
    assert default_assignment([], 24, 10.0) == default_assignment([Capacity("w1", 10.0)], 0, 10.0) == []


def test_only_a_topology_whose_every_node_lists_no_layers_is_assigned():
    """Cake's `needs_auto_sharding`: not an empty file, not one where some node lists layers."""
    assert not Topology.parse("").needs_assignment
    assert not Topology.parse("a: {host: 'a:1', layers: []}\nb: {host: 'b:1', layers: [model.layers.0]}").needs_assignment


def test_a_node_with_infinite_tflops_is_a_config_error():
    with pytest.raises(ConfigError, match="tflops must be a finite number"):
        assigned("a: {host: 'a:1', layers: [], tflops: .inf}\n", 4, 0.0)
