"""`cakemp` commands: thin; each builds a config object and hands it on.

Every flag also reads CAKEMP_<FLAG> from the environment (--cluster-key also Cake's
CAKE_CLUSTER_KEY). A configuration error exits with status 78 (EX_CONFIG) and one line.
"""

from __future__ import annotations

import asyncio
import sys

import click

from cakemp import log
from cakemp.errors import ConfigError
from cakemp.front import Front, NodeConfig
from cakemp.front.config import cuda_devices, parse_address, parse_gpus
from cakemp.topology import Topology
from cakemp.wire import Revision

EXIT_CONFIG = 78


def _env(flag: str) -> str:
    return "CAKEMP_" + flag.upper().replace("-", "_")


@click.group(context_settings={"show_default": True})
def cli() -> None:
    """cakemp: a multi-GPU worker node for Cake distributed LLM inference."""


@cli.command()
@click.option("--name", envvar=_env("name"), help="This worker's entry in the topology.")
@click.option("--model", envvar=_env("model"), default="./cake-data/Meta-Llama-3-8B/", help="Model directory.")
@click.option("--topology", envvar=_env("topology"), help="Cake topology YAML.")
@click.option("--address", envvar=_env("address"), default="0.0.0.0:10128", help="host:port to listen on.")
@click.option("--cluster-key", envvar=["CAKE_CLUSTER_KEY", _env("cluster_key")], help="Shared key; turns on auth.")
@click.option("--dtype", envvar=_env("dtype"), type=click.Choice(["f16", "bf16", "f32"]), default="f16",
              help="Compute dtype of the layers.")
@click.option("--gpus", envvar=_env("gpus"), default="all", help="all | cpu | cpu:N | GPU indices like 0,2.")
@click.option("--protocol", envvar=_env("protocol"), type=click.Choice(["1", "2"]), default="2",
              help="Cake revision: 1 = fa7d08a (WorkerError tag 11), 2 = after 2026-03-21 (tag 12).")
@click.option("--kv-budget-mib", envvar=_env("kv_budget_mib"), type=click.IntRange(min=1),
              help="KV cache budget per device process, in MiB (default: no limit).")
@click.option("--max-context", envvar=_env("max_context"), type=click.IntRange(min=1),
              help="Maximum positions per session (default: the model's).")
@click.option("--log-format", envvar=_env("log_format"), type=click.Choice(list(log.FORMATS)), default="auto",
              help="auto = console on a terminal, JSON lines otherwise.")
@click.option("--log-level", envvar=_env("log_level"), type=click.Choice(list(log.LEVELS)), default="info")
def run(name, model, topology, address, cluster_key, dtype, gpus, protocol, kv_budget_mib, max_context,
        log_format, log_level) -> None:
    """Serve this worker's layers of a Cake topology."""
    log.configure(log_format, log_level)
    logger = log.get_logger()
    if not name:
        raise ConfigError("no --name provided for worker")
    if not topology:
        raise ConfigError("no --topology given (zero-config setup is not supported)")
    served, node = Topology.load(topology).worker(name)
    if served != name:
        logger.warning(f"topology for worker name '{name}' not found, using '{served}'")
    if not node.layers:
        raise ConfigError(f"topology entry '{served}' lists no layers")
    devices = parse_gpus(gpus, cuda_devices() if gpus.strip() == "all" else ())
    if gpus.strip() == "all" and devices == (None,):
        logger.warning("no CUDA device found; serving on one CPU device")
    if len(devices) > len(node.layers):
        logger.warning(f"{len(devices)} devices for {len(node.layers)} layers; using {len(node.layers)}")
        devices = devices[: len(node.layers)]
    host, port = parse_address(address)
    config = NodeConfig(
        name=served, model_dir=model, layers=node.layers, devices=devices, host=host, port=port,
        cluster_key=cluster_key or None, dtype=dtype, revision=Revision(int(protocol)),
        kv_budget_bytes=kv_budget_mib * (1 << 20) if kv_budget_mib else None, max_context=max_context,
        log_format=log_format, log_level=log_level,
    )
    sys.exit(asyncio.run(Front(config).run()))


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
