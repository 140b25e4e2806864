"""What the front tells each device process it spawns."""

from __future__ import annotations

from cakemp.front import NodeConfig
from cakemp.front.devices import GPU_DEVICE_THREADS, device_specs
from cakemp.topology import place_layers


def test_gpu_device_processes_get_few_torch_threads_and_cpu_ones_share_the_cores():
    """A GPU process runs GPU_DEVICE_THREADS torch threads (its CPU work is host copies), not one
    per core; CPU processes get --cpu-threads; each GPU process gets its CUDA_VISIBLE_DEVICES value."""
    layers = tuple(f"model.layers.{i}" for i in range(4))
    config = NodeConfig(name="w", checkpoint_path="/m", parts=layers, devices=("3", "MIG-5c4b3a29", None, None),
                        cpu_threads=5)
    specs = device_specs(config, place_layers(layers, 4), "/run/cakemp")
    assert [(spec.gpu, spec.threads) for spec in specs] == [
        ("3", GPU_DEVICE_THREADS), ("MIG-5c4b3a29", GPU_DEVICE_THREADS), (None, 5), (None, 5)]
    assert [spec.label for spec in specs] == ["cuda:3", "cuda:MIG-5c4b3a29", "cpu:2", "cpu:3"]


def test_each_device_is_told_the_node_knobs_under_the_same_names():
    """Its layers, endpoint, dtype, batching and budget knobs; it reports progress well inside the
    request timeout (a quarter of it), which counts a silent device as hung."""
    config = NodeConfig(name="w", checkpoint_path="/m", parts=("a", "b", "c"), devices=(None, None), dtype="bf16",
                        kv_budget_bytes=1 << 20, max_context=99, max_batch=3, prefill_chunk=7, request_timeout=8.0,
                        cuda_graphs=False, log_format="json", log_level="debug")
    first, second = device_specs(config, place_layers(config.parts, 2), "/run/cakemp")
    assert (first.parts, second.parts) == (("a", "b"), ("c",))
    assert (first.index, first.endpoint, second.endpoint) == (0, "ipc:///run/cakemp/device-0", "ipc:///run/cakemp/device-1")
    assert (first.checkpoint_path, first.dtype, first.kv_budget_bytes, first.max_context) == ("/m", "bf16", 1 << 20, 99)
    assert (first.max_batch, first.prefill_chunk, first.progress_s, first.cuda_graphs) == (3, 7, 2.0, False)
    assert (first.log_format, first.log_level) == ("json", "debug")
