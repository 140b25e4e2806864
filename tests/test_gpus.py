"""The GPU inventory from nvidia-smi (no torch, no GPU): `--gpus` selections against `nvidia-smi -L`,
and the devices a discovery reply describes, from a stand-in nvidia-smi on PATH (tests/support/nvidia_smi.py)."""

from __future__ import annotations

import os
import re

import pytest

from cakemp import gpus
from cakemp.errors import ConfigError
from cakemp.gpus import parse_gpu_list, parse_gpus
from cakemp.wire.discovery import GpuInfo
from tests.support.nvidia_smi import fake_nvidia_smi

# What `nvidia-smi -L` prints on a machine with two whole GPUs and a third split into two MIG instances.
NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b2c3d-0000-1111-2222-333344445555)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1bffff-6666-7777-8888-999900001111)
GPU 2: NVIDIA A100-SXM4-40GB (UUID: GPU-77e0c1d2-aaaa-bbbb-cccc-ddddeeeeffff)
  MIG 3g.20gb     Device  0: (UUID: MIG-5c4b3a29-1111-2222-3333-444455556666)
  MIG 3g.20gb     Device  1: (UUID: MIG-9d8e7f60-7777-8888-9999-000011112222)
"""
INVENTORY = parse_gpu_list(NVIDIA_SMI_L)
MIG_0, MIG_1 = (mig.uuid for mig in INVENTORY[2].migs)


def test_nvidia_smi_listing_gives_gpus_in_order_with_their_mig_instances():
    """Each GPU line is a GPU; the MIG lines under it are its instances, with their profiles."""
    assert [(g.index, g.uuid[:12], len(g.migs)) for g in INVENTORY] == [
        (0, "GPU-0a1b2c3d", 0), (1, "GPU-0a1bffff", 0), (2, "GPU-77e0c1d2", 2)]
    assert MIG_0.startswith("MIG-5c4b3a29") and MIG_1.startswith("MIG-9d8e7f60")
    assert [mig.profile for mig in INVENTORY[2].migs] == ["3g.20gb", "3g.20gb"]


@pytest.mark.parametrize("text, env, expected", [
    ("cpu", None, (None,)),
    ("cpu:3", None, (None, None, None)),
    ("all", None, ("0", "1", MIG_0, MIG_1)),
    ("0,1", None, ("0", "1")),
    (" 1 ", None, ("1",)),
    # Indices count the visible GPUs, as CUDA numbers them under the operator's CUDA_VISIBLE_DEVICES.
    ("0,1", "2,1", (MIG_0, MIG_1, "1")),
    ("1", "1,0", ("0",)),
    ("all", "1", ("1",)),
    ("all", "", (None,)),
    ("all", "1,-1,0", ("1",)),
    ("all", "1,7,0", ("1",)),
    # UUIDs (whole or a unique prefix, as CUDA takes them) and MIG instances.
    ("GPU-0a1bffff", None, ("1",)),
    ("GPU-0a1b2c3d-0000-1111-2222-333344445555,0a", None, None),
    (f"{MIG_1},0", None, (MIG_1, "0")),
    ("all", f"GPU-77e0c1d2,{MIG_0}", (MIG_0, MIG_1)),
    ("all", f"{MIG_1}", (MIG_1,)),
    ("0", "GPU-0a1bffff", ("1",)),
])
def test_gpus_map_to_one_visible_device_per_process(text, env, expected):
    """Each device process gets the CUDA_VISIBLE_DEVICES value of one GPU or MIG instance, or None for a CPU."""
    if expected is None:
        with pytest.raises(ConfigError):
            parse_gpus(text, env, INVENTORY)
    else:
        assert parse_gpus(text, env, INVENTORY) == expected


@pytest.mark.parametrize("text, env, words", [
    ("7", None, "there is no GPU 7 (only 3 visible)"),
    ("2", "1,0", "there is no GPU 2 (only 2 visible)"),
    ("0", "", "there is no GPU 0 (none is visible)"),
    ("GPU-0a1b", None, "GPU-0a1b matches several"),
    ("GPU-0a1bffff", "0", "GPU-0a1bffff is not among the visible GPUs"),
    ("0,0", None, "named twice"),
    ("1,GPU-0a1bffff", None, "named twice"),
    ("cpu:0", None, "cpu:N"), ("cpu:x", None, "cpu:N"),
    ("tpu", None, "'tpu'"), ("0,-1", None, "'-1'"), ("", None, "expected all"), ("0,", None, "expected all"),
])
def test_bad_gpus_are_config_errors_that_say_why(text, env, words):
    """Missing, ambiguous, repeated or malformed GPU selections are refused by name."""
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_gpus(text, env, INVENTORY)


@pytest.mark.parametrize("text, env, expected", [
    ("all", None, (None,)),
    ("all", "3,1,-1,2", ("3", "1")),
    ("1", "3,GPU-x", ("GPU-x",)),
    ("GPU-x", "3,GPU-x", ("GPU-x",)),
])
def test_without_nvidia_smi_the_visible_ids_pass_through(text, env, expected):
    """With no inventory, CUDA_VISIBLE_DEVICES's own ids are what indices and UUIDs select."""
    assert parse_gpus(text, env, None) == expected


