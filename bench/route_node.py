"""The route benchmark's node and master, shared by bench/route.py and bench/breakdown.py.

`start_node` starts `cakemp run --gpus cpu:2 --cpu-threads 1` over the LAYERS layers of a
checkpoint (hidden HIDDEN); `Master` is a Cake-style master holding one session on it, sending
decode steps and PROMPT-token prompts through every layer as one Batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from bench.pool import free_port, raw, wait_listening
from cakemp.master.client import WorkerClient

LAYERS = 8
HIDDEN = 1024
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
    async def open(cls, port: int) -> Master:
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
