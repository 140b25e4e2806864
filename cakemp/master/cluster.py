"""A zero-config cluster from the master's side: discovered workers, proven, their layers, their setup.

A discovery reply proves nothing (master/discovery.py), so `prove_key` first connects to every
address that answered and runs the cluster-key handshake there, the same one every connection
starts with; an address that does not answer, or does not prove the key, is dropped (told to
`report` in one line, naming addresses and why, never a reply's own text), and the others go on.
Only proven workers are weighed and given layers, over the connection that proved them. Where
names repeat among them, the first keeps it (as in Cake: one worker answering at two addresses).

`assign_layers` splits the model's layers as Cake's default strategy does (docs/protocol.md, Layer assignment;
`topology.default_assignment`): the workers, fastest first, get contiguous runs from layer 0 in
proportion to their TFLOPS, the master's own TFLOPS counted in the total, each capped by what
its devices' memory holds (less a reserve: a layer at its resident bytes on each device kind,
checkpoint/resident.py), the least any reply for its address claims; the master keeps the rest.
`set_up` runs the setup exchange with every worker at once, pushing the files it asks for, and
returns the topology the generator then uses; `discover_cluster` is the four steps together, as
`cakemp generate --discover` runs them.
(Cake also hands layers the master cannot fit back to the workers; cakemp's master computes
whatever is left, so that step is not reproduced.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.resident import PerDevice, device_kernels
from cakemp.compute.loading import LoadPlan
from cakemp.compute.tensors import compute_dtype
from cakemp.errors import AuthError, CakempError, WorkerUnreachable
from cakemp.master.address import dial
from cakemp.master.client import WorkerClient
from cakemp.master.discovery import DiscoveredWorker, discover
from cakemp.master.model_push import model_chunks, model_hash
from cakemp.model.weights.readers import open_checkpoint
from cakemp.placement import check_pushable, own_tflops
from cakemp.topology import Capacity, Node, Topology, default_assignment, layer_names
from cakemp.wire import Revision
from cakemp.wire.discovery import GpuInfo

_CUDA_RESERVE = (0.05, 768 << 20)  # fraction, floor in bytes: what a CUDA device keeps for itself
_CPU_RESERVE = 0.20
_DROPS_NAMED = 8  # addresses the line about dropped replies names; past them it counts


async def discover_cluster(model_dir: str | Path, cluster_key: str, targets: Sequence[str], *, port: int,
                           timeout: float, min_workers: int, revision: Revision, on_gpu: bool, dtype: str,
                           report: Callable[[str], None]) -> Topology:
    """Discover the cluster's workers at `targets`, give them layers as Cake does, push them the files;
    the topology they then serve. The master's own share is weighed by its devices: its GPUs when
    `on_gpu`, else its CPU; a layer by what a worker computing in `dtype` (--dtype, the cluster's) holds
    of it. `report` is told the replies dropped, and each worker's layers, one line per worker."""
    check_pushable(model_dir)
    config = ModelConfig.from_dir(model_dir)
    held = layer_bytes(Path(model_dir), dtype)
    workers = await discover(cluster_key, targets, port=port, timeout=timeout, min_workers=min_workers)
    if not workers:
        raise CakempError(f"no worker of this cluster answered at {', '.join(targets)} within {timeout:g} s")
    clients = await prove_key(workers, cluster_key=cluster_key, revision=revision, report=report)
    if not clients:
        raise CakempError(f"no worker answering at {', '.join(targets)} proved the cluster key")
    assignments = assign_layers(list(clients), config.num_hidden_layers, own_tflops(on_gpu), held,
                                config.layer_prefix)
    for worker, layers in assignments:
        report(f"{worker.name} at {worker.address}: {layers[0]}..{layers[-1]} ({len(layers)} layers)")
    return await set_up(model_dir, assignments, clients)


async def prove_key(workers: Sequence[DiscoveredWorker], *, cluster_key: str, revision: Revision,
                    report: Callable[[str], None], timeout: float = 10.0) -> dict[DiscoveredWorker, WorkerClient]:
    """The workers that prove the cluster key at their address (all dialled at once, each within
    `timeout`), in `workers`' order, each with its authenticated connection, on which nothing has
    been sent; the first of each name. The others are dropped and told to `report` in one line."""

    async def proof(worker: DiscoveredWorker) -> WorkerClient | str:
        try:
            return await dial(worker.address, cluster_key=cluster_key, revision=revision, timeout=timeout)
        except WorkerUnreachable:
            return "no TCP answer"
        except AuthError:
            return "no cluster-key proof"

    proven: dict[DiscoveredWorker, WorkerClient] = {}
    dropped, names = [], set()
    for worker, outcome in zip(workers, await asyncio.gather(*(proof(worker) for worker in workers))):
        if isinstance(outcome, str):
            dropped.append(f"{worker.address} ({outcome})")
        elif worker.name in names:
            await outcome.close()
        else:
            names.add(worker.name)
            proven[worker] = outcome
    if dropped:
        more = f" and {len(dropped) - _DROPS_NAMED} more" if len(dropped) > _DROPS_NAMED else ""
        report(f"discovery: dropped the replies of {len(dropped)} addresses that did not prove the cluster key: "
               f"{', '.join(dropped[:_DROPS_NAMED])}{more}")
    if contested := [worker.address for worker in proven if len(worker.claims) > 1]:
        report(f"discovery: different replies name {', '.join(contested[:_DROPS_NAMED])}: each is weighed by the "
               "least any of them claims (replies are not authenticated: another host may have sent one)")
    return proven


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
    their memory holds (`max_layers`, a layer's bytes on each device kind; no cap when one is 0), the
    least any of its claims says."""
    capped = min(layer_bytes) > 0
    capacities = [Capacity(w.name, w.tflops, _least_layers(w, layer_bytes) if capped else None)
                  for w in workers]
    return [(workers[i], layer_names(prefix, run)) for i, run in default_assignment(capacities, num_layers, master_tflops)]


def _least_layers(worker: DiscoveredWorker, layer_bytes: PerDevice) -> int:
    return min(max_layers(claim.gpus, layer_bytes) for claim in worker.claims)


async def set_up(model_dir: str | Path, assignments: Sequence[tuple[DiscoveredWorker, tuple[str, ...]]],
                 clients: Mapping[DiscoveredWorker, WorkerClient]) -> Topology:
    """Run the setup with every assigned worker at once, each over its authenticated connection in
    `clients` (pushing the files each asks for), and return the topology of what they serve; raises
    the first worker's failure. Every connection in `clients` is closed on return, those given no layers too."""
    hash_ = model_hash(model_dir)

    async def one(worker: DiscoveredWorker, layers: tuple[str, ...]) -> tuple[str, Node]:
        client = clients[worker]
        await client.assign_layers(layers, hash_, model_chunks(model_dir, layers, client.revision))
        return worker.name, Node(host=worker.address, layers=layers)

    try:
        return Topology(tuple(await asyncio.gather(*(one(worker, layers) for worker, layers in assignments))))
    finally:
        for client in clients.values():
            await client.close()

