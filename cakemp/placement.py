"""What a `--model` and a topology mean, for a node (`cakemp run`) and a master (`cakemp generate`,
`cakemp serve`) alike; torch-free.

The argument is located (`checkpoint.locate`); where it is a Hugging Face id, the files this process
needs and its snapshot lacks are fetched (`checkpoint.hub`): config.json and the index first, then
the shards of the layers it computes. A topology whose nodes list no layers is completed by Cake's
default strategy (`assign`), as Cake (HEAD) completes it on every process, master and workers
alike: weighed by the master's TFLOPS (given, else this machine's devices', as Cake counts them:
`own_tflops`) and, where nodes give `vram_bytes`, by one layer's size estimated from every shard's
header. Each process completes it on its own, so they agree only with the same topology,
checkpoint and master TFLOPS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cakemp import gpus, log
from cakemp.checkpoint import hub
from cakemp.checkpoint.config import FAMILIES, ModelConfig
from cakemp.checkpoint.files import TOKENIZER, container_of, in_layer
from cakemp.checkpoint.hub import fetch_metadata, fetch_weights
from cakemp.checkpoint.locate import ModelSource, locate
from cakemp.errors import ConfigError
from cakemp.topology import Topology, collapse_layers

# What a master reads beside the weights when --model is a repository id: the tokenizer it needs,
# and the files that say how to prompt the model, fetched with config.json where the repository has them.
MASTER_OPTIONAL = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


@dataclass(frozen=True)
class Assignment:
    """A topology whose nodes listed no layers, completed by Cake's default strategy, and what it was weighed by."""

    topology: Topology
    master_tflops: float
    num_layers: int
    layer_bytes: int  # one layer's size estimated from the shards' headers; 0: no node gives vram_bytes


def assign(layout: Topology, source: ModelSource, master_tflops: float | None, *, on_gpu: bool) -> Assignment:
    """`layout` (no node listing a layer) completed by Cake's default strategy: the master weighed as
    `master_tflops`, else as `own_tflops(on_gpu)`; a layer by its size where nodes give `vram_bytes`."""
    config = ModelConfig.from_dir(source.checkpoint())
    if (decoder_key := FAMILIES[config.family].decoder_key) is not None:
        raise ConfigError(f"{source.checkpoint()}: Cake's default assignment finds no layer count in a "
                          f"{config.architecture} config.json (it is in {decoder_key}) and assigns no layers: "
                          "list them in the topology")
    if master_tflops is None:
        master_tflops = own_tflops(on_gpu)
    layer_bytes = hub.layer_bytes(source, config.num_hidden_layers, config.layer_prefix) if layout.weighs_memory else 0
    done = layout.assigned(config.num_hidden_layers, config.layer_prefix, master_tflops, layer_bytes)
    return Assignment(done, master_tflops, config.num_hidden_layers, layer_bytes)


def own_tflops(on_gpu: bool) -> float:
    """This machine's TFLOPS as Cake counts its own: its GPUs' when `on_gpu`, else its CPU's."""
    return sum(device.tflops for device in gpus.describe(gpus.select_devices("all") if on_gpu else (None,)))


def check_pushable(model: str | Path) -> None:
    """Refuse (ConfigError) a model zero-config setup cannot push: as in Cake, a GGUF file is served
    in topology mode only, from each node's own copy."""
    if not (container := container_of(model)).pushable:
        raise ConfigError(f"{model}: a {container.name} model cannot be pushed to zero-config workers; give --topology")


def worker_placement(name: str, topology: str | Path, source: ModelSource,
                     master_tflops: float | None) -> tuple[str, tuple[str, ...], Path | None]:
    """A worker's entry of `topology` (its name and layers; where no node lists a layer, those Cake's
    default strategy gives it, this machine's GPUs weighing the master unless `master_tflops`), with
    the files of a repository it lacks for them fetched; and the checkpoint it loads them from where
    `source` is a bundle or a repository (None: the --model argument itself)."""
    source, fetched = fetch_metadata(source)
    served, layers = _worker_entry(name, Topology.load(topology), source, master_tflops)
    fetched += fetch_weights(source, lambda tensor: any(in_layer(tensor, layer) for layer in layers))
    if fetched:
        log.get_logger().info("downloaded from the hub", repository=str(source.repository), files=fetched)
    if source.repository is not None or source.topology is not None:
        return served, layers, source.checkpoint()
    return served, layers, None


def _worker_entry(name: str, layout: Topology, source: ModelSource,
                  master_tflops: float | None) -> tuple[str, tuple[str, ...]]:
    """The entry of `layout` the worker `name` serves (its name and layers), completed first where no node lists a layer."""
    logger = log.get_logger()
    assignment = None
    if layout.needs_assignment:
        assignment = assign(layout, source, master_tflops, on_gpu=True)
        logger.warning(
            "the topology lists no layers: every node and the master assign them on their own, by Cake's default "
            "strategy, and agree only with the same topology, checkpoint and master TFLOPS (--master-tflops)",
            master_tflops=assignment.master_tflops, layer_bytes=assignment.layer_bytes,
            num_layers=assignment.num_layers)
        layout = assignment.topology
    served, node = layout.worker(name)
    if served != name:
        logger.warning("worker name not in topology, serving its only entry", name=name, entry=served)
    if not node.layers and assignment is not None:
        raise ConfigError(f"the default assignment gives topology entry '{served}' no layers (give the nodes tflops, "
                          "or the master fewer with --master-tflops)")
    if not node.layers:
        raise ConfigError(f"topology entry '{served}' lists no layers")
    if assignment is not None:
        logger.info("layers assigned", name=served, layers=list(collapse_layers(node.layers)), count=len(node.layers))
    return served, node.layers


def master_checkpoint(argument: str, topology: str | None, master_tflops: float | None, *, on_gpu: bool,
                      every_layer: bool, report: Callable[[str], None]) -> tuple[Path, Topology]:
    """The checkpoint (a directory or a GGUF file) `--model argument` names and the topology the master runs with
    (`topology`, else a bundle's, else none; one whose nodes list no layers completed by `assign`,
    weighing this master as `master_tflops`, else as `own_tflops(on_gpu)`; `report` is told each
    node's layers then, one line per node given some).
    A repository's missing files are fetched: config, index and tokenizer, and the shards of the
    layers no worker serves, or of `every_layer` (a master that pushes, refused a GGUF before it is fetched)."""
    if every_layer:
        check_pushable(argument)
    source, fetched = fetch_metadata(locate(argument), (TOKENIZER,), MASTER_OPTIONAL)
    topology = topology or source.topology
    layout = Topology.load(topology) if topology else Topology(())
    if layout.needs_assignment:
        layout = assign(layout, source, master_tflops, on_gpu=on_gpu).topology
        for name, node in layout.nodes:
            if node.layers:
                report(f"{name} at {node.host}: {node.layers[0]}..{node.layers[-1]} ({len(node.layers)} layers)")
    remote = {layer for _, node in layout.nodes for layer in node.layers}
    fetched += fetch_weights(source, lambda tensor: every_layer or not any(in_layer(tensor, layer) for layer in remote))
    if fetched:
        report(f"downloaded from {source.repository}: {', '.join(fetched)}")
    return source.checkpoint(), layout
