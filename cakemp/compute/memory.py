"""What a GPU's memory allows: whether a device's layers fit, and what is left for KV caches.

Pure rules over byte counts (the device asks torch.cuda.mem_get_info for them), so that they
are tested without a GPU. A CPU device has neither rule: its layers fail like any allocation,
and its KV budget is what the front gives it (--kv-budget-mib, by default a share of the host's
memory: front/config.py).
"""

from __future__ import annotations

from cakemp.errors import ConfigError

GIB = 1 << 30


def check_fits(needed: int, free: int, where: str) -> None:
    """Raise ConfigError (exit 78: the configuration asks for too much, restarting cannot help)
    when loading `needed` bytes onto a device with `free` bytes free cannot succeed."""
    if needed > free:
        raise too_big(needed, free, where, "cannot load")


def too_big(needed: int, free: int, where: str, what: str) -> ConfigError:
    """The configuration error for layers that do not fit, naming the bytes needed and free."""
    return ConfigError(
        f"{what}: the layers need {needed} bytes ({needed / GIB:.2f} GiB) on {where} but {free} bytes "
        f"({free / GIB:.2f} GiB) were free; serve fewer layers per device, or use more devices"
    )


def headroom(total: int) -> int:
    """Bytes kept free beside the KV budget: activations of the largest request (a prefill's MLP
    intermediates, up to GiBs for a 512 MiB frame), cuBLAS workspaces and the context's growth."""
    return max(2 * GIB, total // 10)


def default_kv_budget(free: int, total: int, where: str) -> int:
    """The KV budget of a GPU device that was given none: what is free after loading, less the
    headroom. Without a budget the caches would grow until some allocation, any request's, fails."""
    budget = free - headroom(total)
    if budget <= 0:
        raise ConfigError(
            f"after loading, {free} bytes ({free / GIB:.2f} GiB) are free on {where}, less than the "
            f"{headroom(total) / GIB:.2f} GiB kept for activations: no room for KV caches; serve fewer "
            f"layers per device, or set --kv-budget-mib"
        )
    return budget
