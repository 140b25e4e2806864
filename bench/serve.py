"""`cakemp serve` under concurrent clients: 1, 2, 4 and 8 at once against the same requests sent one
after another, side by side in one run.

    python -m bench.serve [--tokens 32] [--rounds 2] [--before DIR]

Writes a synthetic checkpoint (hidden 512, intermediate 1376, 6 layers, f32) and starts one
`cakemp run --gpus cpu:1 --no-prefix-reuse` node serving layers 1-5 (every request's prompt is its
own, and no reuse may flatter a repeat), and `cakemp serve` over it keeping layer 0 and the head,
--max-concurrent 8. Each client is the official `openai` client in its own thread, streaming a
/v1/completions of --tokens greedy tokens (min_tokens is not OpenAI's: prompts are picked whose
greedy answers run the whole length). For each count N, the N requests are sent one after another,
then all at once (the order alternating from round to round); printed per N and mode: aggregate
completion tokens/s (all tokens over the wall time), time to first token p50/p99 and the median
latency per later token; then the concurrent/sequential throughput ratio, and the slowest
concurrent time to first token over a lone request's. Then, for 1 and 8 clients at once, where the
step loop's time went (its counters in /metrics, read before and after): the master's own layer, its
head and sampling (in their threads), the workers' round trips, and the rest, the event loop's own.

With --before DIR (a checkout of an earlier cakemp, e.g. `git archive <commit> | tar -x -C DIR`), a
second server from that checkout over the same node answers the lone request too, alternating with
this one's, and the ratio of the two lone requests' time per token is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import yaml

from bench.pool import machine_line
from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from tests.support.node import LoggedProcess, RunningNode, samples

SPEC = SyntheticSpec(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                     num_key_value_heads=2, max_position_embeddings=2048)
COUNTS = (1, 2, 4, 8)
STEP_PARTS = ("local_layers", "head", "workers")


def start_node(model: Path, work: Path) -> tuple[RunningNode, Path]:
    node_topology = work / "node.yml"
    node_topology.write_text(yaml.safe_dump({"w": {"host": "x:1", "layers": ["model.layers.1-5"]}}))
    node = RunningNode(model, node_topology, "--gpus", "cpu:1", "--dtype", "f32", "--no-prefix-reuse", name="w",
                       timeout=300)
    master_topology = work / "master.yml"
    master_topology.write_text(yaml.safe_dump({"w": {"host": f"127.0.0.1:{node.port}", "layers": ["model.layers.1-5"]}}))
    return node, master_topology


def start_server(model: Path, topology: Path, source: Path | None = None, *extra: str) -> LoggedProcess:
    env = None if source is None else {"PYTHONPATH": str(source)}
    return LoggedProcess(["serve", "--model", str(model), "--topology", str(topology), "--dtype", "f32", "--address",
                          "127.0.0.1:0", "--repeat-penalty", "1", "--model-id", "m", "--log-format", "json",
                          *extra], ready="api listening", env=env, timeout=300)


class Timed:
    """One streamed request: when it was sent, its first text arrived, and each later piece."""

    def __init__(self, client: openai.OpenAI, prompt: str, tokens: int) -> None:
        self.sent = time.perf_counter()
        stamps, self.tokens = [], 0
        for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                self.tokens = chunk.usage.completion_tokens
        self.first = stamps[0] - self.sent
        self.done = stamps[-1]
        self.per_token = (stamps[-1] - stamps[0]) / max(1, self.tokens - 1)


def sequential(client, prompts, tokens) -> tuple[list[Timed], float]:
    start = time.perf_counter()
    timed = [Timed(client, prompt, tokens) for prompt in prompts]
    return timed, time.perf_counter() - start


def concurrent(client, prompts, tokens) -> tuple[list[Timed], float]:
    barrier = threading.Barrier(len(prompts) + 1)

    def one(prompt):
        barrier.wait()
        return Timed(client, prompt, tokens)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, prompt) for prompt in prompts]
        barrier.wait()
        start = time.perf_counter()
        timed = [future.result() for future in futures]
    return timed, max(t.done for t in timed) - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def full_length_prompts(client, count: int, tokens: int) -> list[str]:
    """`count` prompts whose greedy answers run `tokens` tokens (no end token before)."""
    prompts, i = [], 0
    while len(prompts) < count:
        prompt = f"Story {i}: once upon a time, in a land far away,"
        i += 1
        if client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0).usage \
                .completion_tokens == tokens:
            prompts.append(prompt)
    return prompts


def row(label: str, timed: list[Timed], wall: float) -> str:
    tokens = sum(t.tokens for t in timed)
    firsts = [t.first * 1e3 for t in timed]
    return (f"  {label:<11} {tokens / wall:8.1f} tok/s   ttft p50 {pct(firsts, 0.5):7.1f} ms  p99 {pct(firsts, 0.99):7.1f}"
            f" ms   per token {statistics.median(t.per_token for t in timed) * 1e3:6.2f} ms")


def measure(client, prompts, tokens: int, rounds: int) -> dict[int, dict[str, tuple[list[Timed], float]]]:
    """Per count and mode, the round with the best aggregate throughput (the least disturbed one)."""
    best: dict[int, dict[str, tuple[list[Timed], float]]] = {n: {} for n in COUNTS}
    for r in range(rounds):
        for n in COUNTS:
            modes = [("sequential", sequential), ("concurrent", concurrent)]
            for mode, run in modes if r % 2 == 0 else modes[::-1]:
                timed, wall = run(client, prompts[:n], tokens)
                kept = best[n].get(mode)
                if kept is None or sum(t.tokens for t in timed) / wall > sum(t.tokens for t in kept[0]) / kept[1]:
                    best[n][mode] = timed, wall
    return best


def step_times(port: int) -> dict[str, float]:
    """The step loop's counters: steps, and seconds of the loop and of each part."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        metrics = samples(response.read().decode())
    return {"steps": metrics[("cakemp_serve_steps_total", ())],
            **{part: metrics[(f"cakemp_serve_{part}_seconds_total", ())] for part in ("loop", *STEP_PARTS)}}