# `--query-gpu` on the machine of NVIDIA_SMI_L: the physical GPUs only; the A100's clock unreported.
QUERY = """\
0, GPU-0a1b2c3d-0000-1111-2222-333344445555, 81559, 1980, NVIDIA H100 80GB HBM3
1, GPU-0a1bffff-6666-7777-8888-999900001111, 81559, 1980, NVIDIA H100 80GB HBM3
2, GPU-77e0c1d2-aaaa-bbbb-cccc-ddddeeeeffff, 40960, [N/A], NVIDIA A100-SXM4-40GB
"""
GIB = 1 << 30


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """Puts an nvidia-smi printing the given listings (tests/support/nvidia_smi.py) first on PATH."""
    def install(listing: str = NVIDIA_SMI_L, query: str = QUERY, **statuses: int) -> None:
        bin_dir = fake_nvidia_smi(tmp_path / "bin", listing, query, **statuses)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return install


def test_whole_gpus_and_mig_instances_are_described_with_cakes_tflops_estimate(nvidia_smi):
    """Each device `--gpus all` gives: a whole GPU with its memory and memory GiB x max clock GHz x 1.5;
    a MIG instance with its profile's memory, its GPU's name and clock (1.5 GHz where unreported)."""
    nvidia_smi()
    h100 = GpuInfo("NVIDIA H100 80GB HBM3", 81559 << 20, round(81559 / 1024 * 1.98 * 1.5, 2))
    mig = GpuInfo("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20 * 10**9, round(20 * 10**9 / GIB * 1.5 * 1.5, 2))
    assert gpus.describe(gpus.select_devices("all")) == (h100, h100, mig, mig)
    assert not any(device.is_cpu for device in gpus.describe(gpus.select_devices("all")))


def test_a_device_nvidia_smi_does_not_list_is_left_out(nvidia_smi):
    """Only the devices asked for, in their order; one CPU entry when none of them is a listed GPU."""
    nvidia_smi()
    assert [device.name for device in gpus.describe(("1", None, "7"))] == ["NVIDIA H100 80GB HBM3"]
    (cpu,) = gpus.describe(("7",))
    assert cpu.is_cpu


def test_a_profile_that_names_no_memory_gets_its_gpus_share(nvidia_smi):
    """A MIG profile not of the NgXXgb form: the instance is given an even share of its GPU's memory."""
    nvidia_smi(NVIDIA_SMI_L.replace("3g.20gb", "custom"))
    assert [device.vram_bytes for device in gpus.describe((MIG_0, MIG_1))] == [(40960 << 20) // 2] * 2


def test_cpu_devices_and_a_machine_without_nvidia_smi_are_one_cpu_entry(tmp_path, monkeypatch):
    """CPU processes, or GPU ids where nvidia-smi is not installed: Cake's one CPU entry."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    assert gpus.list_gpus() is None
    for devices in ((None,), ("0", "1")):
        (cpu,) = gpus.describe(devices)
        assert cpu == gpus.cpu_device() and cpu.is_cpu and cpu.tflops == 2.0 and cpu.vram_bytes > 0


def test_an_nvidia_smi_that_fails_is_a_config_error_for_gpus_and_discovery_alike(nvidia_smi):
    """A broken driver is never taken for a CPU machine: `--gpus` and the discovery reply both refuse, naming the failure."""
    nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", listing_status=9)
    for read in (lambda: gpus.select_devices("all"), lambda: gpus.describe(("0",))):
        with pytest.raises(ConfigError, match=re.escape("cannot list GPUs: nvidia-smi -L exited 9: NVIDIA-SMI has failed")):
            read()


def test_a_failing_gpu_query_is_a_config_error(nvidia_smi):
    """The listing works but the query does not: the discovery reply is refused, not a CPU entry."""
    nvidia_smi(query="Unable to determine the device handle for GPU 0000:41:00.0: Unknown Error\n", query_status=15)
    with pytest.raises(ConfigError, match=r"cannot list GPUs: nvidia-smi --query-gpu=\S+ --format=\S+ exited 15: Unable"):
        gpus.describe(("0",))


def test_query_lines_name_the_gpu_by_index_and_uuid():
    """A name may hold a comma (it goes last); an unreported clock or memory is not a number."""
    ids, details = gpus.parse_query_line("1, GPU-ff, 24576, [N/A], Tesla, custom")
    assert ids == {"1", "GPU-ff"} and details == gpus.Details("Tesla, custom", 24576, 1.5)
    assert gpus.parse_query_line("0, GPU-ee, [N/A], 1980, X")[1].memory_mib is None
    assert gpus.parse_query_line("No devices were found") == (set(), None)
