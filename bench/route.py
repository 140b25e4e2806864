"""Route benchmark: a Batch whose layers span two device processes, against one process.

    python -m bench.route [--base DIR] [--chunks 32,64,128] [--steps 200] [--prefills 3]

Writes a random 8-layer Llama checkpoint (hidden 1024, f32) and starts, side by side in one
run: bench/single_worker.py (the same layers in one process, one torch thread: Cake's
design), `cakemp run --gpus cpu:2 --cpu-threads 1` from this tree once per --prefill-chunk
value, and, with --base, the same command from another checkout (a git worktree of the
commit before the change) for "today's" figures. A Cake-style master then measures, the
workers alternating:

1. decode: round trip of a [1, 1, 1024] Batch through all 8 layers (4 per device), p50 and
   p99 over --steps steps each, in blocks of 25; and each worker's p50 extra over the single
   process;
2. prefill: a 512-token Batch at position 0 through all 8 layers, --prefills times each,
   median; and its ratio to the single process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.pool import free_port, pct, raw, start_single, wait_listening
from cakemp.master.client import WorkerClient
from tests.checkpoints import make_checkpoint

LAYERS = 8
HIDDEN = 1024
BLOCK = 25
PROMPT = 512
MAX_POSITIONS = 4096


def start_node(model: Path, workdir: Path, source: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """`cakemp run --gpus cpu:2 --cpu-threads 1` over all layers, run from the checkout at `source`."""
    topology = workdir / "topology.yml"
    topology.write_text(yaml.safe_dump({"w": {"host": "x:1", "layers": [f"model.layers.0-{LAYERS - 1}"]}}))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cakemp", "run", "--name", "w", "--model", str(model), "--topology", str(topology),
         "--address", f"127.0.0.1:{port}", "--gpus", "cpu:2", "--cpu-threads", "1", "--dtype", "f32",
         "--log-level", "warning", *extra],
        stdout=subprocess.DEVNULL, cwd=source, env={**os.environ, "PYTHONPATH": str(source)})
    wait_listening(port, process, timeout=600)
    return process, port


class Master:
    """One session: decode steps and prompts through every layer as one Batch."""

    def __init__(self, client: WorkerClient):
        self.client, self.position = client, 0

    @classmethod
    async def open(cls, port: int) -> "Master":
        client = await WorkerClient.connect("127.0.0.1", port)
        await client.hello()
        return cls(client)

    async def batch(self, tokens: int) -> float:
        """Seconds for one Batch of `tokens` at the session's next position."""
        if self.position + tokens > MAX_POSITIONS:
            await self.client.goodbye()
            self.position = 0
        ops = [(f"model.layers.{i}", self.position, i) for i in range(LAYERS)]
        x = raw(torch.randn(1, tokens, HIDDEN))
        start = time.perf_counter()
        await self.client.batch(x, ops)
        elapsed = time.perf_counter() - start
        self.position += tokens
        return elapsed

    async def prompt(self) -> float:
        await self.client.goodbye()
        self.position = 0
        return await self.batch(PROMPT)


async def measure(ports: dict[str, int], steps: int, prefills: int) -> tuple[dict, dict]:
    masters = {name: await Master.open(port) for name, port in ports.items()}
    for master in masters.values():  # warm-up: first prompt, a few decode steps
        await master.prompt()
        for _ in range(5):
            await master.batch(1)
    decode = {name: [] for name in ports}
    for _ in range(steps // BLOCK):
        for name, master in masters.items():
            for _ in range(BLOCK):
                decode[name].append(await master.batch(1) * 1e3)
    prefill = {name: [] for name in ports}
    for _ in range(prefills):
        for name, master in masters.items():
            prefill[name].append(await master.prompt() * 1e3)
    for master in masters.values():
        await master.client.close()
    return decode, prefill


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="checkout of the commit to compare with (e.g. a git worktree)")
    parser.add_argument("--chunks", default="32,64,128", help="--prefill-chunk values to run this tree with")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefills", type=int, default=3)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    print(f"python {platform.python_version()} torch {torch.__version__} on {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_checkpoint(work, "llama", num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2816,
                                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS)
        try:
            single, single_port = start_single(model, threads=1, layers=LAYERS)
            processes.append(single)
            ports = {"single process, 1 thread": single_port}
            if args.base is not None:
                process, ports[f"cakemp {args.base.name} cpu:2"] = start_node(model, work, args.base.resolve())
                processes.append(process)
            for chunk in args.chunks.split(","):
                process, ports[f"cakemp cpu:2, chunk {chunk}"] = start_node(model, work, here, "--prefill-chunk", chunk)
                processes.append(process)
            decode, prefill = asyncio.run(measure(ports, args.steps, args.prefills))
        finally:
            for process in processes:
                process.terminate()
                process.wait()
    single_name = next(iter(ports))
    base_decode = pct(decode[single_name], 50)
    base_prefill = statistics.median(prefill[single_name])
    print(f"\n{LAYERS} layers, hidden {HIDDEN}, f32; cakemp: 4 layers on each of 2 device processes, 1 torch thread "
          f"each; decode {args.steps} steps each in blocks of {BLOCK}, prefill {PROMPT} tokens x {args.prefills} "
          f"each, workers alternating")
    print("| worker | decode p50 ms | p99 ms | extra over one process, p50 ms | prefill 512 ms (median) | "
          "vs one process |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ports:
        p50 = pct(decode[name], 50)
        median = statistics.median(prefill[name])
        print(f"| {name} | {p50:.2f} | {pct(decode[name], 99):.2f} | {p50 - base_decode:+.2f} | {median:.0f} | "
              f"{median / base_prefill:.2f}x |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
