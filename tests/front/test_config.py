"""The node's configuration from `cakemp run`'s flags: each flag's default and conversion,
zero-config mode, --address parsing, who may connect, the cluster key's rules, a CPU device's
KV budget and the device processes' environment (no torch)."""

from __future__ import annotations

import dataclasses
import os
import re
import socket

import pytest
from structlog.testing import capture_logs

from cakemp.address import is_loopback, parse_address
from cakemp.errors import ConfigError
from cakemp.front.config import KEY_PLACEHOLDER, KEY_VARIABLES, RUN_FLAGS, NodeConfig, node_config, scrub_cluster_key
from cakemp.front.devices import CPU_KV_SHARE, device_environment, device_specs, front_cores
from cakemp.ipc.spec import MAX_BATCH, PREFILL_CHUNK
from cakemp.wire import Revision
from cakemp.wire.discovery import DISCOVERY_PORT
from tests.support.node import write_topology

KEY = "0123456789abcdef0123"  # long enough not to be warned about


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
    assert len(names) == len(set(names)) == 47
    assert [flag.name for flag in RUN_FLAGS if not flag.help] == ["--log-level"]


def test_the_flags_defaults_are_the_configs_defaults(topology):
    """A node given only its name and topology is NodeConfig's defaults: the flags' defaults, converted."""
    config = node_config(flag_values(name="w1", topology=topology, gpus="cpu"), model_given=False)
    layers = tuple(f"model.layers.{i}" for i in range(4))
    assert config == NodeConfig(name="w1", parts=layers, devices=(None,), checkpoint_path=config.model)
    assert (config.host, config.port, config.model, config.dtype, config.revision) == (
        "0.0.0.0", 10128, "./cake-data/Meta-Llama-3-8B/", "f16", Revision.V2)
    assert (config.request_timeout, config.restart_attempts, config.drain_timeout, config.stats_interval) == (
        60.0, 5, 30.0, 60.0)
    assert (config.max_batch, config.prefill_chunk, config.max_buffered_bytes) == (MAX_BATCH, PREFILL_CHUNK, 1 << 30)
    assert config.kv_budget_bytes is config.metrics_address is config.cluster_key is config.setup is None
    assert config.allow_from is None


def test_flag_values_are_converted_to_the_configs_units(topology):
    """MiB become bytes, --protocol a Revision, addresses (host, port); an empty optional flag is off."""
    config = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", kv_budget_mib=3, max_buffered_mib=2,
                                     protocol="1", address="127.0.0.1:7", metrics_address="", allow_from=""),
                         model_given=False)
    assert (config.kv_budget_bytes, config.max_buffered_bytes) == (3 << 20, 2 << 20)
    assert (config.revision, config.address, config.devices) == (Revision.V1, ("127.0.0.1", 7), (None, None))
    assert config.metrics_address is config.allow_from is None
    served = node_config(flag_values(name="w1", topology=topology, gpus="cpu", metrics_address=":9100"),
                         model_given=False)
    assert served.metrics_address == ("0.0.0.0", 9100)


def test_a_key_without_a_topology_is_zero_config_on_cakes_discovery_port():
    """--cluster-key and no --topology: no layers or model yet, the host's name, the setup's flags."""
    config = node_config(flag_values(cluster_key=KEY, gpus="cpu", max_model_gib=0.5), model_given=True)
    assert (config.name, config.parts, config.checkpoint_path) == (socket.gethostname(), (), "")
    setup = config.setup
    assert (setup.cluster_key, setup.max_model_bytes, setup.discovery_host, setup.discovery_port) == (
        KEY, 1 << 29, "0.0.0.0", DISCOVERY_PORT)
    # Without --max-model-gib a push is limited by the cache's disk alone (setup/cache.py).
    assert node_config(flag_values(cluster_key=KEY, gpus="cpu"), model_given=True).setup.max_model_bytes is None


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


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("gpu-box", False),
])
def test_a_bind_address_is_loopback_only_when_nothing_else_can_reach_it(host, loopback):
    assert is_loopback(host) is loopback


# --------------------------------------------------------------------------- who may connect


