"""The project's systemd unit and example env file: systemd-analyze's verdict and the settings the node relies on."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cakemp.errors import ConfigError
from cakemp.front.config import check_cluster_key
from tests.deploy.flags import run_variables

UNIT = Path(__file__).parents[2] / "deploy" / "systemd" / "cakemp@.service"
EXAMPLE_ENV = Path(__file__).parents[2] / "deploy" / "systemd" / "example.env"


def settings(text: str) -> dict[str, list[str]]:
    """`Key=value` lines of a unit or env file, every value of a repeated key kept in order."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    """systemd-analyze verify accepts the unit with no error and no warning (ExecStart pointed at a real binary)."""
    unit = UNIT.read_text()
    # verify checks that ExecStart's binary exists; the install path is the one thing that
    # varies per machine, so it is pointed at a binary this machine has.
    assert "ExecStart=/opt/cakemp/bin/cakemp run\n" in unit
    copy = tmp_path / "cakemp@.service"
    copy.write_text(unit.replace("/opt/cakemp/bin/cakemp", shutil.which("true")))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "" and result.stdout.strip() == ""


def test_unit_settings_the_node_relies_on():
    """The unit is a notify service that signals only the front, restarts on failure but not on exit 78."""
    unit = settings(UNIT.read_text())
    expected = {
        "Type": ["notify"],
        "NotifyAccess": ["main"],
        "KillMode": ["mixed"],
        "Restart": ["on-failure"],
        "RestartPreventExitStatus": ["78"],
        "RuntimeDirectory": ["cakemp-%i"],
        "EnvironmentFile": ["/etc/cakemp/%i.env"],
        "RestrictAddressFamilies": ["AF_UNIX AF_INET AF_INET6"],
    }
    assert {key: unit.get(key) for key in expected} == expected
    assert "WatchdogSec" in unit
    assert "PrivateDevices" not in unit


def test_unit_bounds_the_node_memory_and_system_calls():
    """The node cannot take the host's memory (MemoryHigh below MemoryMax, both below all of it), makes
    only ordinary services' system calls (others fail with EPERM rather than killing a device), and
    sees no other users' processes."""
    unit = settings(UNIT.read_text())
    high, most = (int(unit[key][0].rstrip("%")) for key in ("MemoryHigh", "MemoryMax"))
    assert high < most < 100
    assert unit["SystemCallFilter"] == ["@system-service"] and unit["SystemCallErrorNumber"] == ["EPERM"]
    assert unit["ProtectProc"] == ["invisible"]


def test_unit_reaches_the_gpus_and_survives_a_device_oom():
    """Device access is closed except the NVIDIA groups of current drivers (545 and later: nvidia,
    nvidiactl) and older ones (nvidia-frontend), with unified memory and MIG capabilities; an OOM
    kill leaves the node running; CUDA numbers GPUs in PCI bus order, as nvidia-smi does."""
    unit = settings(UNIT.read_text())
    assert unit["DevicePolicy"] == ["closed"]
    assert set(unit["DeviceAllow"]) == {
        "char-nvidia rw", "char-nvidiactl rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps r",
    }
    assert unit["OOMPolicy"] == ["continue"]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in unit["Environment"]


def test_under_the_unit_triton_compiles_the_fp8_kernel_though_the_account_has_no_home(tmp_path):
    """The account has no home (docs/deploy.md), where Triton keeps what it compiles by default: with the
    unit's environment (its cache directory, %C/cakemp-%i, a fresh one here) the FP8 kernel compiles for a
    GPU and Triton's cache is inside that directory; without the unit's TRITON_CACHE_DIR it does not."""
    pytest.importorskip("triton")
    from tests.support.triton_compile import compile_kernels, require_nvidia_backend

    require_nvidia_backend()
    cache = tmp_path / "cache"  # systemd makes it, the account's own
    cache.mkdir()
    unit = dict(value.split("=", 1) for value in settings(UNIT.read_text())["Environment"])
    unit = {key: value.replace("%C", str(tmp_path)).replace("cakemp-%i", "cache") for key, value in unit.items()}
    base = {key: value for key, value in os.environ.items() if not key.startswith("TRITON_") and key != "HOME"}
    base["HOME"] = "/dev/null/home"  # no home: nothing can be made there
    assert compile_kernels(["fp8:1:bf16"], base | unit) == ""
    assert Path(unit["TRITON_CACHE_DIR"]).is_relative_to(cache) and any(Path(unit["TRITON_CACHE_DIR"]).iterdir())
    without = {key: value for key, value in (base | unit).items() if key != "TRITON_CACHE_DIR"}
    assert compile_kernels(["fp8:1:bf16"], without).startswith("fp8:1:bf16 ")  # it names the case that failed


def test_stop_timeout_leaves_room_for_the_drain():
    """TimeoutStopSec is above the example drain deadline, so a drain is never cut short by SIGKILL."""
    stop_timeout = int(settings(UNIT.read_text())["TimeoutStopSec"][0])
    drain = int(settings(EXAMPLE_ENV.read_text())["CAKEMP_DRAIN_TIMEOUT"][0])
    assert stop_timeout > drain


def test_example_env_names_only_known_settings():
    """Every variable the example env file sets, or shows commented out, is one `cakemp run` reads a flag from."""
    text = EXAMPLE_ENV.read_text()
    variables = set(settings(text)) | set(re.findall(r"^#(CAKEMP_\w+)=", text, re.MULTILINE))
    assert variables <= run_variables()
    assert {"CAKE_CLUSTER_KEY", "CAKEMP_MODEL", "CAKEMP_DRAIN_TIMEOUT", "CAKEMP_REQUEST_TIMEOUT"} <= variables


def test_the_example_key_is_a_placeholder_the_node_refuses_as_it_is():
    """The env file's key says how to make one, and a node given it unchanged exits 78 saying so."""
    text = EXAMPLE_ENV.read_text()
    (key,) = settings(text)["CAKE_CLUSTER_KEY"]
    assert "openssl-rand-hex-32" in key and "`openssl rand -hex 32`" in text
    with pytest.raises(ConfigError, match="openssl rand -hex 32"):
        check_cluster_key(key)
