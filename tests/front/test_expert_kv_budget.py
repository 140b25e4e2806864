"""With --expert-offload on several CPU devices, each device's KV budget is its share of the memory
less its own expert cache: every device holds a cache of --expert-cache-mib (model/weights/experts.py:
one per device process), so N devices give up N caches, each its own one."""

from __future__ import annotations

from cakemp.front.devices import CPU_KV_SHARE, _cpu_kv_budget

DEVICES = 4


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) * 1024


def test_each_cpu_device_gives_up_its_own_expert_cache_of_its_kv_budget():
    share = mem_available() * CPU_KV_SHARE
    cache = int(share / (2 * DEVICES))  # the caches take half the share: a quarter of it is left to each device
    without = _cpu_kv_budget(DEVICES, 0)
    with_caches = _cpu_kv_budget(DEVICES, cache)
    # MemAvailable moves between the reads (other processes), by far less than a quarter of a cache.
    assert abs((without - with_caches) - cache) < cache / 4, (without, with_caches, cache)
    assert abs(with_caches - (share / DEVICES - cache)) < cache / 4