def where_the_time_goes(client, port: int, prompts, tokens: int) -> None:
    """Per step, at 1 and 8 clients at once: each part's milliseconds and share of the loop's time."""
    for n in (1, max(COUNTS)):
        before = step_times(port)
        concurrent(client, prompts[:n], tokens)
        after = step_times(port)
        spent = {name: after[name] - before[name] for name in after}
        steps, loop = spent["steps"], spent["loop"]
        rest = loop - sum(spent[part] for part in STEP_PARTS)
        shares = "  ".join(f"{part} {spent[part] / steps * 1e3:5.2f} ms ({spent[part] / loop:4.0%})"
                           for part in STEP_PARTS)
        print(f"{n} at once, {steps:.0f} steps of {loop / steps * 1e3:5.2f} ms: {shares}  "
              f"event loop {rest / steps * 1e3:5.2f} ms ({rest / loop:4.0%})")


def lone_against_before(model, topology, before: Path, prompt: str, tokens: int, rounds: int, client) -> None:
    earlier = start_server(model, topology, before)
    try:
        old = openai.OpenAI(base_url=f"http://127.0.0.1:{earlier.port}/v1", api_key="x", max_retries=0, timeout=600)
        ours, theirs = [], []
        for r in range(2 * rounds + 1):
            for c, into in ((client, ours), (old, theirs))[:: 1 if r % 2 else -1]:
                into.append(Timed(c, prompt, tokens))
        per_token = statistics.median(t.per_token for t in ours) / statistics.median(t.per_token for t in theirs)
        first = statistics.median(t.first for t in ours) / statistics.median(t.first for t in theirs)
        print(f"lone request, this checkout / {before.name}: per token {per_token:.3f}x, first token {first:.3f}x")
    finally:
        earlier.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", type=Path)
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "m"
        model.mkdir()
        write_checkpoint(model, SPEC)
        node, topology = start_node(model, work)
        server = start_server(model, topology, None, "--max-concurrent", "8")
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0,
                                   timeout=600)
            prompts = full_length_prompts(client, max(COUNTS), args.tokens)
            best = measure(client, prompts, args.tokens, args.rounds)
            lone = min(t.first for t in best[1]["sequential"][0])
            for n in COUNTS:
                print(f"{n} client{'s' if n > 1 else ''}:")
                for mode in ("sequential", "concurrent"):
                    print(row(mode, *best[n][mode]))
                (seq, seq_wall), (con, con_wall) = best[n]["sequential"], best[n]["concurrent"]
                ratio = (sum(t.tokens for t in con) / con_wall) / (sum(t.tokens for t in seq) / seq_wall)
                print(f"  concurrent / sequential throughput {ratio:.2f}x; slowest first token "
                      f"{max(t.first for t in con) / lone:.1f}x a lone request's")
            where_the_time_goes(client, server.port, prompts, args.tokens)
            if args.before is not None:
                lone_against_before(model, topology, args.before, prompts[0], args.tokens, args.rounds, client)
        finally:
            server.stop()
            node.stop()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
