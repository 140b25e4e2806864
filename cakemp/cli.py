"""`cakemp` commands: thin; each builds a config object and hands it on.

Every flag also reads CAKEMP_<FLAG> from the environment (--cluster-key also Cake's
CAKE_CLUSTER_KEY). A configuration error exits with status 78 (EX_CONFIG) and one line.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import click

from cakemp import __version__, log
from cakemp.errors import CakempError, ConfigError
from cakemp.device import process as device_process
from cakemp.front import Front, NodeConfig
from cakemp.address import parse_address
from cakemp.front.config import device_environment, discover_gpus, parse_gpus
from cakemp.setup.cache import cache_root
from cakemp.setup.exchange import SetupConfig
from cakemp.front.notify import Notifier
from cakemp.ipc.spec import MAX_BATCH, PREFILL_CHUNK
from cakemp.topology import Topology
from cakemp.wire import Revision
from cakemp.wire.discovery import DISCOVERY_PORT

EXIT_CONFIG = 78


def _env(flag: str) -> str:
    return "CAKEMP_" + flag.upper().replace("-", "_")


def _flag(*decls: str, **kwargs):
    """A click option that also reads CAKEMP_<FLAG> (unless given its own envvar) and says so in --help."""
    kwargs.setdefault("envvar", _env(decls[0].lstrip("-")))
    return click.option(*decls, show_envvar=True, **kwargs)


@click.group(context_settings={"show_default": True})
@click.version_option(__version__, prog_name="cakemp")
def cli() -> None:
    """cakemp: a multi-GPU worker node for Cake distributed LLM inference."""


@cli.command()
@_flag("--name", help="This worker's entry in the topology; in zero-config mode its discovery name (default: the host name).")
@_flag("--model", default="./cake-data/Meta-Llama-3-8B/", help="Model directory.")
@_flag("--topology", help="Cake topology YAML; without it and with --cluster-key, zero-config mode (the master "
       "discovers the node and pushes the model).")
@_flag("--address", default="0.0.0.0:10128", help="host:port to listen on.")
@_flag("--cluster-key", envvar=["CAKE_CLUSTER_KEY", _env("cluster-key")], help="Shared key; turns on auth.")
@_flag("--dtype", type=click.Choice(["f16", "bf16", "f32"]), default="f16", help="Compute dtype of the layers.")
@_flag("--gpus", default="all",
       help="all | cpu | cpu:N | GPU indices (of the visible GPUs, PCI bus order) or GPU/MIG UUIDs, like 0,2.")
@_flag("--protocol", type=click.Choice(["1", "2"]), default="2",
       help="Cake revision: 1 = fa7d08a (WorkerError tag 11), 2 = after 2026-03-21 (tag 12).")
@_flag("--kv-budget-mib", type=click.IntRange(min=1),
       help="KV cache budget per device process, in MiB (default: none on a CPU; on a GPU what is free after "
            "loading, less max(2 GiB, a tenth of the GPU)).")
@_flag("--max-context", type=click.IntRange(min=1), help="Maximum positions per session (default: the model's).")
@_flag("--cpu-threads", type=click.IntRange(min=1),
       help="torch threads per CPU device process (default: the cores divided among them).")
@_flag("--drain-timeout", type=click.FloatRange(min=0), default=30.0,
       help="Seconds requests in flight get to finish after SIGTERM or SIGINT (a second signal exits at once).")
@_flag("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
       help="Seconds a device process may take to answer the front before it counts as hung and is restarted.")
@_flag("--restart-attempts", type=click.IntRange(min=1), default=5,
       help="Failed starts in a row of one device process after which the node exits 1.")
@_flag("--prefill-chunk", type=click.IntRange(min=1), default=PREFILL_CHUNK,
       help="Tokens per chunk of a prompt, and the prompt tokens a device runs per step beside its decodes: "
            "a long prompt neither stalls other sessions' decodes nor waits behind them, and across several "
            "devices its chunks flow down the route one after another, so the devices work at once.")
@_flag("--max-batch", type=click.IntRange(min=1), default=MAX_BATCH,
       help="Requests a device runs together in one step at most: decode steps of concurrent sessions share "
            "one pass over the weights (1: each request alone, as Cake's worker).")
@_flag("--metrics-address", help="host:port serving /metrics, /healthz and /readyz (default: off).")
@_flag("--max-connections", type=click.IntRange(min=1), default=4096,
       help="Master connections served at once; more are closed at once (a master opens one per remote layer).")
@_flag("--max-buffered-mib", type=click.IntRange(min=1), default=1024,
       help="MiB of frames all connections together may hold; past it connections wait, unread (backpressure).")
@_flag("--frame-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
       help="Seconds a frame may take to arrive once its header has (Hello: once connected); then it is closed.")
@_flag("--session-idle-timeout", type=click.FloatRange(min=0, min_open=True),
       help="Seconds a session may sit idle before its KV cache is freed (default: never, as Cake).")
@_flag("--discovery-port", type=click.IntRange(0, 65535), default=DISCOVERY_PORT,
       help="Zero-config: UDP port answering the master's discovery.")
@_flag("--discovery-bind", default="0.0.0.0", help="Zero-config: address the discovery responder binds.")
@_flag("--max-model-gib", type=click.FloatRange(0, min_open=True), default=1024.0,
       help="Zero-config: most GiB a master may push, all files together.")
@_flag("--log-format", type=click.Choice(list(log.FORMATS)), default="auto",
       help="auto = console on a terminal, JSON lines otherwise.")
@_flag("--log-level", type=click.Choice(list(log.LEVELS)), default="info")
@_flag("--stats-interval", type=click.FloatRange(min=0, min_open=True), default=60.0,
       help="Seconds between throughput log lines (none while nothing is served).")
def run(name, model, topology, address, cluster_key, dtype, gpus, protocol, kv_budget_mib, max_context,
        cpu_threads, drain_timeout, request_timeout, restart_attempts, prefill_chunk, max_batch, metrics_address, max_connections,
        max_buffered_mib, frame_timeout, session_idle_timeout, discovery_port, discovery_bind, max_model_gib,
        log_format, log_level, stats_interval) -> None:
    """Serve this worker's layers: its entry's in a Cake topology, or (with --cluster-key and no
    --topology: zero-config) those a master discovering it assigns and pushes."""
    log.configure(log_format, log_level)
    logger = log.get_logger()
    # First: it takes the manager's variables out of the environment the device processes inherit.
    notifier = Notifier.from_env()
    setup = None
    if cluster_key and not topology:
        # Cake's rule for zero-config: a key and no topology (--model has a default, so it cannot count).
        served, layers, model = name or socket.gethostname(), (), ""
        if click.get_current_context().get_parameter_source("model") != click.core.ParameterSource.DEFAULT:
            logger.warning("--model is ignored in zero-config mode: the master pushes the model")
        setup = SetupConfig(cluster_key=cluster_key, cache_root=cache_root(),
                            max_model_bytes=int(max_model_gib * (1 << 30)),
                            discovery_host=discovery_bind, discovery_port=discovery_port)
    elif not name:
        raise ConfigError("no --name provided for worker")
    elif not topology:
        raise ConfigError("no --topology given (and no --cluster-key for zero-config setup)")
    else:
        served, node = Topology.load(topology).worker(name)
        if served != name:
            logger.warning("worker name not in topology, serving its only entry", name=name, entry=served)
        if not node.layers:
            raise ConfigError(f"topology entry '{served}' lists no layers")
        layers = node.layers
    os.environ.update(device_environment(os.environ))  # for the device processes, which inherit it
    wants_gpus = not gpus.strip().startswith("cpu")
    devices = parse_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), discover_gpus() if wants_gpus else None)
    if gpus.strip() == "all" and devices == (None,):
        logger.warning("no CUDA device found; serving on one CPU device")
    if setup is None and len(devices) > len(layers):
        logger.warning("more devices than layers, using one per layer", devices=len(devices), layers=len(layers))
        devices = devices[: len(layers)]
    host, port = parse_address(address)
    config = NodeConfig(
        name=served, model_dir=model, layers=layers, devices=devices, host=host, port=port,
        cluster_key=cluster_key or None, dtype=dtype, revision=Revision(int(protocol)),
        kv_budget_bytes=kv_budget_mib * (1 << 20) if kv_budget_mib else None, max_context=max_context,
        cpu_threads=cpu_threads, drain_timeout=drain_timeout, request_timeout=request_timeout,
        restart_attempts=restart_attempts, prefill_chunk=prefill_chunk, max_batch=max_batch,
        metrics_address=parse_address(metrics_address, "--metrics-address") if metrics_address else None,
        max_connections=max_connections, max_buffered_bytes=max_buffered_mib * (1 << 20), frame_timeout=frame_timeout,
        session_idle_timeout=session_idle_timeout, log_format=log_format, log_level=log_level, setup=setup,
        stats_interval=stats_interval,
    )
    # The front's exit status; a CakempError (a device that died while loading, say) exits 1.
    sys.exit(_run_or_exit(Front(config, device_process.main, notifier).run()))


@cli.command()
@_flag("--model", default="./cake-data/Meta-Llama-3-8B/", help="Model directory.")
@_flag("--topology", help="Cake topology YAML (without it every layer runs here).")
@_flag("--prompt", default="Once upon a time", help="Text to continue.")
@_flag("--max-tokens", type=click.IntRange(min=1), default=128,
       help="Most tokens to generate (fewer when EOS comes first).")
@_flag("--temperature", type=float, default=1.0, help="0 or less: greedy.")
@_flag("--top-k", type=click.IntRange(min=1), help="Sample among the k likeliest.")
@_flag("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus mass.")
@_flag("--repeat-penalty", type=click.FloatRange(0, min_open=True),
       default=1.1, help="Penalty on recently generated tokens (1.0: none).")
@_flag("--repeat-last-n", type=click.IntRange(min=0), default=128,
       help="How many recent tokens the penalty looks at.")
@_flag("--seed", type=int, default=299792458, help="Sampling seed.")
@_flag("--cluster-key", envvar=["CAKE_CLUSTER_KEY", _env("cluster-key")], help="Shared key of the workers.")
@_flag("--dtype", type=click.Choice(["f16", "bf16", "f32"]), default="f16",
       help="Compute and wire dtype; must match the workers'.")
@_flag("--protocol", type=click.Choice(["1", "2"]), default="2",
       help="Cake revision the workers speak.")
@_flag("--discover", help="Zero-config: find the cluster's workers at these comma-separated addresses "
       "(broadcast like 255.255.255.255, or the workers' own), give them layers and push them the files.")
@_flag("--discovery-port", type=click.IntRange(1, 65535), default=DISCOVERY_PORT, help="UDP port of the workers' discovery.")
@_flag("--discovery-timeout", type=click.FloatRange(0, min_open=True), default=10.0,
       help="Seconds to collect discovery replies.")
@_flag("--min-workers", type=click.IntRange(min=0), default=0,
       help="Stop collecting replies once this many workers answered (0: wait the whole timeout).")
def generate(model, topology, prompt, max_tokens, temperature, top_k, top_p, repeat_penalty, repeat_last_n, seed,
             cluster_key, dtype, protocol, discover, discovery_port, discovery_timeout, min_workers) -> None:
    """Generate text as a Cake master: this process runs the layers no worker serves."""
    import torch  # here, not at the top: `cakemp run`'s front must never import torch

    from cakemp.master.generator import Generator
    from cakemp.master.sampler import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, repeat_penalty, repeat_last_n, seed)
    if discover and topology:
        raise ConfigError("--discover and --topology exclude each other")
    if discover and not cluster_key:
        raise ConfigError("--discover needs --cluster-key (the cluster's workers answer only to its hash)")
    layout = Topology.load(topology) if topology else Topology(())
    device = "cuda" if torch.cuda.is_available() else "cpu"

    async def stream():
        nonlocal layout
        if discover:
            layout = await _discover_cluster(model, cluster_key, [t.strip() for t in discover.split(",") if t.strip()],
                                             discovery_port, discovery_timeout, min_workers, Revision(int(protocol)),
                                             device)
        async with await Generator.open(model, layout, dtype=dtype, device=device, cluster_key=cluster_key or None,
                                        revision=Revision(int(protocol))) as generator:
            click.echo(prompt, nl=False)
            done = await generator.generate(prompt, max_tokens, sampling, on_text=lambda t: click.echo(t, nl=False))
        click.echo()
        click.echo(done.summary(), err=True)

    _run_or_exit(stream())


async def _discover_cluster(model, cluster_key, targets, port, timeout, min_workers, revision, device) -> Topology:
    """Discover the workers, give them layers as Cake does, push them the files; the resulting topology."""
    from cakemp.setup.discovery import local_devices
    from cakemp.master.cluster import assign_layers, layer_bytes, set_up
    from cakemp.master.discovery import discover
    from cakemp.checkpoint.config import ModelConfig

    workers = await discover(cluster_key, targets, port=port, timeout=timeout, min_workers=min_workers)
    if not workers:
        raise CakempError(f"no worker of this cluster answered at {', '.join(targets)} within {timeout:g} s")
    config = ModelConfig.from_dir(model)
    gpus = parse_gpus("all", os.environ.get("CUDA_VISIBLE_DEVICES"), discover_gpus()) if device == "cuda" else (None,)
    master_tflops = sum(gpu.tflops for gpu in local_devices(gpus))
    assignments = assign_layers(workers, config.num_hidden_layers, master_tflops,
                                layer_bytes(model, config.num_hidden_layers), config.layer_prefix)
    for worker, layers in assignments:
        click.echo(f"{worker.name} at {worker.address}: {layers[0]}..{layers[-1]} ({len(layers)} layers)", err=True)
    return await set_up(model, assignments, cluster_key=cluster_key, revision=revision)


@cli.command()
@click.argument("address")
@_flag("--cluster-key", envvar=["CAKE_CLUSTER_KEY", _env("cluster-key")], help="Shared key of the node.")
@_flag("--json", "as_json", is_flag=True, help="Print the WorkerInfo as one JSON object.")
@_flag("--timeout", type=click.FloatRange(0, min_open=True), default=5.0, help="Seconds per step.")
@_flag("--protocol", type=click.Choice(["1", "2"]), default="2",
       help="Cake revision the node speaks.")
@_flag("--metrics-address", help="The node's --metrics-address: also show which layers each device serves.")
def probe(address, cluster_key, as_json, timeout, protocol, metrics_address) -> None:
    """Check the node at ADDRESS (host:port): authenticate, say Hello, print its WorkerInfo.

    Exits 0 when it answers; 1 when it is down, 2 when the key handshake fails, 3 when it
    answers anything but WorkerInfo; each with one line on stderr.
    """
    import dataclasses
    import json

    from cakemp.errors import AuthError, ProtocolError, WorkerUnreachable
    from cakemp.master.probe import probe as probe_node
    from cakemp.master.probe import read_placement

    try:
        info = asyncio.run(probe_node(address, cluster_key=cluster_key or None, timeout=timeout,
                                      revision=Revision(int(protocol))))
        placement = read_placement(metrics_address, timeout=timeout) if metrics_address else None
    except WorkerUnreachable as e:
        _exit(f"down: {e}", 1)
    except AuthError as e:
        _exit(f"cluster key refused: {e}", 2)
    except ProtocolError as e:
        _exit(f"wrong answer: {e}", 3)
    if as_json:
        extra = {} if placement is None else {"placement": placement}
        click.echo(json.dumps({"address": address, **dataclasses.asdict(info), **extra}))
        return
    click.echo(f"{address} is up: version {info.version}, {info.os}/{info.arch}, device {info.device} "
               f"{info.device_idx}, dtype {info.dtype}, latency {info.latency} ms")
    for device in (placement or {}).get("devices", ()):
        click.echo(f"  {device['device']} serves {', '.join(device['layers'])}")


@cli.command()
def demo() -> None:
    """Run a synthetic model through a local two-device node, no download needed (about a minute)."""
    from cakemp.demo.run import run_demo

    _run_or_exit(run_demo())


def _run_or_exit(coroutine):
    """Run `coroutine`, returning its result; a CakempError other than ConfigError (that one exits 78) exits 1
    with one line."""
    try:
        return asyncio.run(coroutine)
    except ConfigError:
        raise
    except CakempError as e:
        _exit(str(e), 1)


def _exit(message: str, status: int) -> None:
    click.echo(f"cakemp: error: {message}", err=True)
    sys.exit(status)


def main() -> None:
    """Console entry point: click's own usage errors and ConfigError exit 78 with one line."""
    try:
        cli.main(standalone_mode=False)
    except ConfigError as e:
        click.echo(f"cakemp: error: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    except click.UsageError as e:
        click.echo(f"cakemp: error: {e.format_message()}", err=True)
        sys.exit(EXIT_CONFIG)
    except click.Abort:
        sys.exit(1)
