"""Image components benchmark: the relay tax on a UNet step and a VAE decode, and two masters'
UNet steps batched against one after another.

    python -m bench.image [--steps 200] [--seconds 4] [--side 8] [--threads 1]

Writes tests/support/image.py's tiny SD 1.5 components (random weights, HF cache layout) and starts,
side by side in one run, each with --threads torch threads per device:

* `cakemp run --gpus cpu:1 --model-type image-model` serving unet and vae (batching on:
  `--max-batch 32`, the default);
* the same with `--max-batch 1` (each call computed alone, as Cake's worker does).

Part 1, the relay tax: one master's UNet step (latents [2, 4, side, side] with CFG, text
[2, 77, 32], a timestep) and VAE decode ([1, 4, side, side] to a 8·side image) through the
batching node, against the same call in this process on the same components
(ComponentRunner.run_batch on the packed tensor, the node's own compute path), alternating in
blocks of 20 (--steps each): µs per call, p50, and the difference.

Part 2, batching: two masters each sending UNet steps back to back for --seconds, on each node
in turn; aggregate steps/s, the batching node's mean requests per device step (its /metrics),
and the ratio batched / one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.batching import batch_size_totals
from bench.pool import alternate, free_port, wait_listening
from cakemp.checkpoint.image.locator import ImageFlags
from cakemp.checkpoint.image.sd_files import locate
from cakemp.compute.components import Call, ComponentRunner
from cakemp.master.client import WorkerClient
from tests.support.image import f32, pack, write_cache

BATCHED, ALONE = "cakemp batched", "cakemp --max-batch 1"


class _Files:
    def __init__(self, located):
        self.weights, self.config = str(located.weights), str(located.config)


def start_node(root: Path, threads: int, *extra: str) -> tuple[subprocess.Popen, int, int]:
    """An image node serving unet and vae on one CPU device; its process, port and metrics port."""
    topology = root / "topology.yml"
    topology.write_text(yaml.safe_dump({"w": {"host": "x:1", "layers": ["unet", "vae"]}}))
    port, metrics = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cakemp", "run", "--name", "w", "--model", str(root), "--topology", str(topology),
         "--model-type", "image-model", "--address", f"127.0.0.1:{port}", "--gpus", "cpu:1", "--dtype", "f32",
         "--cpu-threads", str(threads), "--metrics-address", f"127.0.0.1:{metrics}", "--log-level", "warning",
         *extra], stdout=subprocess.DEVNULL)
    wait_listening(port, process)
    return process, port, metrics


def calls(side: int) -> dict[str, torch.Tensor]:
    """The packed vectors of one UNet step with CFG and one VAE decode, as Cake's master sends them."""
    latents = torch.randn(2, 4, side, side)
    return {"unet": pack(latents, torch.randn(2, 77, 32), torch.tensor([500.0])),
            "vae": pack(torch.tensor([0.0]), latents[:1])}


async def relay_tax(port: int, runner: ComponentRunner, packed: dict[str, torch.Tensor], steps: int) -> None:
    client = await WorkerClient.connect("127.0.0.1", port)
    await client.hello()
    for index, name in enumerate(("unet", "vae")):
        x = f32(packed[name])

        async def remote(_: int) -> None:
            await client.single_op(name, x, 0, 0)

        async def local(_: int) -> None:
            (y,) = runner.run_batch([Call(1, x, index)])
            y.numpy().tobytes()  # the reply's bytes, as the node makes them

        times = await alternate({"node": remote, "in-process": local}, steps, 0.0, block_size=20)
        node, inproc = statistics.median(times["node"]), statistics.median(times["in-process"])
        print(f"{name}: node p50 {node:.0f} µs, in-process p50 {inproc:.0f} µs, relay tax {node - inproc:.0f} µs "
              f"({node / inproc:.2f}x)")
    await client.close()


async def two_masters(port: int, x, seconds: float) -> float:
    """Aggregate UNet steps/s of two masters sending steps back to back."""
    clients = [await WorkerClient.connect("127.0.0.1", port) for _ in range(2)]
    for client in clients:
        await client.hello()
        await client.single_op("unet", x, 0, 0)  # warm-up
    done = [0, 0]
    end = time.perf_counter() + seconds

    async def master(i: int) -> None:
        while time.perf_counter() < end:
            await clients[i].single_op("unet", x, 0, 0)
            done[i] += 1

    start = time.perf_counter()
    await asyncio.gather(master(0), master(1))
    elapsed = time.perf_counter() - start
    for client in clients:
        await client.close()
    return sum(done) / elapsed


def requests_per_step(metrics: int) -> tuple[float, float]:
    try:
        return batch_size_totals(metrics)
    except OSError:
        return 0.0, 0.0


async def main_async(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-image-"))
    write_cache(root)
    torch.set_num_threads(args.threads)
    files = [(name, _Files(locate(name, ImageFlags(str(root), "v1-5")))) for name in ("unet", "vae")]
    runner = ComponentRunner.load("sd", "v1-5", files, "cpu", torch.float32)
    packed = calls(args.side)
    batched = start_node(root, args.threads)
    alone = start_node(root, args.threads, "--max-batch", "1")
    try:
        await relay_tax(batched[1], runner, packed, args.steps)
        x = f32(packed["unet"])
        rates = {}
        for name, (_, port, metrics) in ((BATCHED, batched), (ALONE, alone)):
            before = requests_per_step(metrics)
            rates[name] = await two_masters(port, x, args.seconds)
            after = requests_per_step(metrics)
            steps = after[1] - before[1]
            per_step = (after[0] - before[0]) / steps if steps else float("nan")
            print(f"two masters, {name}: {rates[name]:.1f} UNet steps/s, {per_step:.2f} requests per device step")
        print(f"batched / one after another: {rates[BATCHED] / rates[ALONE]:.2f}x")
    finally:
        for process, _, _ in (batched, alone):
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--side", type=int, default=8, help="latent side (the image is 2x that through the tiny VAE)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(f"python {platform.python_version()} torch {torch.__version__} on {platform.machine()}, "
          f"{args.threads} thread(s), latents {args.side}x{args.side}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