def test_allow_from_becomes_an_allow_list_and_a_bad_entry_is_a_config_error(topology):
    """--allow-from's text is parsed at start; an entry that is no address names the flag."""
    config = node_config(flag_values(name="w1", topology=topology, gpus="cpu", allow_from="10.0.0.0/24, fd00::1"),
                         model_given=False)
    assert config.allow_from.allows("10.0.0.9") and config.allow_from.allows("fd00::1")
    with pytest.raises(ConfigError, match=re.escape("invalid --allow-from entry '10.0.0.300'")):
        node_config(flag_values(name="w1", topology=topology, gpus="cpu", allow_from="10.0.0.300"), model_given=False)


@pytest.mark.parametrize("changes, warned", [
    ({}, True),  # 0.0.0.0, anyone who reaches it
    ({"address": "[::]:10128"}, True),
    ({"address": "127.0.0.1:10128"}, False),
    ({"allow_from": "10.0.0.2"}, False),
    ({"cluster_key": KEY}, False),
])
def test_a_node_open_beyond_loopback_with_neither_key_nor_list_warns_at_start(topology, changes, warned):
    with capture_logs() as logs:
        node_config(flag_values(name="w1", topology=topology, gpus="cpu", **changes), model_given=False)
    assert any("any peer that reaches the port" in entry["event"] for entry in logs) is warned


# --------------------------------------------------------------------------- the cluster key


@pytest.mark.parametrize("key, words", [
    ("", "the cluster key is empty"),
    ("   ", "the cluster key is empty"),
    ("change-me", "the cluster key is the example's 'change-me'"),
    (KEY_PLACEHOLDER, f"the cluster key is the example's '{KEY_PLACEHOLDER}'"),
])
def test_an_empty_or_example_key_is_refused(topology, key, words):
    """With a topology or without (zero-config), and saying how to make a key."""
    for mode in ({"name": "w1", "topology": topology}, {}):
        with pytest.raises(ConfigError, match=re.escape(words)) as refused:
            node_config(flag_values(gpus="cpu", cluster_key=key, **mode), model_given=False)
        assert "openssl rand -hex 32" in str(refused.value)


@pytest.mark.parametrize("key, warned", [("short secret", True), ("x" * 15, True), ("x" * 16, False), (KEY, False)])
def test_a_key_under_16_characters_is_warned_about(topology, key, warned):
    with capture_logs() as logs:
        node_config(flag_values(name="w1", topology=topology, gpus="cpu", cluster_key=key), model_given=False)
    short = [entry for entry in logs if entry["event"].startswith("the cluster key is short")]
    assert bool(short) is warned
    assert all(key not in str(entry) for entry in logs)  # the key itself is never logged


def test_the_key_is_taken_out_of_the_environment_and_an_empty_variable_is_refused():
    """Both variables go (click has read them by then); one that is set but empty is a ConfigError,
    since click would read it as no key at all."""
    environ = {"CAKE_CLUSTER_KEY": KEY, "CAKEMP_CLUSTER_KEY": KEY, "PATH": "/bin"}
    scrub_cluster_key(environ)
    assert environ == {"PATH": "/bin"}
    for name in KEY_VARIABLES:
        with pytest.raises(ConfigError, match=f"{name} is set but empty"):
            scrub_cluster_key({name: ""})


# --------------------------------------------------------------------------- the KV budget of a CPU device


def test_prefix_reuse_is_on_per_connection_unless_told_otherwise(topology):
    """By default a node reuses prefixes within a connection; --no-prefix-reuse turns that off and
    --share-prefixes shares them across connections; each device is told."""
    default = node_config(flag_values(name="w1", topology=topology, gpus="cpu"), model_given=False)
    assert (default.prefix_reuse, default.share_prefixes) == (True, False)
    changed = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", no_prefix_reuse=True,
                                      share_prefixes=True), model_given=False)
    assert (changed.prefix_reuse, changed.share_prefixes) == (False, True)
    specs = device_specs(changed, [("model.layers.0",)] * 2, "/run")
    assert [(spec.prefix_reuse, spec.share_prefixes) for spec in specs] == [(False, True)] * 2


def test_4_bit_weights_stay_int4_on_a_gpu_unless_told_otherwise(topology):
    """By default devices keep 4-bit weights int4 where they can (a GPU in bf16); --dequantize-4bit tells every device not to."""
    default = node_config(flag_values(name="w1", topology=topology, gpus="cpu"), model_given=False)
    assert default.keep_int4 and device_specs(default, [("model.layers.0",)], "/run")[0].keep_int4
    changed = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", dequantize_4bit=True), model_given=False)
    assert [spec.keep_int4 for spec in device_specs(changed, [("model.layers.0",)] * 2, "/run")] == [False, False]


