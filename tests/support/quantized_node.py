"""What the GPTQ and MLX node tests share: a node serving layers 1-3 of a quantized checkpoint
on one f32 CPU device, checked against HF's layers over the checkpoint's reference."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import torch

from cakemp.checkpoint.config import ModelConfig
from tests.support.checkpoints import HFLayers
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, write_topology
from tests.support.tolerance import F32_REL, rel_error

LAYERS = [1, 2, 3]
EXIT_CONFIG = 78


def start(path: Path, tmp: Path, model: str | None = None, env: dict[str, str] | None = None,
          flags: tuple[str, ...] = ("--dequantize-4bit",)) -> RunningNode:
    """The node over `path`, named by `model` (a Hugging Face id for it; default: the path), under `env`,
    with `flags` (by default 4-bit weights dequantized, as the exact comparison with HF's f32 layers needs)."""
    prefix = ModelConfig.from_dir(path).layer_prefix
    topology = write_topology(tmp / "topology.yml", [f"{prefix}.1-3"])
    return RunningNode(model or path, topology, "--gpus", "cpu", "--dtype", "f32", *flags, env=env)


async def check_session(port: int, path: Path, reference: Path, chunks: list[int], bound: float = F32_REL) -> list[float]:
    """Send `chunks` tokens at a time through layers 1-3 as one session; each reply matches HF's
    layers over the reference to `bound` (F32_REL: the dequantization is exact in f32). -> the errors."""
    prefix = ModelConfig.from_dir(path).layer_prefix
    hf = HFLayers(reference, LAYERS, torch.float32)
    master = await CakeMaster.connect(port, LAYERS, prefix=prefix)
    generator = torch.Generator().manual_seed(len(chunks))
    position, errors = 0, []
    for T in chunks:
        x = torch.randn(1, T, hf.config.hidden_size, generator=generator)
        ours, theirs = await master.forward(x, position), hf(x, position)
        errors.append(rel_error(ours, theirs))
        assert errors[-1] <= bound, f"tokens {position}..{position + T - 1}: {errors[-1]:.3g}"
        position += T
    await master.goodbye()
    await master.close()
    return errors


def check_prompt_decode_and_chunks(node: RunningNode, path: Path, reference: Path, bound: float = F32_REL) -> None:
    """A 7-token prompt and 8 decode steps, then in a new session a 12-token prompt in 3-token chunks."""
    async def main():
        await check_session(node.port, path, reference, [7] + [1] * 8, bound)
        await check_session(node.port, path, reference, [3] * 4 + [1] * 8, bound)

    asyncio.run(asyncio.wait_for(main(), 120))


def refused_at_start(path: Path, tmp: Path) -> str:
    """`cakemp run` over `path`'s layers 1-3: it must exit 78; -> its output."""
    topology = write_topology(tmp / "refused.yml", ["model.layers.1-3"])
    result = subprocess.run([sys.executable, "-m", "cakemp", "run", "--name", "worker", "--model", str(path),
                             "--topology", str(topology), "--gpus", "cpu", "--address", "127.0.0.1:0",
                             "--log-format", "json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CONFIG, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr
