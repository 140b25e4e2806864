"""`cakemp run` configuration handling: every configuration error exits 78 with one line."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys

import pytest

from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from cakemp.front.config import KEY_PLACEHOLDER
from tests.support.hub_cache import write_snapshot
from tests.support.node import write_topology

EX_CONFIG = 78


def cakemp(command: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CAKEMP_", "CAKE_"))}
    return subprocess.run([sys.executable, "-m", "cakemp", command, *args], capture_output=True, text=True,
                          timeout=120, env={**environ, **(env or {})})


def cakemp_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return cakemp("run", "--log-format", "json", *args, env=env)


@pytest.fixture
def topology(tmp_path):
    return write_topology(tmp_path / "topology.yml", ["model.layers.0-1"], name="w1")


@pytest.fixture
def taken_port():
    """A loopback port another socket listens on for the whole test."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def assert_config_error(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode == EX_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr


@pytest.mark.parametrize("args, env, words", [
    (["--topology", "{topology}"], {}, "no --name"),
    (["--name", "w1"], {}, "--topology"),
    (["--name", "w1", "--topology", "{tmp}/missing.yml"], {}, "missing.yml"),
    (["--name", "w1", "--topology", "{topology}", "--gpus", "cpu:0"], {}, "cpu:N"),
    (["--name", "w1", "--topology", "{topology}", "--gpus", "0,0"], {}, "--gpus"),
    (["--name", "w1", "--topology", "{topology}", "--dtype", "f64"], {}, "f64"),
    (["--name", "w1", "--topology", "{topology}", "--address", "nowhere"], {}, "--address"),
    (["--name", "w1", "--topology", "{topology}"], {"CAKEMP_DTYPE": "int8"}, "int8"),
    (["--name", "w1", "--topology", "{topology}"], {"CAKEMP_PROTOCOL": "3"}, "3"),
    (["--name", "w1", "--topology", "{topology}", "--metrics-address", "nowhere"], {}, "--metrics-address"),
    (["--name", "w1", "--topology", "{topology}", "--request-timeout", "0"], {}, "--request-timeout"),
    (["--name", "w1", "--topology", "{topology}", "--max-batch", "0"], {}, "--max-batch"),
    (["--name", "w1", "--topology", "{topology}"], {"CAKEMP_PREFILL_CHUNK": "0"}, "prefill"),
    (["--name", "w1", "--topology", "{topology}"], {"WATCHDOG_USEC": "soon"}, "WATCHDOG_USEC"),
    (["--name", "w1", "--topology", "{topology}"], {"NOTIFY_SOCKET": "relative/notify"}, "NOTIFY_SOCKET"),
    (["--name", "w1", "--topology", "{topology}", "--allow-from", "10.0.0.0/33"], {}, "--allow-from"),
    (["--name", "w1", "--topology", "{topology}"], {"CAKEMP_ALLOW_FROM": "master.lan"}, "--allow-from"),
    # The cluster key: the examples' keys (with or without a topology), an empty one on the command
    # line or in the environment (which click alone would read as no key at all).
    ([], {"CAKE_CLUSTER_KEY": "change-me"}, "the cluster key is the example's 'change-me'"),
    (["--name", "w1", "--topology", "{topology}"], {"CAKEMP_CLUSTER_KEY": "change-me"}, "example's 'change-me'"),
    ([], {"CAKE_CLUSTER_KEY": KEY_PLACEHOLDER}, f"the cluster key is the example's '{KEY_PLACEHOLDER}'"),
    (["--name", "w1", "--topology", "{topology}", "--cluster-key", ""], {}, "the cluster key is empty"),
    (["--name", "w1", "--topology", "{topology}"], {"CAKE_CLUSTER_KEY": ""}, "CAKE_CLUSTER_KEY is set but empty"),
])
def test_configuration_errors_exit_78_with_one_line(tmp_path, topology, args, env, words):
    """Missing or invalid flags (or CAKEMP_* variables) exit 78 and say what is wrong in one line."""
    args = [a.format(topology=topology, tmp=tmp_path) for a in args]
    assert_config_error(cakemp_run(*args, env=env), words)