def test_devices_are_unpinned_and_sleep_at_once_unless_told_otherwise(topology):
    """By default no device is pinned and none polls; --device-poll-ms is told to every device in seconds."""
    default = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2"), model_given=False)
    specs = device_specs(default, [("model.layers.0",)] * 2, "/run")
    assert [(spec.cpus, spec.poll_s) for spec in specs] == [(None, 0.0)] * 2
    assert front_cores(default) is None
    polling = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", device_poll_ms=2.5),
                          model_given=False)
    assert [spec.poll_s for spec in device_specs(polling, [("model.layers.0",)] * 2, "/run")] == [0.0025] * 2


def test_pinned_devices_get_cores_of_their_own_in_order_and_the_front_what_is_left(topology):
    """--pin-cpus: --cpu-threads cores for each CPU device in turn, from the cores this process may
    use; the front the rest (None when nothing is left); more threads than cores is a ConfigError."""
    allowed = sorted(os.sched_getaffinity(0))
    pinned = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", cpu_threads=1, pin_cpus=True),
                         model_given=False)
    specs = device_specs(pinned, [("model.layers.0",)] * 2, "/run")
    if len(allowed) < 2:
        pytest.skip("needs 2 cores")
    assert [spec.cpus for spec in specs] == [(allowed[0],), (allowed[1],)]
    assert front_cores(pinned) == (tuple(allowed[2:]) or None)
    too_many = dataclasses.replace(pinned, cpu_threads=len(allowed))
    with pytest.raises(ConfigError, match="--pin-cpus needs"):
        device_specs(too_many, [("model.layers.0",)] * 2, "/run")


def memory_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def test_a_cpu_device_without_a_budget_gets_its_share_of_half_the_memory_available(topology):
    """cpu:2 and no --kv-budget-mib: each device half of half of MemAvailable (as it stood between
    the two reads around the call); --kv-budget-mib wins; a GPU device is left to its own default."""
    config = node_config(flag_values(name="w1", topology=topology, gpus="cpu:2"), model_given=False)
    low = memory_available()
    specs = device_specs(config, [("model.layers.0", "model.layers.1"), ("model.layers.2", "model.layers.3")], "/run")
    high = memory_available()
    low, high = min(low, high), max(low, high)
    slack = 64 << 20  # other processes on the machine allocate between the reads
    for spec in specs:
        assert (low - slack) * CPU_KV_SHARE / 2 <= spec.kv_budget_bytes <= (high + slack) * CPU_KV_SHARE / 2
    given = dataclasses.replace(config, kv_budget_bytes=3 << 20)
    assert [spec.kv_budget_bytes for spec in device_specs(given, [("model.layers.0",)] * 2, "/run")] == [3 << 20] * 2
    on_gpus = dataclasses.replace(config, devices=("0", "1"))
    assert [spec.kv_budget_bytes for spec in device_specs(on_gpus, [("model.layers.0",)] * 2, "/run")] == [None] * 2


def test_a_bundle_as_model_serves_its_entry_from_its_model_folder_unless_a_topology_is_given(tmp_path):
    """`--model <worker>-node` (as `cake split` writes it, config.json copied in): the checkpoint is
    its model/, the topology its topology.yml (so a cluster key does not make it zero-config); an
    explicit --topology still wins."""
    bundle = tmp_path / "w1-node"
    (bundle / "model").mkdir(parents=True)
    (bundle / "model" / "config.json").write_text("{}")
    write_topology(bundle / "topology.yml", ["model.layers.2-3"], name="w1")
    config = node_config(flag_values(name="w1", model=str(bundle), gpus="cpu"), model_given=True)
    assert (config.model, config.checkpoint_path) == (str(bundle), str(bundle / "model"))
    assert config.parts == ("model.layers.2", "model.layers.3")
    keyed = node_config(flag_values(name="w1", model=str(bundle), gpus="cpu", cluster_key=KEY), model_given=True)
    assert (keyed.setup, keyed.parts) == (None, config.parts)  # the bundle's topology: not zero-config
    other = write_topology(tmp_path / "other.yml", ["model.layers.5"], name="w1")
    config = node_config(flag_values(name="w1", model=str(bundle), topology=str(other), gpus="cpu"), model_given=True)
    assert config.parts == ("model.layers.5",)


# -- image components (--model-type image-model)

