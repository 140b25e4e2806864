"""The node's configuration, as `cakemp run` builds it and the front consumes it."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from cakemp.errors import ConfigError
from cakemp.ipc.spec import MAX_BATCH, PREFILL_CHUNK
from cakemp.setup.exchange import SetupConfig
from cakemp.wire import Revision

# Cake's WorkerInfo.dtype spelling (candle's Debug names) for each --dtype value.
WIRE_DTYPE_NAMES = {"f16": "F16", "bf16": "BF16", "f32": "F32"}


@dataclass(frozen=True)
class NodeConfig:
    """Everything the front needs; `devices` holds one CUDA_VISIBLE_DEVICES value per GPU, or None per CPU slot."""

    name: str
    model_dir: str
    layers: tuple[str, ...]
    devices: tuple[str | None, ...]
    host: str = "0.0.0.0"
    port: int = 10128
    cluster_key: str | None = None
    dtype: str = "f16"
    revision: Revision = Revision.V2
    kv_budget_bytes: int | None = None
    max_context: int | None = None
    cpu_threads: int | None = None  # torch threads per CPU device process (None: its share of the cores)
    drain_timeout: float = 30.0  # seconds requests in flight get to finish after SIGTERM/SIGINT
    request_timeout: float = 60.0  # seconds a device may take to answer before it counts as hung and is restarted
    restart_attempts: int = 5  # failed starts in a row of one device before the node exits 1
    # Tokens per chunk of a prompt, and prefill tokens a device runs per step beside its decodes.
    prefill_chunk: int = PREFILL_CHUNK
    max_batch: int = MAX_BATCH  # requests a device runs together in one step at most
    metrics_address: tuple[str, int] | None = None  # (host, port) of /metrics, /healthz, /readyz; None: off
    max_connections: int = 4096  # master connections at once (Cake opens one per remote layer)
    max_buffered_bytes: int = 1 << 30  # frame bytes all connections together may hold
    frame_timeout: float = 60.0  # seconds a frame may take to arrive once it has started
    session_idle_timeout: float | None = None  # seconds idle before a session's KV is freed; None: never
    log_format: str = "auto"
    log_level: str = "info"
    stats_interval: float = 60.0  # seconds between throughput lines (none while idle)
    # Zero-config mode: `layers` and `model_dir` come from a master's setup (then empty here).
    setup: SetupConfig | None = None


def device_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables the front sets for the device processes it spawns (they inherit its environment).

    CUDA_DEVICE_ORDER=PCI_BUS_ID: GPUs numbered as nvidia-smi lists them, as `parse_gpus` counts
    them. Unless the operator configured torch's allocator: expandable segments, so that KV
    caches growing by doubling and requests of every size strand less memory between segments.
    """
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


@dataclass(frozen=True)
class Gpu:
    """One GPU as `nvidia-smi -L` lists it: its index in PCI bus order, its UUID, and the UUIDs
    of its MIG instances (empty when MIG is off)."""

    index: int
    uuid: str
    migs: tuple[str, ...] = ()


_GPU_LINE = re.compile(r"^GPU (\d+): .*\(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG .*\(UUID: (MIG-[^)\s]+)\)")


def parse_gpu_list(text: str) -> tuple[Gpu, ...]:
    """The GPUs in `nvidia-smi -L` output, each with the MIG instances listed under it."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        if match := _GPU_LINE.match(line):
            gpus.append(Gpu(int(match[1]), match[2]))
        elif (match := _MIG_LINE.match(line)) and gpus:
            gpus[-1] = Gpu(gpus[-1].index, gpus[-1].uuid, (*gpus[-1].migs, match[1]))
    return tuple(gpus)


def discover_gpus() -> tuple[Gpu, ...] | None:
    """The machine's GPUs from `nvidia-smi -L` (asked of nvidia-smi so that the front never imports
    torch); None when nvidia-smi is not installed. Raises ConfigError when it is but fails: a GPU
    machine with a broken driver must not quietly serve on its CPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"cannot list GPUs: nvidia-smi -L failed: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ConfigError(f"cannot list GPUs: nvidia-smi -L exited {done.returncode}"
                          + (f": {why[0]}" if why else ""))
    return parse_gpu_list(done.stdout)


