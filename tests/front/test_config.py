"""The node's configuration from `cakemp run`'s flags: each flag's default and conversion,
zero-config mode, --address parsing and the device processes' environment (no torch)."""

from __future__ import annotations

import re
import socket

import pytest

from cakemp.errors import ConfigError
from cakemp.address import parse_address
from cakemp.front.config import RUN_FLAGS, NodeConfig, device_environment, node_config
from cakemp.ipc.spec import MAX_BATCH, PREFILL_CHUNK
from cakemp.wire import Revision
from cakemp.wire.discovery import DISCOVERY_PORT
from tests.front.node import write_topology


def flag_values(**changes) -> dict:
    """Every `cakemp run` flag's value as click passes it when none is given, with `changes`."""
    values = {flag.key: flag.default for flag in RUN_FLAGS}
    assert changes.keys() <= values.keys()
    return values | changes


@pytest.fixture
def topology(tmp_path):
    return str(write_topology(tmp_path / "topology.yml", ["model.layers.0-3"], name="w1"))


def test_every_flag_is_declared_once_with_help():
    """No two flags share a name, and each but --log-level explains itself."""
    names = [flag.name for flag in RUN_FLAGS]
    assert len(names) == len(set(names)) == 27
    assert [flag.name for flag in RUN_FLAGS if not flag.help] == ["--log-level"]


def test_the_flags_defaults_are_the_configs_defaults(topology):
    """A node given only its name and topology is NodeConfig's defaults: the flags' defaults, converted."""
    config = node_config(flag_values(name="w1", topology=topology, gpus="cpu"), model_given=False)
    layers = tuple(f"model.layers.{i}" for i in range(4))
    assert config == NodeConfig(name="w1", layers=layers, devices=(None,))
    assert (config.host, config.port, config.model_dir, config.dtype, config.revision) == (
        "0.0.0.0", 10128, "./cake-data/Meta-Llama-3-8B/", "f16", Revision.V2)
    assert (config.request_timeout, config.restart_attempts, config.drain_timeout, config.stats_interval) == (
        60.0, 5, 30.0, 60.0)
    assert (config.max_batch, config.prefill_chunk, config.max_buffered_bytes) == (MAX_BATCH, PREFILL_CHUNK, 1 << 30)
    assert config.kv_budget_bytes is config.metrics_address is config.cluster_key is config.setup is None


def test_flag_values_are_converted_to_the_configs_units(topology):
    """MiB become bytes, --protocol a Revision, addresses (host, port); an empty optional flag is off."""
    config = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", kv_budget_mib=3, max_buffered_mib=2,
                                     protocol="1", address="127.0.0.1:7", metrics_address="", cluster_key=""),
                         model_given=False)
    assert (config.kv_budget_bytes, config.max_buffered_bytes) == (3 << 20, 2 << 20)
    assert (config.revision, config.address, config.devices) == (Revision.V1, ("127.0.0.1", 7), (None, None))
    assert config.metrics_address is config.cluster_key is None
    served = node_config(flag_values(name="w1", topology=topology, gpus="cpu", metrics_address=":9100"),
                         model_given=False)
    assert served.metrics_address == ("0.0.0.0", 9100)


def test_a_key_without_a_topology_is_zero_config_on_cakes_discovery_port():
    """--cluster-key and no --topology: no layers or model yet, the host's name, the setup's flags."""
    config = node_config(flag_values(cluster_key="k", gpus="cpu", max_model_gib=0.5), model_given=True)
    assert (config.name, config.layers, config.model_dir) == (socket.gethostname(), (), "")
    setup = config.setup
    assert (setup.cluster_key, setup.max_model_bytes, setup.discovery_host, setup.discovery_port) == (
        "k", 1 << 29, "0.0.0.0", DISCOVERY_PORT)


@pytest.mark.parametrize("changes, words", [
    ({"topology": "{topology}"}, "no --name"),
    ({"name": "w1"}, "no --topology given (and no --cluster-key"),
    ({"name": "w1", "topology": "{topology}", "metrics_address": "nowhere"}, "invalid --metrics-address 'nowhere'"),
    ({"name": "w1", "topology": "{topology}", "address": "nowhere"}, "invalid --address 'nowhere'"),
])
def test_missing_or_malformed_flags_are_config_errors(topology, changes, words):
    """Each names the flag that is wrong."""
    changes = {key: value.format(topology=topology) for key, value in changes.items()}
    with pytest.raises(ConfigError, match=re.escape(words)):
        node_config(flag_values(gpus="cpu", **changes), model_given=False)


@pytest.mark.parametrize("text, expected", [
    ("0.0.0.0:10128", ("0.0.0.0", 10128)),
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("[::1]:9000", ("::1", 9000)),
    (":10128", ("0.0.0.0", 10128)),
])
def test_addresses_split_into_host_and_port(text, expected):
    """host:port, with IPv6 hosts in brackets, as Cake's --address."""
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["10128", "host:", "host:port", "host:70000"])
def test_bad_addresses_are_config_errors(text):
    """An address without a valid port is refused."""
    with pytest.raises(ConfigError):
        parse_address(text)


def test_device_processes_number_gpus_in_pci_order_and_get_expandable_segments():
    """The front gives its devices PCI bus order, and torch's expandable segments unless the operator chose."""
    assert device_environment({}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for operators in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert device_environment({operators: "max_split_size_mb:512"}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