def _image_cache(root) -> None:
    """An HF cache under `root` holding SD 1.5's unet and vae f16 files (empty: only their place matters
    here), the unet's snapshot with its config.json."""
    snapshot = root / "hub" / "models--runwayml--stable-diffusion-v1-5" / "snapshots" / "abc"
    for sub, file in (("unet", "diffusion_pytorch_model.fp16.safetensors"),
                      ("vae", "diffusion_pytorch_model.fp16.safetensors")):
        (snapshot / sub).mkdir(parents=True)
        (snapshot / sub / file).write_bytes(b"")
    (snapshot / "unet" / "config.json").write_text("{}")


def _image_node(tmp_path, components, **changes):
    topology = str(write_topology(tmp_path / "topology.yml", components, name="w1"))
    return node_config(flag_values(name="w1", topology=topology, gpus="cpu:2", model_type="image-model",
                                   model=str(tmp_path), **changes), model_given=True)


def test_an_image_node_serves_its_entrys_components_as_named_each_from_the_hf_cache(tmp_path):
    """Components are names (no range expansion), placed by topology order; each device is told its
    components' files: the unet's config from its snapshot, the vae's (none there) the standard one."""
    _image_cache(tmp_path)
    config = _image_node(tmp_path, ["unet", "vae"])
    assert (config.parts, config.checkpoint_path) == (("unet", "vae"), "")  # its files: component_files
    specs = device_specs(config, [("unet",), ("vae",)], "/run")
    snapshot = tmp_path / "hub" / "models--runwayml--stable-diffusion-v1-5" / "snapshots" / "abc"
    unet, vae = specs[0].component_files[0][1], specs[1].component_files[0][1]
    assert unet.weights == str(snapshot / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    assert unet.config == str(snapshot / "unet" / "config.json")
    assert (vae.config, specs[1].workload.image.arch, specs[1].workload.image.sd_version) == (None, "sd", "v1-5")


def test_explicit_component_files_take_their_config_from_the_config_dir(tmp_path):
    """--sd-unet names the weights; --sd-config-dir's unet/config.json then gives the architecture."""
    weights = tmp_path / "my-unet.safetensors"
    weights.write_bytes(b"")
    (tmp_path / "configs" / "unet").mkdir(parents=True)
    (tmp_path / "configs" / "unet" / "config.json").write_text("{}")
    config = _image_node(tmp_path, ["unet"], sd_unet=str(weights), sd_config_dir=str(tmp_path / "configs"))
    assert dict(config.component_files)["unet"].config == str(tmp_path / "configs" / "unet" / "config.json")


@pytest.mark.parametrize(("components", "changes", "words"), [
    (["unet", "model.layers.0-3"], {}, "Model name not recognized: 'model.layers.0-3'"),
    (["clip2"], {}, "--sd-version v1-5 has none"),
    (["flux1_transformer"], {"image_model_arch": "flux1"}, "no such file (FLUX.1's transformer is read from"),
    (["clip"], {}, "runwayml/stable-diffusion-v1-5/text_encoder/model.fp16.safetensors is not in the HF cache"),
    (["unet"], {"sd_unet": "/nonexistent.safetensors"}, "--sd-unet /nonexistent.safetensors: no such file"),
])
def test_an_image_node_refuses_what_it_cannot_serve_at_start(tmp_path, components, changes, words):
    """A name that is no component of the arch, SD 1.5's missing second encoder, a FLUX.1
    --model that is no file, a file not in the cache (never downloaded) and a missing explicit file are ConfigErrors."""
    _image_cache(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(words)):
        _image_node(tmp_path, components, **changes)


def test_zero_config_cannot_serve_an_image_model():
    """Cake's zero-config setup needs a text model's config.json: an image node needs --topology."""
    with pytest.raises(ConfigError, match="an image model needs --topology"):
        node_config(flag_values(name="w1", cluster_key=KEY, model_type="image-model"), model_given=False)


def test_an_audio_model_without_a_topology_is_refused_as_cake_cannot_set_it_up():
    """--model-type audio-model with a cluster key and no topology: Cake's zero-config setup reads a
    top-level num_hidden_layers that VibeVoice's config.json lacks, so the node says so and exits."""
    with pytest.raises(ConfigError, match=re.escape("--model-type audio-model needs --topology")):
        node_config(flag_values(cluster_key=KEY, gpus="cpu", model_type="audio-model"), model_given=False)
