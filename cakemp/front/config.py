"""The node's configuration: every `cakemp run` flag written once, and the NodeConfig they make
(what a --model and a topology mean is `cakemp.placement`'s; what each device process is told,
`front/devices.py`'s).

A flag that sets one NodeConfig field is declared on that field (`knob`): its name, default,
click type and help. cli.py makes the click options of `RUN_FLAGS` (each also reads
CAKEMP_<FLAG>), and `node_config` fills the fields from their values. The flags that together
say what the node serves (--name, --topology, --gpus, and zero-config's) are `Flag`s of their
own, read by `node_config`. Adding a knob touches its field here and the code that uses it.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cakemp import gpus, log, placement
from cakemp.address import is_loopback, parse_address
from cakemp.allow_list import AllowList
from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.image import archs as image_archs
from cakemp.checkpoint.image import sd_files
from cakemp.checkpoint.image.locator import ImageFlags
from cakemp.checkpoint.locate import ModelSource, locate
from cakemp.dtypes import COMPUTE_DTYPES
from cakemp.errors import ConfigError
from cakemp.ipc.spec import (
    ALONE_CHUNK,
    ALONE_STEP_S,
    LAYER_WORKLOADS,
    MAX_BATCH,
    PREFILL_CHUNK,
    ComponentFile,
    ImageModel,
    Workload,
)
from cakemp.setup.cache import cache_root
from cakemp.setup.exchange import SetupConfig
from cakemp.topology import Topology
from cakemp.wire import Revision
from cakemp.wire.discovery import DISCOVERY_PORT

# Cake's WorkerInfo.dtype spelling (candle's Debug names) for each --dtype value.
WIRE_DTYPE_NAMES = {name: tag.name for name, tag in COMPUTE_DTYPES.items()}

# The variables --cluster-key is read from: Cake's, then cakemp's CAKEMP_<FLAG>.
KEY_VARIABLES = ("CAKE_CLUSTER_KEY", "CAKEMP_CLUSTER_KEY")
# What the deploy examples hold where the key goes: a node refuses it as is.
KEY_PLACEHOLDER = "generate-a-key-with-openssl-rand-hex-32"
# Keys anyone who read the project's examples knows ("change-me": what they shipped before).
EXAMPLE_KEYS = frozenset({"change-me", KEY_PLACEHOLDER})
# Shorter keys draw a warning: the cluster hash in every discovery probe lets them be guessed offline.
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its name, help, default and click type (None: a string); `envvar`
    names variables read before CAKEMP_<FLAG> (Cake's own); `is_flag`: it takes no value (on when given)."""

    name: str  # "--request-timeout"
    help: str | None = None
    default: Any = None
    type: click.ParamType | None = None
    envvar: tuple[str, ...] = ()
    is_flag: bool = False

    @property
    def key(self) -> str:
        """The keyword its value is passed as: request_timeout."""
        return self.name.removeprefix("--").replace("-", "_")


def knob(name: str, default: Any, type: click.ParamType | None, help: str | None, *,
         convert: Callable[[Any], Any] | None = None, envvar: tuple[str, ...] = (), is_flag: bool = False) -> Any:
    """A NodeConfig field set by the flag `name`. `convert` turns the flag's value into the field's
    (MiB into bytes, say); the field's default is the flag's, converted."""
    flag = Flag(name, help, default, type, envvar, is_flag)
    value = default if convert is None or default is None else convert(default)
    return dataclasses.field(default=value, metadata={"flag": flag, "convert": convert})


def _mib(count: int) -> int:
    return count * (1 << 20)