def parse_gpus(text: str, visible_env: str | None, inventory: tuple[Gpu, ...] | None) -> tuple[str | None, ...]:
    """--gpus -> one CUDA_VISIBLE_DEVICES value per device process (None: a CPU process).

    text: all | cpu | cpu:N | a comma list of GPU indices, GPU UUIDs (or unique prefixes) and
    MIG UUIDs. visible_env: this process's CUDA_VISIBLE_DEVICES (None: unset). inventory: the
    machine's GPUs (`discover_gpus`; None: unknown, no nvidia-smi).

    Indices count the GPUs visible under `visible_env`, as CUDA numbers them inside this process,
    so `--gpus 0,1` under CUDA_VISIBLE_DEVICES=2,3 is physical GPUs 2 and 3. Device order is PCI
    bus order (nvidia-smi's; the front sets CUDA_DEVICE_ORDER=PCI_BUS_ID for its devices). A GPU
    split into MIG instances gives one device process per instance. A whole GPU is passed on as
    its PCI-order index ("3", which labels it as nvidia-smi does), a MIG instance as its UUID.
    `all` with no GPU visible gives one CPU process (the caller warns).
    """
    text = text.strip()
    if text == "cpu":
        return (None,)
    if text.startswith("cpu:"):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"invalid --gpus {text!r}: cpu:N needs N >= 1")
        return (None,) * int(count)
    visible = _visible(visible_env, inventory)
    if text == "all":
        return tuple(dict.fromkeys(device for gpu in visible for device in gpu.devices)) or (None,)
    entries = [part.strip() for part in text.split(",")]
    if not all(entries):
        raise ConfigError(f"invalid --gpus {text!r}: expected all, cpu, cpu:N or GPU indices / UUIDs like 0,2")
    devices = [device for entry in entries for device in _select(entry, visible, text)]
    if len(set(devices)) != len(devices):
        raise ConfigError(f"invalid --gpus {text!r}: a GPU is named twice")
    return tuple(devices)


@dataclass(frozen=True)
class _Visible:
    """A GPU (or one MIG instance) CUDA enumerates: its UUID or the raw id it was named by, and
    the CUDA_VISIBLE_DEVICES value of each device process it gives."""

    name: str
    devices: tuple[str, ...]


def _visible(visible_env: str | None, inventory: tuple[Gpu, ...] | None) -> list[_Visible]:
    """The GPUs visible under `visible_env`, in CUDA's numbering."""
    if visible_env is None:
        return [_whole(gpu) for gpu in inventory or ()]
    visible = []
    # CUDA stops at the first entry it cannot resolve (such as -1, or an index past the last GPU).
    for entry in (part.strip() for part in visible_env.split(",")):
        if inventory is None:  # nothing to resolve against: pass the operator's ids on as they are
            if not entry or entry.startswith("-"):
                break
            visible.append(_Visible(entry, (entry,)))
            continue
        found = _resolve(entry, inventory)
        if found is None:
            break
        visible.append(found)
    return visible


def _whole(gpu: Gpu) -> _Visible:
    return _Visible(gpu.uuid, gpu.migs or (str(gpu.index),))


def _resolve(entry: str, inventory: tuple[Gpu, ...]) -> _Visible | None:
    """A CUDA_VISIBLE_DEVICES entry (PCI-order index, GPU UUID or its prefix, MIG UUID), or None."""
    if entry.isdigit():
        return next((_whole(gpu) for gpu in inventory if gpu.index == int(entry)), None)
    if entry.startswith("MIG-"):
        return next((_Visible(mig, (mig,)) for gpu in inventory for mig in gpu.migs if mig.startswith(entry)), None)
    matches = [gpu for gpu in inventory if entry.startswith("GPU-") and gpu.uuid.startswith(entry)]
    return _whole(matches[0]) if len(matches) == 1 else None


def _select(entry: str, visible: list[_Visible], text: str) -> tuple[str, ...]:
    """The device values one --gpus entry names among the visible GPUs."""
    if entry.isdigit():
        if int(entry) < len(visible):
            return visible[int(entry)].devices
        seen = f"only {len(visible)} visible" if visible else "none is visible"
        raise ConfigError(f"--gpus {text}: there is no GPU {entry} ({seen})")
    if not entry.startswith(("GPU-", "MIG-")):
        raise ConfigError(f"invalid --gpus {text!r}: {entry!r} is neither a GPU index nor a GPU or MIG UUID")
    # A GPU UUID (or prefix, as CUDA accepts) names a visible GPU; a MIG UUID one of its instances.
    gpus = [v.devices for v in visible if v.name.startswith(entry)]
    migs = [(d,) for v in visible for d in v.devices if d.startswith(entry) and d.startswith("MIG-") and d != v.name]
    found = gpus + migs
    if len(found) != 1:
        why = "matches several" if found else "is not among the visible GPUs"
        raise ConfigError(f"--gpus {text}: {entry} {why}")
    return found[0]
