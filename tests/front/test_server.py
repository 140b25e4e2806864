"""What the front tells each device process it spawns."""

from __future__ import annotations

from cakemp.device import process as device_process
from cakemp.front import Front, NodeConfig
from cakemp.front.server import GPU_DEVICE_THREADS


def test_gpu_device_processes_get_few_torch_threads_and_cpu_ones_share_the_cores():
    """A GPU process runs GPU_DEVICE_THREADS torch threads (its CPU work is host copies), not one
    per core; CPU processes get --cpu-threads; each GPU process gets its CUDA_VISIBLE_DEVICES value."""
    layers = tuple(f"model.layers.{i}" for i in range(4))
    config = NodeConfig(name="w", model_dir="/m", layers=layers, devices=("3", "MIG-5c4b3a29", None, None),
                        cpu_threads=5)
    specs = Front(config, device_process.main)._device_specs()
    assert [(spec.gpu, spec.threads) for spec in specs] == [
        ("3", GPU_DEVICE_THREADS), ("MIG-5c4b3a29", GPU_DEVICE_THREADS), (None, 5), (None, 5)]
    assert [spec.label for spec in specs] == ["cuda:3", "cuda:MIG-5c4b3a29", "cpu:2", "cpu:3"]