def _revision(protocol: str) -> Revision:
    return Revision(int(protocol))


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything the front needs; `devices` holds one CUDA_VISIBLE_DEVICES value per GPU, or None per CPU slot."""

    name: str
    # What the node serves of the model, by the names the master's ops give them (and its topology
    # entry lists): a text model's layers ("model.layers.3"), an image model's components ("unet").
    parts: tuple[str, ...]
    devices: tuple[str | None, ...]
    # --model-type image-model: each component's files (from the flags, or the HF cache).
    component_files: tuple[tuple[str, ComponentFile], ...] = ()
    # A text model's checkpoint, which the devices load the layers from: a directory or a .gguf
    # file, --model itself or where its bundle or hub id was found; "" for an image model (its
    # files are `component_files`) and, in zero-config mode, until a master's setup names its cache.
    checkpoint_path: str = ""
    # Zero-config mode: `parts` and `checkpoint_path` come from a master's setup (then empty here).
    setup: SetupConfig | None = None
    model: str = knob("--model", "./cake-data/Meta-Llama-3-8B/", None,
                          "Model directory, .gguf file, `cake split` bundle (its model/ and topology.yml), or Hugging "
                          "Face id org/name[@revision] (from the hub cache; this node's missing files are downloaded). Image "
                          "models: Stable Diffusion's HF cache root (holding hub/), FLUX.2's repository id or directory.")
    model_type: str = knob("--model-type", "text-model", click.Choice(image_archs.MODEL_TYPES),
                           "image-model: serve the image components the topology entry names (clip, unet, ...); "
                           "audio-model: VibeVoice's language-model layers (Qwen2 blocks) it names.")
    image_arch: str = knob("--image-model-arch", "sd", click.Choice(list(image_archs.ARCHS)),
                           "Image model the components belong to (with --model-type image-model).")
    sd_version: str = knob("--sd-version", "v1-5", click.Choice(sd_files.SD_VERSIONS), "Stable Diffusion version "
                           "(as the master's): picks the hub repository and the standard architecture.")
    sd_unet: str | None = knob("--sd-unet", None, None, "UNet weights file (default: from the HF cache).")
    sd_vae: str | None = knob("--sd-vae", None, None, "VAE weights file (default: from the HF cache).")
    sd_clip: str | None = knob("--sd-clip", None, None, "CLIP text encoder weights file (default: from the HF cache).")
    sd_clip2: str | None = knob("--sd-clip2", None, None, "Second (SDXL) text encoder weights file (default: from "
                                "the HF cache).")
    sd_config_dir: str | None = knob(
        "--sd-config-dir", None, None, "Directory laid out like a snapshot (unet/config.json, vae/config.json, "
        "text_encoder/config.json, text_encoder_2/config.json): the architecture where the snapshot has none.")
    address: tuple[str, int] = knob("--address", "0.0.0.0:10128", None, "host:port to listen on.",
                                    convert=parse_address)
    cluster_key: str | None = knob(
        "--cluster-key", None, None, "Shared key; turns on auth. Generate one with `openssl rand -hex 32`, and "
        "give it as CAKE_CLUSTER_KEY rather than here, where ps shows it to every local user.",
        envvar=("CAKE_CLUSTER_KEY",))
    allow_from: AllowList | None = knob(
        "--allow-from", None, None, "Addresses or CIDRs, IPv4 or IPv6, comma-separated (10.0.0.5,10.0.1.0/24): "
        "only they may connect to the TCP port and get discovery replies (default: any).", convert=AllowList.parse)
    dtype: str = knob("--dtype", "f16", click.Choice(list(COMPUTE_DTYPES)), "Compute dtype of the layers.")
    revision: Revision = knob("--protocol", "2", click.Choice([str(int(revision)) for revision in Revision]),
                              "Cake revision: 1 = fa7d08a (WorkerError tag 11), 2 = after 2026-03-21 (tag 12).",
                              convert=_revision)
    kv_budget_bytes: int | None = knob(
        "--kv-budget-mib", None, click.IntRange(min=1),
        "KV cache budget per device process, in MiB (default: on a CPU, half the memory available at start divided "
        "among the CPU device processes; on a GPU what is free after loading, less max(2 GiB, a tenth of the GPU)). "
        "On an image-model node, the activation memory the calls a device computes together may be estimated to hold.",
        convert=_mib)
    max_context: int | None = knob("--max-context", None, click.IntRange(min=1),
                                   "Maximum positions per session (default: the model's).")
    cpu_threads: int | None = knob("--cpu-threads", None, click.IntRange(min=1),
                                   "torch threads per CPU device process (default: the cores divided among them).")
    pin_cpus: bool = knob(
        "--pin-cpus", False, None, "Pin each device process to cores of its own (--cpu-threads of them for a CPU "
        "device, 2 for a GPU's), in order, and the front to the cores left, if any: two devices' compute then never "
        "shares a core. Needs that many cores; best where nothing else runs on them.", is_flag=True)
    device_poll_s: float = knob(
        "--device-poll-ms", 0.0, click.FloatRange(min=0),
        "Milliseconds a device process owed a session's next request keeps looking at its socket before it "
        "sleeps, so that the request finds it awake (0: sleep at once). Only where cores are to spare: on a "
        "machine without, the looking takes the core the front or another device needs.",
        convert=lambda ms: ms / 1e3)
    drain_timeout: float = knob(
        "--drain-timeout", 30.0, click.FloatRange(min=0),
        "Seconds requests in flight get to finish after SIGTERM or SIGINT (a second signal exits at once).")
    request_timeout: float = knob(
        "--request-timeout", 60.0, click.FloatRange(min=0, min_open=True),
        "Seconds a device process may take to answer the front before it counts as hung and is restarted.")
    restart_attempts: int = knob("--restart-attempts", 5, click.IntRange(min=1),
                                 "Failed starts in a row of one device process after which the node exits 1.")
    prefill_chunk: int = knob(
        "--prefill-chunk", PREFILL_CHUNK, click.IntRange(min=1),
        "Tokens per chunk of a prompt, and the prompt tokens a device runs per step beside other sessions' work: a "
        "long prompt neither stalls other sessions' decodes nor waits behind them, and across several devices "
        "its chunks flow down the route one after another, so the devices work at once. A prompt alone on its "
        f"device runs in larger pieces, each what the device computes in about {ALONE_STEP_S:g} s (at most "
        f"{ALONE_CHUNK} tokens).")
    max_batch: int = knob(
        "--max-batch", MAX_BATCH, click.IntRange(min=1),
        "Requests a device runs together in one step at most: decode steps of concurrent sessions share one "
        "pass over the weights (1: each request alone, as Cake's worker).")
    cuda_graphs: bool = knob(
        "--no-cuda-graphs", False, None, "Run a GPU's decode steps op by op instead of replaying them as CUDA graphs "
        "(captured per batch size and key width as steps of each shape first come: compute/decode_graph.py).",
        convert=lambda off: not off, is_flag=True)
    metrics_address: tuple[str, int] | None = knob(
        "--metrics-address", None, None, "host:port serving /metrics, /healthz and /readyz (default: off).",
        convert=lambda text: parse_address(text, "--metrics-address"))
    max_connections: int = knob(
        "--max-connections", 4096, click.IntRange(min=1),
        "Master connections served at once; more are closed at once (a master opens one per remote layer).")
    max_buffered_bytes: int = knob(
        "--max-buffered-mib", 1024, click.IntRange(min=1),
        "MiB of frames all connections together may hold; past it connections wait, unread (backpressure).",
        convert=_mib)
    frame_timeout: float = knob(
        "--frame-timeout", 60.0, click.FloatRange(min=0, min_open=True),
        "Seconds a frame may take to arrive once its header has (Hello: once connected); then it is closed.")
    prefix_reuse: bool = knob(
        "--no-prefix-reuse", False, None, "Free a session's KV rows on Goodbye instead of keeping them for a "
        "request that sends the same rows again (a chat's next turn), which then computes only its new rows.",
        convert=lambda off: not off, is_flag=True)
    share_prefixes: bool = knob(
        "--share-prefixes", False, None, "Reuse kept rows across master connections, not only on the connection "
        "they came from (a hit shows in latency: each connection's masters should trust each other).", is_flag=True)
    keep_int4: bool = knob(
        "--dequantize-4bit", False, None, "Dequantize 4-bit weights (GPTQ, MLX, GGUF Q4_0/Q4_1/Q4_K) at load into the "
        "compute dtype instead of keeping them 4-bit for torch's int4 matmul (a CPU: any dtype, each product's "
        "input rounded to bf16; a GPU: bf16 only): 4-8x the memory, results as before.",
        convert=lambda off: not off, is_flag=True)
    expert_offload: bool = knob(
        "--expert-offload", False, None, "Keep MoE layers' routed experts out of memory: each is read from the "
        "checkpoint's mapped files when a token is routed to it, in its stored form (4-bit stays 4-bit where "
        "torch's int4 matmul takes it), into a cache of hot experts of --expert-cache-mib per device. Router, "
        "attention and shared experts stay loaded; outputs are the same.", is_flag=True)
    expert_cache_bytes: int = knob(
        "--expert-cache-mib", 4096, click.IntRange(min=0),
        "With --expert-offload: MiB of experts each device keeps in compute form (least recently used given up "
        "first); the fit check and the KV budget count it in the experts' stead.", convert=_mib)
    quantize: str | None = knob(
        "--quantize", None, click.Choice(["int8", "int4"]), "Round a plain (f32, bf16, f16) checkpoint's matrices "
        "at load, to nearest, into int8 (one scale a row) or int4 (--quantize-group inputs a scale and zero) for "
        "torch's CPU kernels: 0.27-0.5 of the bf16 memory, and the results change (docs/checkpoints.md, Quantize on load).")
    quantize_group: int = knob(
        "--quantize-group", "128", click.Choice(["32", "64", "128"]), "Inputs per scale and zero of --quantize int4.",
        convert=int)
    session_idle_timeout: float | None = knob(
        "--session-idle-timeout", None, click.FloatRange(min=0, min_open=True),
        "Seconds a session may sit idle before its KV cache is freed (default: never, as Cake).")
    log_format: str = knob("--log-format", "auto", click.Choice(list(log.FORMATS)),
                           "auto = console on a terminal, JSON lines otherwise.")
    log_level: str = knob("--log-level", "info", click.Choice(list(log.LEVELS)), None)
    stats_interval: float = knob("--stats-interval", 60.0, click.FloatRange(min=0, min_open=True),
                                 "Seconds between throughput log lines (none while nothing is served).")

    @property
    def workload(self) -> Workload:
        """What the node serves (a text model's layers or an image model's components): every other part
        of the node reads this, not the flags."""
        return _workload(self.model_type, self.image_arch, self.sd_version)

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]


def _workload(model_type: str, image_arch: str, sd_version: str) -> Workload:
    """What --model-type and the image model's flags say the node serves: the one place they are read."""
    if model_type == "image-model":
        return Workload(ImageModel(image_arch, sd_version), model_type, zero_config=False)
    return LAYER_WORKLOADS[model_type]


