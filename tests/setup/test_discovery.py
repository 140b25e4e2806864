"""What the discovery reply says about this machine's devices, read from nvidia-smi's output (no GPU needed)."""

from __future__ import annotations

from cakemp.setup.discovery import nvidia_smi_line
from cakemp.wire.discovery import GpuInfo


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
