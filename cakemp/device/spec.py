"""What a device process is told at start (pickled by the front, which never imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

from cakemp.device.scheduler import MAX_BATCH, PREFILL_CHUNK


@dataclass(frozen=True)
class DeviceSpec:
    """One device process: which layers it loads, how, and where it listens for the front.

    `gpu` is the CUDA_VISIBLE_DEVICES value the parent sets before start (None: a CPU process,
    which is then started with no GPU visible); inside the process that GPU is always cuda:0.
    """

    index: int
    gpu: str | None
    layers: tuple[str, ...]
    model_dir: str
    dtype: str  # f16 | bf16 | f32
    endpoint: str
    kv_budget_bytes: int | None = None
    max_context: int | None = None
    max_batch: int = MAX_BATCH  # requests run together in one step at most
    step_tokens: int = PREFILL_CHUNK  # prefill tokens per step (beyond the first chunk); the front's chunk size
    threads: int | None = None  # torch intra-op threads (None: torch's default, one per core)
    log_format: str = "auto"
    log_level: str = "info"

    @property
    def label(self) -> str:
        """How logs and errors name this device: "cuda:2" (the physical GPU) or "cpu:1"."""
        return f"cuda:{self.gpu}" if self.gpu is not None else f"cpu:{self.index}"
