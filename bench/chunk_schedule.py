"""How the way a prompt is cut sets a pipelined prefill's time: one stage's chunk times, measured.

    python -m bench.chunk_schedule [--even 512,128,103,64,32] [--graded 32-128-128-128-64-32 ...]
                                   [--stages 2] [--rounds 4]

Writes the route benchmark's random Llama (bench/route.py: hidden 1024, intermediate 2816,
f32) and runs its layers 0-3 (one device's stage there) in this process, one torch thread,
over a 512-token prompt cut each way given, the ways taking turns, --rounds times: the median
time of each chunk. Then each way's pipeline over --stages such stages, every stage taking
the measured chunk times, chunk after chunk as the devices do (a chunk starts on a stage
once that stage finished the chunk before and the stage before finished this one), against
the whole prompt through --stages stages in one process.

What it shows (docs/benchmarks.md, "Graded prefill chunks"): with every stage as fast as the
others, the pipeline's time is the sum of the chunk times plus (stages - 1) times the longest
chunk, whatever their order or sizes, so only a shorter longest chunk lowers it, and a chunk
costs more per token the smaller it is. Two devices computing at once run slower than one
alone (about 4 % here), which this model, one stage at a time, leaves out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cakemp.compute.runner import BlockRunner
from tests.support.checkpoints import make_checkpoint

PROMPT = 512
HIDDEN = 1024
STAGE_LAYERS = 4


def even(sizes: int) -> tuple[int, ...]:
    """A prompt cut into chunks of `sizes` tokens (the last one shorter)."""
    return tuple(min(sizes, PROMPT - start) for start in range(0, PROMPT, sizes))


def pipeline_s(chunk_s: list[float], stages: int) -> float:
    """Seconds until the last stage finishes the last chunk, every stage taking `chunk_s[i]` on chunk i."""
    finished = [0.0] * stages  # when each stage finished its latest chunk
    for seconds in chunk_s:
        ready = 0.0  # when the stage before finished this chunk
        for stage in range(stages):
            finished[stage] = max(finished[stage], ready) + seconds
            ready = finished[stage]
    return finished[-1]


class Stage:
    """Layers 0-3 of the checkpoint in this process: one prompt's chunk times."""

    def __init__(self, model: Path):
        torch.set_num_threads(1)
        self.layers = [f"model.layers.{i}" for i in range(STAGE_LAYERS)]
        self.runner = BlockRunner.load(model, self.layers, "cpu", torch.float32)
        self.prompt = torch.randn(1, PROMPT, HIDDEN)

    def chunk_s(self, sizes: tuple[int, ...]) -> list[float]:
        """Seconds of each chunk of the prompt cut into `sizes` (one session, from position 0)."""
        spent, start = [], 0
        with torch.inference_mode():
            for size in sizes:
                ops = self.runner.ops([(layer, start, i) for i, layer in enumerate(self.layers)])
                began = time.perf_counter()
                self.runner.run(1, self.prompt[:, start:start + size], ops)
                spent.append(time.perf_counter() - began)
                start += size
        self.runner.free_session(1)
        return spent


def measure(stage: Stage, ways: dict[str, tuple[int, ...]], rounds: int) -> dict[str, list[float]]:
    """Each way's median seconds per chunk over `rounds`, the ways taking turns."""
    stage.chunk_s(even(128))  # warm-up
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, sizes in ways.items():
            times[name].append(stage.chunk_s(sizes))
    return {name: [statistics.median(column) for column in zip(*runs)] for name, runs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--even", default="512,128,103,86,64,32", help="even cuts: tokens per chunk")
    parser.add_argument("--graded", nargs="*", default=["32-128-128-128-64-32", "64-128-128-128-64"],
                        help="cuts as chunk sizes in order, summing to 512")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    ways = {f"even {size}": even(int(size)) for size in args.even.split(",")}
    ways |= {spec: tuple(int(size) for size in spec.split("-")) for spec in args.graded}
    if any(sum(sizes) != PROMPT for sizes in ways.values()):
        parser.error(f"every cut must sum to {PROMPT}")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(Path(tmp), "llama", num_hidden_layers=STAGE_LAYERS, hidden_size=HIDDEN,
                                intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                                max_position_embeddings=4096)
        medians = measure(Stage(model), {"whole": (PROMPT,), **ways}, args.rounds)
    one_process = args.stages * medians.pop("whole")[0]
    print(f"{PROMPT}-token prompt, {STAGE_LAYERS} layers a stage, one torch thread, median of {args.rounds}; "
          f"{args.stages} stages in one process: {one_process * 1e3:.0f} ms")
    print(f"| cut | chunk ms | one stage ms | ms per token | {args.stages}-stage pipeline ms | vs one process |")
    print("|---|---|---:|---:|---:|---:|")
    for name, chunk_s in medians.items():
        total, makespan = sum(chunk_s), pipeline_s(chunk_s, args.stages)
        chunks = " ".join(f"{seconds * 1e3:.0f}" for seconds in chunk_s)
        print(f"| {name} | {chunks} | {total * 1e3:.0f} | {total / PROMPT * 1e3:.3f} | {makespan * 1e3:.0f} | "
              f"{makespan / one_process:.3f} |")


if __name__ == "__main__":
    main()
