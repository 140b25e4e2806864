"""--gpus and --address parsing, and GPU discovery from nvidia-smi's listing (no torch)."""

from __future__ import annotations

import re

import pytest

from cakemp.errors import ConfigError
from cakemp.address import parse_address
from cakemp.front.config import device_environment, parse_gpu_list, parse_gpus


# What `nvidia-smi -L` prints on a machine with two whole GPUs and a third split into two MIG instances.
NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b2c3d-0000-1111-2222-333344445555)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1bffff-6666-7777-8888-999900001111)
GPU 2: NVIDIA A100-SXM4-40GB (UUID: GPU-77e0c1d2-aaaa-bbbb-cccc-ddddeeeeffff)
  MIG 3g.20gb     Device  0: (UUID: MIG-5c4b3a29-1111-2222-3333-444455556666)
  MIG 3g.20gb     Device  1: (UUID: MIG-9d8e7f60-7777-8888-9999-000011112222)
"""
INVENTORY = parse_gpu_list(NVIDIA_SMI_L)
MIG_0, MIG_1 = INVENTORY[2].migs


def test_nvidia_smi_listing_gives_gpus_in_order_with_their_mig_instances():
    """Each GPU line is a GPU; the MIG lines under it are its instances."""
    assert [(g.index, g.uuid[:12], len(g.migs)) for g in INVENTORY] == [
        (0, "GPU-0a1b2c3d", 0), (1, "GPU-0a1bffff", 0), (2, "GPU-77e0c1d2", 2)]
    assert MIG_0.startswith("MIG-5c4b3a29") and MIG_1.startswith("MIG-9d8e7f60")


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


@pytest.mark.parametrize("text, expected", [
    ("0.0.0.0:10128", ("0.0.0.0", 10128)),
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("[::1]:9000", ("::1", 9000)),
    (":10128", ("0.0.0.0", 10128)),
])
def test_addresses_split_into_host_and_port(text, expected):
    """host:port, with IPv6 hosts in brackets, as Cake's --address."""
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["10128", "host:", "host:port", "host:70000"])
def test_bad_addresses_are_config_errors(text):
    """An address without a valid port is refused."""
    with pytest.raises(ConfigError):
        parse_address(text)


def test_device_processes_number_gpus_in_pci_order_and_get_expandable_segments():
    """The front gives its devices PCI bus order, and torch's expandable segments unless the operator chose."""
    assert device_environment({}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for operators in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert device_environment({operators: "max_split_size_mb:512"}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
