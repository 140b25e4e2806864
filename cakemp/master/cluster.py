"""A zero-config cluster from the master's side: discovered workers, their layers, their setup.

`assign_layers` splits the model's layers as Cake's default strategy does (docs/protocol.md, Layer assignment;
`topology.default_assignment`): the workers, fastest first, get contiguous runs from layer 0 in
proportion to their TFLOPS, the master's own TFLOPS counted in the total, each capped by what
its devices' memory holds (less a reserve: a layer at its resident bytes on each device kind,
checkpoint/resident.py); the master keeps the rest. `set_up` runs the setup
exchange with every worker at once, pushing the files it asks for, and returns the topology the
generator then uses; `discover_cluster` is the three steps together, as `cakemp generate
--discover` runs them.
(Cake also hands layers the master cannot fit back to the workers; cakemp's master computes
whatever is left, so that step is not reproduced.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.resident import PerDevice, device_kernels
from cakemp.compute.loading import LoadPlan
from cakemp.compute.tensors import compute_dtype
from cakemp.errors import CakempError
from cakemp.master.address import dial
from cakemp.master.discovery import DiscoveredWorker, discover
from cakemp.master.model_push import model_chunks, model_hash
from cakemp.model.weights.readers import open_checkpoint
from cakemp.placement import check_pushable, own_tflops
from cakemp.topology import Capacity, Node, Topology, default_assignment, layer_names
from cakemp.wire import Revision
from cakemp.wire.discovery import GpuInfo

_CUDA_RESERVE = (0.05, 768 << 20)  # fraction, floor in bytes: what a CUDA device keeps for itself
_CPU_RESERVE = 0.20


async def discover_cluster(model_dir: str | Path, cluster_key: str, targets: Sequence[str], *, port: int,
                           timeout: float, min_workers: int, revision: Revision, on_gpu: bool, dtype: str,
                           report: Callable[[str], None]) -> Topology:
    """Discover the cluster's workers at `targets`, give them layers as Cake does, push them the files;
    the topology they then serve. The master's own share is weighed by its devices: its GPUs when
    `on_gpu`, else its CPU; a layer by what a worker computing in `dtype` (--dtype, the cluster's) holds
    of it. `report` is told each worker's layers, one line per worker."""
    check_pushable(model_dir)
    workers = await discover(cluster_key, targets, port=port, timeout=timeout, min_workers=min_workers)
    if not workers:
        raise CakempError(f"no worker of this cluster answered at {', '.join(targets)} within {timeout:g} s")
    config = ModelConfig.from_dir(model_dir)
    held = layer_bytes(Path(model_dir), dtype)
    assignments = assign_layers(workers, config.num_hidden_layers, own_tflops(on_gpu), held, config.layer_prefix)
    for worker, layers in assignments:
        report(f"{worker.name} at {worker.address}: {layers[0]}..{layers[-1]} ({len(layers)} layers)")
    return await set_up(model_dir, assignments, cluster_key=cluster_key, revision=revision)


def layer_bytes(model_dir: Path, dtype: str) -> PerDevice:
    """One layer's resident bytes (all of them over their count, as Cake averages) on a CPU and on a
    GPU device of a worker computing in `dtype` (--dtype, the cluster's): `held_bytes` of every layer."""
    config = ModelConfig.from_dir(model_dir)
    total = held_bytes(model_dir, dtype, [config.layer_name(i) for i in range(config.num_hidden_layers)])
    return PerDevice(*(size // max(1, config.num_hidden_layers) for size in total))


def held_bytes(model_dir: Path, dtype: str, layers: Sequence[str]) -> PerDevice:
    """What a worker's device holds of `layers`, counted from the headers by the node's own rule
    (compute/loading.LoadPlan.nbytes: its fused weights, stacked experts, kept int4 and int8 matrices)
    for each device kind's kept kernels (checkpoint/resident.py: a worker's --dequantize-4bit is not
    announced, so the default is counted)."""
    checkpoint = open_checkpoint(model_dir)
    plan = LoadPlan.of(checkpoint.config, checkpoint, layers)
    return PerDevice(*(plan.nbytes(checkpoint, compute_dtype(dtype), kernels=device_kernels(kind, dtype == "bf16"))
                       for kind in PerDevice._fields))


def max_layers(gpus: Sequence[GpuInfo], per_device: PerDevice) -> int:
    """How many layers the devices hold, each keeping Cake's reserve, a layer taking `per_device`'s
    bytes on a device of its kind (a CPU keeps 4- and 8-bit matrices so, a GPU may not)."""
    total = 0
    for gpu in gpus:
        held = per_device.on(gpu.is_cpu)
        if gpu.is_cpu:
            usable = gpu.vram_bytes * (1 - _CPU_RESERVE)
        else:
            fraction, floor = _CUDA_RESERVE
            usable = gpu.vram_bytes - max(gpu.vram_bytes * fraction, floor)
        total += max(0, int(usable // held))
    return total


def assign_layers(workers: Sequence[DiscoveredWorker], num_layers: int, master_tflops: float,
                  layer_bytes: PerDevice, prefix: str = "model.layers") -> list[tuple[DiscoveredWorker, tuple[str, ...]]]:
    """Each worker given layers by Cake's default strategy, with its contiguous run of layer names;
    workers given none are left out. Each is weighed by its devices' TFLOPS and capped by what
    their memory holds (`max_layers`, a layer's bytes on each device kind; no cap when one is 0)."""
    capped = min(layer_bytes) > 0
    capacities = [Capacity(w.name, w.tflops, max_layers(w.announcement.gpus, layer_bytes) if capped else None)
                  for w in workers]
    return [(workers[i], layer_names(prefix, run)) for i, run in default_assignment(capacities, num_layers, master_tflops)]


async def set_up(model_dir: str | Path, assignments: Sequence[tuple[DiscoveredWorker, tuple[str, ...]]], *,
                 cluster_key: str, revision: Revision, timeout: float = 10.0) -> Topology:
    """Run the setup with every assigned worker at once (pushing the files each asks for) and
    return the topology of what they serve; raises the first worker's failure."""
    hash_ = model_hash(model_dir)

    async def one(worker: DiscoveredWorker, layers: tuple[str, ...]) -> tuple[str, Node]:
        async with await dial(worker.address, cluster_key=cluster_key, revision=revision, timeout=timeout) as client:
            await client.assign_layers(layers, hash_, model_chunks(model_dir, layers, revision))
        return worker.name, Node(host=worker.address, layers=layers)

    return Topology(tuple(await asyncio.gather(*(one(worker, layers) for worker, layers in assignments))))

