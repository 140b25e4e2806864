"""What each device process of a node is told, and the environment it starts in: its layers
and devices (`device_specs`), its torch threads and, with --pin-cpus, its cores (and the cores left
to the front), a CPU device's share of the host's memory for KV caches, and the variables the
front sets for CUDA and torch's allocator. Read from a `NodeConfig` (front/config.py's flags).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from cakemp.errors import ConfigError
from cakemp.front.config import NodeConfig
from cakemp.ipc.spec import ComponentFile, DeviceSpec

# torch threads of a GPU device process: its CPU work is host copies and Python, and one thread
# per core in each of several such processes only contends for the cores.
GPU_DEVICE_THREADS = 2
# The cores this node may use, as it started: with --pin-cpus the front then pins itself to the
# cores its devices leave, and a later start (zero-config's next setup) still shares out all of them.
NODE_CORES = tuple(sorted(os.sched_getaffinity(0)))
# The CPU devices given no --kv-budget-mib may together hold this share of the memory available
# when the node starts in KV caches; the rest is for their weights, activations and the host.
CPU_KV_SHARE = 0.5


def device_specs(config: NodeConfig, placement: Sequence[tuple[str, ...]], runtime_dir: str) -> list[DeviceSpec]:
    """What each device process is told: device i serves `placement[i]` on `config.devices[i]`,
    listening for the front in `runtime_dir`."""
    cpu_processes = sum(1 for gpu in config.devices if gpu is None)
    threads = _device_threads(config)
    cores = device_cores(threads) if config.pin_cpus else [None] * len(threads)
    # Without a budget a CPU device's caches grow until the host runs out and the OOM killer ends one.
    cpu_kv_budget = config.kv_budget_bytes or _cpu_kv_budget(
        cpu_processes, config.expert_cache_bytes if config.expert_offload else 0)
    return [
        DeviceSpec(
            index=i,
            gpu=gpu,
            parts=parts,
            checkpoint_path=config.checkpoint_path,
            dtype=config.dtype,
            endpoint=f"ipc://{runtime_dir}/device-{i}",
            kv_budget_bytes=cpu_kv_budget if gpu is None else config.kv_budget_bytes,
            max_context=config.max_context,
            max_batch=config.max_batch,
            cuda_graphs=config.cuda_graphs,
            prefill_chunk=config.prefill_chunk,
            threads=threads[i],
            cpus=cores[i],
            poll_s=config.device_poll_s,
            prefix_reuse=config.prefix_reuse and config.workload.reuses_prefixes,
            share_prefixes=config.share_prefixes,
            keep_int4=config.keep_int4,
            expert_cache_bytes=config.expert_cache_bytes if config.expert_offload else None,
            quantize=config.quantize,
            quantize_group=config.quantize_group,
            # Well inside the request timeout, which counts a device silent that long as hung.
            progress_s=config.request_timeout / 4,
            log_format=config.log_format,
            log_level=config.log_level,
            workload=config.workload,
            component_files=_component_files(config, parts),
        )
        for i, (gpu, parts) in enumerate(zip(config.devices, placement))
    ]


def _component_files(config: NodeConfig, components: tuple[str, ...]) -> tuple[tuple[str, ComponentFile], ...]:
    """The files of a device's image components, in its order (none for a text model's layers)."""
    if config.workload.image is None:
        return ()
    files = dict(config.component_files)
    return tuple((name, files[name]) for name in components)


def device_cores(threads: Sequence[int]) -> list[tuple[int, ...]]:
    """--pin-cpus: the cores of each device process, `threads[i]` of them for device i, in order from
    the cores this process may use. ConfigError if there are not that many."""
    allowed = NODE_CORES
    if sum(threads) > len(allowed):
        raise ConfigError(f"--pin-cpus needs {sum(threads)} cores for the device processes' threads, and this "
                          f"process may use {len(allowed)}: lower --cpu-threads, or leave the processes unpinned")
    starts = [sum(threads[:i]) for i in range(len(threads))]
    return [tuple(allowed[start:start + count]) for start, count in zip(starts, threads)]


def front_cores(config: NodeConfig) -> tuple[int, ...] | None:
    """--pin-cpus: the cores the devices leave to the front (None: none left, or not pinned: all of them)."""
    if not config.pin_cpus:
        return None
    taken = {core for cores in device_cores(_device_threads(config)) for core in cores}
    left = tuple(core for core in NODE_CORES if core not in taken)
    return left or None


def _device_threads(config: NodeConfig) -> list[int]:
    """torch threads of each device process of `config`: CPU processes share the cores rather than
    oversubscribe them."""
    cpu_processes = sum(1 for gpu in config.devices if gpu is None)
    cpu_threads = config.cpu_threads or max(1, len(NODE_CORES) // max(1, cpu_processes))
    return [cpu_threads if gpu is None else GPU_DEVICE_THREADS for gpu in config.devices]


def _cpu_kv_budget(cpu_processes: int, expert_cache_bytes: int = 0) -> int | None:
    """Each CPU device's share of CPU_KV_SHARE of the memory available now (/proc/meminfo's
    MemAvailable) less every device's expert cache (--expert-offload); None without CPU devices or
    where /proc/meminfo cannot be read."""
    if not cpu_processes:
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(0, int(kib * 1024 * CPU_KV_SHARE) - cpu_processes * expert_cache_bytes) // cpu_processes


def device_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the front sets for the device processes it spawns (they inherit its environment).

    CUDA_DEVICE_ORDER=PCI_BUS_ID: GPUs numbered as nvidia-smi lists them, as `gpus.parse_gpus`
    counts them. Unless the operator configured torch's allocator: expandable segments, so that a KV
    pool growing by doubling and requests of every size strand less memory between segments.
    """
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env
