"""This machine's GPUs as nvidia-smi lists them (never torch: the front must not import it), for
`--gpus` and for what a node advertises to a discovering master (and a master counts as its own).

One reader and one failure policy: where nvidia-smi is not installed no GPU is known (None);
where it is installed but fails, that is a ConfigError: a GPU machine with a broken driver must
neither serve nor advertise itself as a CPU.

Two listings are read. `nvidia-smi -L` names each GPU (its PCI-order index and UUID) and the
MIG instances it is split into; `--query-gpu` gives each physical GPU's name, memory and clock,
and knows nothing of MIG instances. A device is described as Cake does: its name, its memory,
and TFLOPS estimated as memory GiB × max clock GHz × 1.5; a MIG instance with the memory its
profile names (3g.40gb: 40 GB). Without a GPU it is one CPU entry, as Cake's: the system's
memory and 2 TFLOPS.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from cakemp.errors import ConfigError
from cakemp.wire.discovery import GpuInfo

CPU_TFLOPS = 2.0  # Cake's figure for a CPU device
_CLOCK_GHZ_UNKNOWN = 1.5  # Cake's when nvidia-smi reports no max clock ("[N/A]")
_QUERY = "--query-gpu=index,uuid,memory.total,clocks.max.graphics,name"


@dataclass(frozen=True)
class Mig:
    """One MIG instance: its UUID (what CUDA_VISIBLE_DEVICES takes) and its profile, like 3g.40gb."""

    uuid: str
    profile: str


@dataclass(frozen=True)
class Gpu:
    """One GPU as `nvidia-smi -L` lists it: its index in PCI bus order, its UUID, and its MIG
    instances (empty when MIG is off)."""

    index: int
    uuid: str
    migs: tuple[Mig, ...] = ()


_GPU_LINE = re.compile(r"^GPU (\d+): .*\(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s.*\(UUID: (MIG-[^)\s]+)\)")
# Whole gigabytes in a profile's name (1g.10gb, 3g.40gb, 1g.10gb+me). Read as decimal GB they
# are a little less than what the instance holds (1g.10gb has 9.5 GiB), never more.
_PROFILE_GB = re.compile(r"^\d+g\.(\d+)gb")


def parse_gpu_list(text: str) -> tuple[Gpu, ...]:
    """The GPUs in `nvidia-smi -L` output, each with the MIG instances listed under it."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        if match := _GPU_LINE.match(line):
            gpus.append(Gpu(int(match[1]), match[2]))
        elif (match := _MIG_LINE.match(line)) and gpus:
            gpu = gpus[-1]
            gpus[-1] = Gpu(gpu.index, gpu.uuid, (*gpu.migs, Mig(match[2], match[1])))
    return tuple(gpus)


def list_gpus() -> tuple[Gpu, ...] | None:
    """The machine's GPUs from `nvidia-smi -L`; None when nvidia-smi is not installed."""
    text = _nvidia_smi("-L")
    return None if text is None else parse_gpu_list(text)


def _nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output for `args`; None when it is not installed, ConfigError when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    command = " ".join(["nvidia-smi", *args])
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"cannot list GPUs: {command} failed: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ConfigError(f"cannot list GPUs: {command} exited {done.returncode}" + (f": {why[0]}" if why else ""))
    return done.stdout


def select_devices(text: str) -> tuple[str | None, ...]:
    """--gpus `text` on this machine: `parse_gpus` under this process's CUDA_VISIBLE_DEVICES, against
    nvidia-smi's listing (read only when `text` names GPUs)."""
    inventory = None if text.strip().startswith("cpu") else list_gpus()
    return parse_gpus(text, os.environ.get("CUDA_VISIBLE_DEVICES"), inventory)


