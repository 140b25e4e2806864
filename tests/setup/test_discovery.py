"""What a zero-config node's discovery reply says about its devices: on a CPU, and live on a GPU
split into MIG instances (nvidia-smi stood in for by tests/support/nvidia_smi.py; no GPU needed); how
often one source is answered."""

from __future__ import annotations

import os
import socket

from cakemp.setup.discovery import ReplyLimit, announcement_for
from cakemp.wire.discovery import cluster_hash, decode_announcement, encode_probe
from tests.support.node import ZeroConfigNode
from tests.support.nvidia_smi import fake_nvidia_smi

# What nvidia-smi prints on a machine whose one GPU is split into two MIG instances: `-L` lists
# the instances under their GPU; `--query-gpu` knows only the physical GPU (its whole memory).
MIG_LISTING = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16)
  MIG 3g.40gb     Device  0: (UUID: MIG-feb88891-0321-5fef-9c87-d4af3b54259e)
  MIG 3g.40gb     Device  1: (UUID: MIG-a25704ba-3a06-5299-a795-fd7cf4d13973)
"""
MIG_QUERY = "0, GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16, 81559, 1980, NVIDIA H100 80GB HBM3\n"


def test_a_cpu_node_advertises_one_cpu_entry():
    """CPU device processes only: backend CPU and Cake's one "CPU (<arch>)" entry, with 2 TFLOPS."""
    announcement = announcement_for("h", "worker", 10128, (None, None))
    assert announcement.backend == "CPU"
    (device,) = announcement.gpus
    assert device.is_cpu and device.name.startswith("CPU (") and device.vram_bytes > 0 and device.tflops == 2.0


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


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_source_is_answered_a_few_times_per_window_and_a_window_bounds_the_sources():
    clock = Clock()
    limit = ReplyLimit(per_source=4, window_s=1.0, max_sources=3, clock=clock)
    assert [limit.allows("10.0.0.1") for _ in range(6)] == [True] * 4 + [False] * 2
    assert limit.allows("10.0.0.2") and limit.allows("10.0.0.3")  # another source has its own count
    assert not limit.allows("10.0.0.4")  # three sources this window already
    assert limit.allows("10.0.0.2")  # one already answered still is, up to its count
    clock.now += 0.999
    assert not limit.allows("10.0.0.1")
    clock.now += 0.001  # the next window: every count starts again
    assert [limit.allows("10.0.0.1") for _ in range(5)] == [True] * 4 + [False]
    assert limit.allows("10.0.0.4")
