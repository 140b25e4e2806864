"""What the discovery reply says about this machine's devices, read from nvidia-smi's output (no GPU needed)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from cakemp.setup.discovery import nvidia_smi_line
from cakemp.wire.discovery import GpuInfo, cluster_hash, decode_announcement, encode_probe
from tests.front.node import ZeroConfigNode


def test_an_nvidia_smi_line_gives_cakes_tflops_estimate():
    """VRAM GB x max clock GHz x 1.5, as Cake estimates it; index and UUID both name the GPU."""
    keys, gpu = nvidia_smi_line("0, GPU-1a2b, 143771, 1980, NVIDIA H200")
    assert keys == {"0", "GPU-1a2b"}
    assert gpu == GpuInfo("NVIDIA H200", 143771 << 20, round(143771 / 1024 * 1.98 * 1.5, 2))


def test_a_name_with_a_comma_and_an_unreported_clock():
    _, gpu = nvidia_smi_line("1, GPU-ff, 24576, [N/A], Tesla, custom")
    assert gpu == GpuInfo("Tesla, custom", 24576 << 20, round(24.0 * 1.5 * 1.5, 2))


def test_a_line_that_is_not_a_gpu_is_skipped():
    assert nvidia_smi_line("No devices were found") == (set(), None)


# --------------------------------------------------------------------------- a MIG node's reply, live

# What nvidia-smi prints on a machine whose one GPU is split into two MIG instances: `-L` lists
# the instances under their GPU; `--query-gpu` knows only the physical GPU (its whole memory).
MIG_LISTING = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16)
  MIG 3g.40gb     Device  0: (UUID: MIG-feb88891-0321-5fef-9c87-d4af3b54259e)
  MIG 3g.40gb     Device  1: (UUID: MIG-a25704ba-3a06-5299-a795-fd7cf4d13973)
"""
MIG_QUERY = "0, GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16, 81559, 1980, NVIDIA H100 80GB HBM3\n"


def fake_nvidia_smi(bin_dir: Path, listing: str, query: str) -> Path:
    """A stand-in for the driver's tool in `bin_dir`: `-L` prints `listing`, `--query-gpu=...` prints `query`."""
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in\n-L) cat <<'EOF'\n{listing}EOF\n;;\n"
                   f"--query-gpu=*) cat <<'EOF'\n{query}EOF\n;;\n*) exit 2;;\nesac\n")
    smi.chmod(0o755)
    return bin_dir


def test_a_node_whose_gpus_are_all_mig_instances_advertises_them_as_cuda_devices(tmp_path, monkeypatch):
    """`--gpus all` on a GPU split into two MIG instances serves one device per instance, and the
    discovery reply says so: backend CUDA, one entry per instance with the instance's memory (its
    profile's 40 GB), never a CPU entry."""
    bin_dir = fake_nvidia_smi(tmp_path / "bin", MIG_LISTING, MIG_QUERY)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    node = ZeroConfigNode(tmp_path / "home", 2, "--gpus", "all")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(30)
            sock.sendto(encode_probe(cluster_hash(ZeroConfigNode.KEY)), ("127.0.0.1", node.discovery_port))
            reply = decode_announcement(sock.recv(65536))
    finally:
        assert node.stop() == 0
    assert reply.backend == "CUDA"
    assert [(gpu.name, gpu.vram_bytes) for gpu in reply.gpus] == [("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * 10**9)] * 2
    assert all(gpu.tflops > 0 for gpu in reply.gpus)
