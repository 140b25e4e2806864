"""--gpus and --address parsing, and CUDA device discovery without torch."""

from __future__ import annotations

import pytest

from cakemp.errors import ConfigError
from cakemp.address import parse_address
from cakemp.front.config import cuda_devices, parse_gpus


@pytest.mark.parametrize("text, cuda, expected", [
    ("cpu", ("0", "1"), (None,)),
    ("cpu:3", (), (None, None, None)),
    ("all", ("0", "1"), ("0", "1")),
    ("all", (), (None,)),
    ("0,2", (), ("0", "2")),
    (" 1 ", (), ("1",)),
])
def test_gpus_give_one_visible_device_per_process(text, cuda, expected):
    """Each device process gets one CUDA_VISIBLE_DEVICES value, or None for a CPU process."""
    assert parse_gpus(text, cuda) == expected


@pytest.mark.parametrize("text", ["cpu:0", "cpu:x", "tpu", "0,0", "0,-1", ""])
def test_bad_gpus_are_config_errors(text):
    """Zero CPU processes, repeated or non-numeric GPU ids are refused."""
    with pytest.raises(ConfigError):
        parse_gpus(text, ("0",))


def test_cuda_devices_follow_cuda_visible_devices(monkeypatch):
    """CUDA_VISIBLE_DEVICES, when set, lists the usable GPUs up to its first invalid entry."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,-1,2")
    assert cuda_devices() == ("3", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_devices() == ()


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