def parse_gpus(text: str, visible_env: str | None, inventory: tuple[Gpu, ...] | None) -> tuple[str | None, ...]:
    """--gpus -> one CUDA_VISIBLE_DEVICES value per device process (None: a CPU process).

    text: all | cpu | cpu:N | a comma list of GPU indices, GPU UUIDs (or unique prefixes) and
    MIG UUIDs. visible_env: this process's CUDA_VISIBLE_DEVICES (None: unset). inventory: the
    machine's GPUs (`list_gpus`; None: unknown, no nvidia-smi).

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
    return _Visible(gpu.uuid, tuple(mig.uuid for mig in gpu.migs) or (str(gpu.index),))


def _resolve(entry: str, inventory: tuple[Gpu, ...]) -> _Visible | None:
    """A CUDA_VISIBLE_DEVICES entry (PCI-order index, GPU UUID or its prefix, MIG UUID), or None."""
    if entry.isdigit():
        return next((_whole(gpu) for gpu in inventory if gpu.index == int(entry)), None)
    if entry.startswith("MIG-"):
        return next((_Visible(mig.uuid, (mig.uuid,)) for gpu in inventory for mig in gpu.migs
                     if mig.uuid.startswith(entry)), None)
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


@dataclass(frozen=True)
class Details:
    """One physical GPU as `--query-gpu` reports it: its name, its memory (None: not reported), its max clock."""

    name: str
    memory_mib: int | None
    clock_ghz: float


def parse_query_line(line: str) -> tuple[set[str], Details | None]:
    """One line of the `--query-gpu` listing: the ids naming the GPU (index and UUID) and its details."""
    # The name goes last: it is the one field that may hold a comma.
    parts = [part.strip() for part in line.split(",", 4)]
    if len(parts) < 5 or not parts[0].isdigit():
        return set(), None
    index, uuid, memory, clock, name = parts
    try:
        clock_ghz = float(clock) / 1000
    except ValueError:
        clock_ghz = _CLOCK_GHZ_UNKNOWN
    return {index, uuid}, Details(name, int(memory) if memory.isdigit() else None, clock_ghz)


def describe(devices: Sequence[str | None]) -> tuple[GpuInfo, ...]:
    """The devices among `devices` (CUDA_VISIBLE_DEVICES values as `parse_gpus` gives them, None
    for a CPU process) as a discovery reply describes them: each GPU or MIG instance nvidia-smi
    lists; one CPU entry when none of them is one."""
    cuda = [device for device in devices if device is not None]
    inventory = list_gpus() if cuda else None
    if not inventory:
        return (cpu_device(),)
    details: dict[str, Details] = {}
    for line in (_nvidia_smi(_QUERY, "--format=csv,noheader,nounits") or "").splitlines():
        ids, found = parse_query_line(line)  # no ids where the line is no GPU
        details.update(dict.fromkeys(ids, found))
    described = [info for device in cuda if (info := _device_info(device, inventory, details)) is not None]
    return tuple(described) or (cpu_device(),)


def _device_info(device: str, inventory: Sequence[Gpu], details: dict[str, Details]) -> GpuInfo | None:
    """One GPU (by index or UUID) or MIG instance (by UUID), or None when nvidia-smi lists no such device."""
    if (whole := details.get(device)) is not None:
        return None if whole.memory_mib is None else _info(whole.name, whole.memory_mib << 20, whole.clock_ghz)
    for gpu in inventory:
        mig = next((mig for mig in gpu.migs if mig.uuid == device), None)
        if mig is not None and (parent := details.get(str(gpu.index))) is not None:
            return _info(f"{parent.name} MIG {mig.profile}", _mig_bytes(mig, gpu, parent), parent.clock_ghz)
    return None


def _mig_bytes(mig: Mig, gpu: Gpu, parent: Details) -> int:
    """The memory a MIG instance's profile names; for a profile that names none, its GPU's share."""
    if match := _PROFILE_GB.match(mig.profile):
        return int(match[1]) * 10**9
    return ((parent.memory_mib or 0) << 20) // len(gpu.migs)


def _info(name: str, memory_bytes: int, clock_ghz: float) -> GpuInfo:
    """A CUDA device with Cake's TFLOPS estimate (memory GiB × max clock GHz × 1.5)."""
    return GpuInfo(name, memory_bytes, round(memory_bytes / (1 << 30) * clock_ghz * 1.5, 2))


def cpu_device() -> GpuInfo:
    """This machine as one CPU device, as Cake advertises it: "CPU (<arch>)", the system's memory, 2 TFLOPS."""
    return GpuInfo(f"CPU ({platform.machine()})", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), CPU_TFLOPS)
