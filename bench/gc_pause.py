"""Garbage-collector pauses: a full collection over what a serving process has loaded, before and
after `heap.freeze_loaded`.

    python -m bench.gc_pause [--layers 16] [--repeats 5]

In fresh interpreters, one per kind of process (each loads what that process loads, then collects):

* device: `BlockRunner.load` over --layers layers of a random Llama checkpoint (TinyLlama's layer
  shape, f32), with the device process's modules imported;
* front: the modules `cakemp run` imports.

Printed per process: the objects the collector tracks once loaded, and the time of a full collection
(`gc.collect()`, median of --repeats), before and after they are frozen. A full collection stalls everything
its process does meanwhile: each session's step on a device, each relay in the front.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

from bench.pool import machine_line

_PROBE = """
import gc, statistics, sys, time
from cakemp import heap
if sys.argv[1] == "device":
    import torch
    import cakemp.device.process, cakemp.device.service
    from cakemp.compute.runner import BlockRunner
    layers = int(sys.argv[3])
    runner = BlockRunner.load(sys.argv[2], [f"model.layers.{i}" for i in range(layers)], "cpu", torch.float32)
else:
    import cakemp.cli, cakemp.front.server

def pause_ms():
    times = []
    for _ in range(int(sys.argv[4])):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

tracked, unfrozen = len(gc.get_objects()), pause_ms()
heap.freeze_loaded()
print(tracked, unfrozen, pause_ms())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    from tests.support.checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(tmp, "llama", num_hidden_layers=args.layers, vocab_size=64, hidden_size=2048,
                                intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4)
        print("| process | objects tracked | full collection | once frozen |")
        print("|---|---:|---:|---:|")
        for kind in ("device", "front"):
            out = subprocess.run([sys.executable, "-c", _PROBE, kind, str(model), str(args.layers), str(args.repeats)],
                                 capture_output=True, text=True, check=True).stdout.split()
            tracked, unfrozen, frozen = int(out[0]), float(out[1]), float(out[2])
            name = f"device ({args.layers} layers)" if kind == "device" else "front"
            print(f"| {name} | {tracked:,} | {unfrozen:.2f} ms | {frozen:.2f} ms |")


if __name__ == "__main__":
    main()