def _knobs(values: Mapping[str, Any]) -> dict[str, Any]:
    """NodeConfig's knob fields from their flags' values; an optional one left empty stays None."""
    fields = {}
    for field in dataclasses.fields(NodeConfig):
        if (flag := field.metadata.get("flag")) is None:
            continue
        value, convert = values[flag.key], field.metadata["convert"]
        if flag.default is None and value in (None, ""):
            fields[field.name] = None
        else:
            fields[field.name] = value if convert is None else convert(value)
    return fields


# The flags that say what the node serves: read together, not one field each.
NAME = Flag("--name", "This worker's entry in the topology; in zero-config mode its discovery name (default: the "
            "host name).")
TOPOLOGY = Flag("--topology", "Cake topology YAML (default: a --model bundle's); without it and with --cluster-key, "
                "zero-config mode (the master discovers the node and pushes the model).")
MASTER_TFLOPS = Flag("--master-tflops", "A topology whose nodes all list no layers: the master's TFLOPS its share is "
                     "weighed by (default: this machine's devices', as Cake's workers count them; give the master's "
                     "so that this node assigns what the master does).", None, click.FloatRange(min=0))
GPUS = Flag("--gpus", "all | cpu | cpu:N | GPU indices (of the visible GPUs, PCI bus order) or GPU/MIG UUIDs, like 0,2.",
            "all")
