"""The node's configuration, as `cakemp run` builds it and the front consumes it."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from cakemp.errors import ConfigError
from cakemp.front.setup import SetupConfig
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
    metrics_address: tuple[str, int] | None = None  # (host, port) of /metrics, /healthz, /readyz; None: off
    log_format: str = "auto"
    log_level: str = "info"
    # Zero-config mode: `layers` and `model_dir` come from a master's setup (then empty here).
    setup: SetupConfig | None = None


def parse_gpus(text: str, cuda_devices: tuple[str, ...]) -> tuple[str | None, ...]:
    """--gpus all|cpu|cpu:N|0,2,… -> one CUDA_VISIBLE_DEVICES value per device (None: a CPU process).

    `all` takes every id in `cuda_devices`; with none it gives one CPU process (the caller warns).
    """
    text = text.strip()
    if text == "all":
        return cuda_devices or (None,)
    if text == "cpu":
        return (None,)
    if text.startswith("cpu:"):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"invalid --gpus {text!r}: cpu:N needs N >= 1")
        return (None,) * int(count)
    gpus = [part.strip() for part in text.split(",")]
    if not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise ConfigError(f"invalid --gpus {text!r}: expected all, cpu, cpu:N or distinct GPU indices like 0,2")
    return tuple(gpus)


def cuda_devices() -> tuple[str, ...]:
    """Ids of the CUDA devices this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi's list).

    Asked of the environment and nvidia-smi so that the front never imports torch.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA stops at the first invalid entry, such as -1.
        ids = []
        for part in (p.strip() for p in visible.split(",")):
            if not part or part.startswith("-"):
                break
            ids.append(part)
        return tuple(ids)
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU ")))