def test_an_empty_topology_exits_78(tmp_path):
    """A topology file with no entries is a configuration error."""
    (tmp_path / "empty.yml").write_text("")
    assert_config_error(cakemp_run("--name", "w1", "--topology", str(tmp_path / "empty.yml")), "empty")


def test_an_entry_without_layers_beside_one_with_exits_78(tmp_path):
    """An entry that lists no layers, where another lists some (so none are assigned), gives the node nothing to serve."""
    path = tmp_path / "topology.yml"
    path.write_text("w1: {host: 'a:1', layers: []}\nw2: {host: 'b:1', layers: [model.layers.0]}\n")
    assert_config_error(cakemp_run("--name", "w1", "--topology", str(path)), "no layers")


def test_unknown_name_falls_back_to_the_only_entry_with_a_warning_and_a_bad_model_exits_78(tmp_path, topology):
    """An unknown --name serves a one-entry topology's entry after a warning (as Cake does); a model
    directory without config.json makes the node exit 78 saying so."""
    result = cakemp_run("--name", "stranger", "--topology", str(topology), "--gpus", "cpu",
                        "--model", str(tmp_path / "no-model"), "--address", "127.0.0.1:0")
    warning = next(json.loads(line) for line in result.stdout.splitlines() if "worker name not in topology" in line)
    assert (warning["level"], warning["name"], warning["entry"]) == ("warning", "stranger", "w1")
    assert_config_error(result, "no-model")


def test_a_node_open_beyond_loopback_without_key_or_allow_list_warns_at_start(tmp_path, topology):
    """0.0.0.0 with neither --cluster-key nor --allow-from: a warning comes first (here the missing
    model then exits 78, before the port listens)."""
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--gpus", "cpu",
                        "--model", str(tmp_path / "no-model"), "--address", "0.0.0.0:0")
    warning = next(json.loads(line) for line in result.stdout.splitlines() if "any peer that reaches" in line)
    assert (warning["level"], warning["address"]) == ("warning", "0.0.0.0:0")
    assert_config_error(result, "no-model")


def test_a_layer_the_checkpoint_lacks_exits_78_before_any_device_starts(tmp_path):
    """A topology entry naming layers past the checkpoint's is refused from config.json, naming them and
    the layers there are, before a device process is started (none logs "device layers")."""
    (tmp_path / "model").mkdir()
    write_checkpoint(tmp_path / "model", SyntheticSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                       num_attention_heads=4, num_key_value_heads=2))
    topology = write_topology(tmp_path / "topology.yml", ["model.layers.1-3"], name="w1")
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--model", str(tmp_path / "model"),
                        "--gpus", "cpu", "--address", "127.0.0.1:0")
    assert_config_error(result, "topology entry 'w1' names model.layers.2-3, which")
    assert "its layers: model.layers.0..model.layers.1" in result.stderr
    assert "device layers" not in result.stdout


def test_unknown_name_in_a_topology_of_several_entries_exits_78(tmp_path):
    """An unknown --name among several entries is refused, naming the entries (Cake would serve the
    first one's layers on every misnamed machine)."""
    path = tmp_path / "topology.yml"
    path.write_text("w1:\n  host: a:10128\n  layers: [model.layers.0]\n"
                    "w2:\n  host: b:10128\n  layers: [model.layers.1]\n")
    result = cakemp_run("--name", "w3", "--topology", str(path), "--gpus", "cpu", "--address", "127.0.0.1:0")
    assert_config_error(result, "worker name 'w3' is not in the topology (its entries: w1, w2)")