DISCOVERY_PORT_FLAG = Flag("--discovery-port", "Zero-config: UDP port answering the master's discovery.",
                           DISCOVERY_PORT, click.IntRange(0, 65535))
DISCOVERY_BIND = Flag("--discovery-bind", "Zero-config: address the discovery responder binds.", "0.0.0.0")
MAX_MODEL_GIB = Flag("--max-model-gib", "Zero-config: most GiB a master may push, all files together (default, "
                     "and never more than: what the cache's disk has free as the push begins, less max(1 GiB, 5% of "
                     "the disk)).", None, click.FloatRange(0, min_open=True))

# Every `cakemp run` flag, in --help order.
RUN_FLAGS: tuple[Flag, ...] = (
    NAME, TOPOLOGY, MASTER_TFLOPS, GPUS,
    *(field.metadata["flag"] for field in dataclasses.fields(NodeConfig) if "flag" in field.metadata),
    DISCOVERY_PORT_FLAG, DISCOVERY_BIND, MAX_MODEL_GIB,
)


def run_flag(name: str) -> Flag:
    """The `cakemp run` flag `name`, for another command taking the same value (its default and type)."""
    return next(flag for flag in RUN_FLAGS if flag.name == name)


def node_config(values: Mapping[str, Any], *, model_given: bool) -> NodeConfig:
    """The node `cakemp run` was asked for by `values` (each RUN_FLAGS flag's, by key): the layers
    of its topology entry or, in zero-config mode, those a master will assign; on which devices;
    every knob. `model_given`: --model was set, not left at its default. Raises ConfigError."""
    logger = log.get_logger()
    check_cluster_key(values["cluster_key"])
    knobs = _knobs(values)
    if not values["cluster_key"] and knobs["allow_from"] is None and not is_loopback(knobs["address"][0]):
        logger.warning("any peer that reaches the port may use this node: give a cluster key or --allow-from",
                       address=values["address"])
    workload = _workload(knobs["model_type"], knobs["image_arch"], knobs["sd_version"])
    if workload.image is not None:
        # --model is no text checkpoint: none of its rules apply
        if values["cluster_key"] and not values["topology"]:
            raise ConfigError("an image model needs --topology: zero-config setup serves text models only (as Cake)")
        served, layers = _component_entry(values["name"], values["topology"])
        knobs["component_files"] = _component_files(layers, knobs)
        return _placed(values, served, layers, None, knobs)
    source = locate(values["model"])
    topology = values["topology"] or source.topology
    if values["cluster_key"] and not topology:
        # Cake's rule for zero-config: a key and no topology (a bundle's counts: it is a topology; --model
        # itself has a default, so it cannot count).
        if not workload.zero_config:
            raise ConfigError(f"--model-type {workload.model_type} needs --topology: a Cake master cannot set VibeVoice "
                              "up with zero-config (its setup reads num_hidden_layers at config.json's top level, "
                              "which VibeVoice keeps in decoder_config)")
        if model_given:
            logger.warning("--model is ignored in zero-config mode: the master pushes the model")
        served, layers = values["name"] or socket.gethostname(), ()
        max_model_gib = values["max_model_gib"]
        setup = SetupConfig(cluster_key=values["cluster_key"], cache_root=cache_root(),
                            max_model_bytes=None if max_model_gib is None else int(max_model_gib * (1 << 30)),
                            discovery_host=values["discovery_bind"], discovery_port=values["discovery_port"])
    else:
        served, layers, knobs["checkpoint_path"] = _topology_node(values, topology, source, knobs["model"])
        setup = None
        if workload.declared_dtype_wins:
            knobs["dtype"] = _declared_dtype(knobs["checkpoint_path"], knobs["dtype"])
    return _placed(values, served, layers, setup, knobs)


