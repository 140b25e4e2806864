"""Cake's topology file: parsing, range expansion, the worker's entry, layer placement."""

from __future__ import annotations

import pytest

from cakemp.errors import ConfigError
from cakemp.topology import Node, Topology, collapse_layers, expand_layers, place_layers

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
    """Placement is contiguous, with layer i of n on device i*D//n, as the seed splits them."""
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