def test_help_lists_every_flag_with_its_environment_variable():
    """`cakemp run --help` exits 0 and names each flag's CAKEMP_ variable."""
    result = subprocess.run([sys.executable, "-m", "cakemp", "run", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for flag in ("name", "model", "topology", "address", "dtype", "gpus", "protocol", "drain-timeout",
                 "request-timeout", "restart-attempts", "metrics-address", "log-format", "max-batch", "prefill-chunk"):
        assert f"CAKEMP_{flag.upper().replace('-', '_')}" in result.stdout
    assert "CAKE_CLUSTER_KEY" in result.stdout


@pytest.mark.parametrize("command", ["run", "generate", "serve"])
def test_dequantize_4bit_is_a_flag_of_every_command_that_loads_layers(command):
    """A node's layers and a master's own (`generate`, `serve`) alike: the one flag and variable."""
    result = subprocess.run([sys.executable, "-m", "cakemp", command, "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "--dequantize-4bit" in result.stdout and "CAKEMP_DEQUANTIZE_4BIT" in result.stdout


def test_an_address_in_use_exits_78_before_loading(tmp_path, topology, taken_port):
    """A port another process holds is reported at once, before any device process starts."""
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--gpus", "cpu",
                        "--model", str(tmp_path / "no-model"), "--address", f"127.0.0.1:{taken_port}")
    assert_config_error(result, "cannot listen")


def test_a_metrics_address_in_use_exits_78_before_loading(tmp_path, topology, taken_port):
    """A metrics port another process holds is a configuration error too, found before any device starts."""
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--gpus", "cpu",
                        "--model", str(tmp_path / "no-model"), "--address", "127.0.0.1:0",
                        "--metrics-address", f"127.0.0.1:{taken_port}")
    assert_config_error(result, "cannot serve metrics")


def test_version_is_the_package_metadata_version():
    """`cakemp --version` prints the version the installed distribution declares."""
    result = subprocess.run([sys.executable, "-m", "cakemp", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"cakemp, version {importlib.metadata.version('cakemp')}"


@pytest.mark.parametrize("listing, gpus, words", [
    ("echo 'GPU 0: NVIDIA H100 (UUID: GPU-0a1b)'; echo 'GPU 1: NVIDIA H100 (UUID: GPU-2c3d)'", "7",
     "there is no GPU 7 (only 2 visible)"),
    ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9", "all",
     "nvidia-smi -L exited 9: NVIDIA-SMI has failed"),
])
def test_gpus_the_machine_lacks_exit_78_with_one_line(tmp_path, topology, listing, gpus, words):
    """A GPU index past the visible GPUs, or `--gpus all` where nvidia-smi fails (a broken driver),
    is a configuration error, not a node on the CPU or a device process that dies at start."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # a stand-in for the driver's tool: this listing, or its failure
    smi.write_text(f"#!/bin/sh\n{listing}\n")
    smi.chmod(0o755)
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--gpus", gpus,
                        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert_config_error(result, words)


def test_a_model_id_neither_cached_nor_downloadable_offline_exits_78_naming_it_and_the_cache(tmp_path, topology):
    """HF_HUB_OFFLINE=1 and an empty cache: one line naming the id, the file and the cache searched."""
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--model", "tiny-org/absent",
                        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert_config_error(result, f"tiny-org/absent: config.json is not in the Hugging Face cache {tmp_path / 'hub'} "
                                "and HF_HUB_OFFLINE is set")


@pytest.mark.parametrize("command", ["run", "generate"])
def test_a_gguf_file_of_a_repository_neither_cached_nor_downloadable_offline_exits_78_naming_it(tmp_path, topology,
                                                                                                command):
    """`org/name/file.gguf` with HF_HUB_OFFLINE=1 and a snapshot lacking that file (it holds another
    quantization): a node and a master alike exit with one line naming the id, the file and the cache."""
    write_snapshot(tmp_path / "hub", "tiny-org/gguf", {"model-Q8_0.gguf": "GGUF"})
    args = ["--name", "w1"] if command == "run" else ["--prompt", "hi"]
    result = cakemp(command, *args, "--topology", str(topology), "--model", "tiny-org/gguf/model-Q4_K_M.gguf",
                    env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert_config_error(result, f"tiny-org/gguf: model-Q4_K_M.gguf is not in the Hugging Face cache "
                                f"{tmp_path / 'hub'} and HF_HUB_OFFLINE is set")


def test_a_cached_id_lacking_a_shard_of_this_nodes_layers_exits_78_offline_naming_the_shard(tmp_path, topology):
    """The snapshot holds config and index but not the shard of layers 0-1 (w1's): offline, that shard
    is named; the other shard, which w1 does not need, is never asked for."""
    weight_map = {"model.layers.0.w": "a.safetensors", "model.layers.1.w": "a.safetensors",
                  "model.layers.2.w": "b.safetensors"}
    write_snapshot(tmp_path / "hub", "tiny-org/partial", {"config.json": "{}",
                                                          "model.safetensors.index.json": json.dumps({"weight_map": weight_map})})
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--model", "tiny-org/partial@main",
                        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert_config_error(result, f"tiny-org/partial: a.safetensors is not in the Hugging Face cache {tmp_path / 'hub'}")


def test_a_bundle_without_config_json_exits_78_saying_where_it_goes(tmp_path):
    """`cake split` writes no config.json: the one line names the file the bundle lacks."""
    bundle = tmp_path / "w1-node"
    (bundle / "model").mkdir(parents=True)
    write_topology(bundle / "topology.yml", ["model.layers.0-1"], name="w1")
    result = cakemp_run("--name", "w1", "--model", str(bundle))
    assert_config_error(result, f"bundle {bundle}: {bundle}/model/config.json is missing")


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
               "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


def test_a_node_the_default_assignment_gives_no_layers_exits_78_saying_why(tmp_path):
    """Bare nodes (no tflops, no vram_bytes) beside a master of 2 TFLOPS get round(0) = 0 layers."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    topology = tmp_path / "topology.yml"
    topology.write_text("w1: {host: 'a:1', layers: []}\nw2: {host: 'b:1', layers: []}\n")
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--model", str(tmp_path / "model"),
                        "--master-tflops", "2")
    assert_config_error(result, "the default assignment gives topology entry 'w1' no layers")


def test_weighing_layers_by_memory_without_every_header_reads_the_hubs_and_offline_exits_78(tmp_path):
    """An empty topology giving vram_bytes needs a layer's size from every shard's header: a snapshot
    lacking a shard asks the hub for its header rather than download it; offline, one line says so."""
    config = TINY_CONFIG
    index = {"weight_map": {"model.layers.0.w": "a.safetensors", "model.layers.1.w": "b.safetensors"}}
    write_snapshot(tmp_path / "hub", "tiny-org/partial", {"config.json": json.dumps(config),
                                                          "model.safetensors.index.json": json.dumps(index)})
    topology = tmp_path / "topology.yml"
    topology.write_text("w1: {host: 'a:1', layers: [], tflops: 1, vram_bytes: 1000000}\n")
    result = cakemp_run("--name", "w1", "--topology", str(topology), "--model", "tiny-org/partial",
                        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert_config_error(result, "tiny-org/partial: estimating a layer's size needs every weight file's header, "
                                "and the hub's cannot be read")


def test_discover_refuses_a_gguf_id_before_fetching_it(tmp_path):
    """Zero-config cannot push a GGUF file: `generate --discover` says so before any download (the
    cache is empty; offline, a fetch would have been the one-line 'not in the cache' instead)."""
    result = cakemp("generate", "--model", "tiny-org/gguf/model.gguf", "--discover", "127.0.0.1",
                    "--cluster-key", "a long enough cluster key for this test", "--prompt", "hi",
                    env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert_config_error(result, "tiny-org/gguf/model.gguf: a .gguf model cannot be pushed to zero-config workers")