def _placed(values: Mapping[str, Any], served: str, parts: tuple[str, ...], setup: SetupConfig | None,
            knobs: dict[str, Any]) -> NodeConfig:
    """The node serving `parts` as `served` on the devices --gpus names (no more than it has parts)."""
    logger = log.get_logger()
    devices = gpus.select_devices(values["gpus"])
    if values["gpus"].strip() == "all" and devices == (None,):
        logger.warning("no CUDA device found; serving on one CPU device")
    if setup is None and len(devices) > len(parts):
        logger.warning("more devices than layers, using one per layer", devices=len(devices), layers=len(parts))
        devices = devices[: len(parts)]
    return NodeConfig(name=served, parts=parts, devices=devices, setup=setup, **knobs)


def check_cluster_key(key: str | None) -> None:
    """Refuse (ConfigError) a cluster key that protects nothing: empty, or one of the examples'; warn
    on a short one. None: no key, no handshake."""
    if key is None:
        return
    if not key.strip():
        raise ConfigError("the cluster key is empty: set one (openssl rand -hex 32), or unset it for no handshake")
    if key in EXAMPLE_KEYS:
        raise ConfigError(f"the cluster key is the example's {key!r}: generate one (openssl rand -hex 32) and give "
                          "the same to the master and every worker")
    if len(key) < MIN_KEY_CHARS:
        log.get_logger().warning("the cluster key is short: its hash, in every discovery probe, lets it be guessed "
                                 "offline; generate one with openssl rand -hex 32", characters=len(key))


def scrub_cluster_key(environ: MutableMapping[str, str]) -> None:
    """Take the key's variables out of `environ` (once click has read them), so that what the front
    starts (device processes, nvidia-smi), which inherits os.environ, never holds the key. A variable
    set but empty is refused: click would read it as no key, a node without the handshake."""
    for name in KEY_VARIABLES:
        if name in environ and not environ.pop(name).strip():
            raise ConfigError(f"{name} is set but empty: set a key (openssl rand -hex 32), or unset it for no "
                              "handshake")


def _component_entry(name: str | None, topology: str | None) -> tuple[str, tuple[str, ...]]:
    """The image components of this worker's topology entry: names taken as written (no range expansion)."""
    if not name:
        raise ConfigError("no --name provided for worker")
    if not topology:
        raise ConfigError("no --topology given: an image node serves the components its entry names")
    served, node = Topology.load(topology, expand=False).worker(name)
    if served != name:
        log.get_logger().warning("worker name not in topology, serving its only entry", name=name, entry=served)
    if not node.layers:
        raise ConfigError(f"topology entry '{served}' lists no components")
    return served, node.layers


def _component_files(names: tuple[str, ...], knobs: Mapping[str, Any]) -> tuple[tuple[str, ComponentFile], ...]:
    """Each image component's files, logged with where its architecture comes from. Raises ConfigError."""
    arch, version = image_archs.ARCHS[knobs["image_arch"]], knobs["sd_version"]
    image_archs.check_components(arch.name, names, version)
    flags = ImageFlags(knobs["model"], version, {name: knobs[f"sd_{name}"] for name in sd_files.FILES},
                       knobs["sd_config_dir"])
    files = []
    for name in names:
        located = arch.locate(name, flags)
        log.get_logger().info("component files", component=name, weights=str(located.weights),
                              config=str(located.config) if located.config else arch.standard.format(version=version),
                              config_from=located.config_source)
        files.append((name, ComponentFile(str(located.weights), None if located.config is None else str(located.config))))
    return tuple(files)


def _declared_dtype(checkpoint: str, told: str) -> str:
    """The dtype an audio model's layers compute in: the checkpoint's own where it declares one (VibeVoice's
    decoder_config saying bfloat16), as Cake's worker decides it, else `told` (--dtype). A master sending
    another dtype is answered in it, computed in this one."""
    declared = ModelConfig.from_dir(checkpoint).declared_dtype
    if declared is None or declared == told:
        return told
    log.get_logger().info("computing in the checkpoint's dtype, as Cake's audio worker does", dtype=declared,
                          not_dtype=told)
    return declared


def _topology_node(values: Mapping[str, Any], topology: str | Path | None, source: ModelSource,
                   model: str) -> tuple[str, tuple[str, ...], str]:
    """Topology mode: this node's name and layers (`placement.worker_placement`), and the checkpoint
    it loads them from (`model`, the --model argument, as given, or the folder or file a bundle or a
    repository id was found as)."""
    if not values["name"]:
        raise ConfigError("no --name provided for worker")
    if not topology:
        raise ConfigError("no --topology given (and no --cluster-key for zero-config setup)")
    served, layers, checkpoint = placement.worker_placement(values["name"], topology, source, values["master_tflops"])
    return served, layers, model if checkpoint is None else str(checkpoint)
