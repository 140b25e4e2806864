"""Pool benchmark: what the front and ZeroMQ cost, and what several device processes buy.

    python -m bench.pool [--steps 400] [--seconds 4]   (--seconds 0: the relay tax only)

Writes two random Llama checkpoints (4 layers each) to a temp dir and starts, side by side,
`cakemp run` and bench/single_worker.py (Cake's design in one process: TCP, codec and
BlockRunner in one asyncio loop) on the same layers, f32. A Cake-style master
(one connection per layer, the run as one Batch on the first) then measures, in the same run:

1. relay tax (small model, hidden 256, so that compute does not drown the overhead): round
   trip of a decode Batch through `cakemp run --gpus cpu:1` against the single-process
   worker, one torch thread each, p50 and p99 over --steps steps, the two alternating in
   blocks of 50. An empty Batch (no layers: TCP + codec + asyncio only, no device hop in
   cakemp) and the ipc hop alone split the tax: the front's channel to a device process that
   echoes, against the same echo over a plain Unix socket (the floor for any second process),
   with the echo returning at once and after busy-waiting as long as the decode's compute.
2. concurrency (hidden 1024, decode compute dominant): aggregate decode steps/s of 1, 2 and
   4 concurrent sessions, each decoding through all 4 layers for --seconds, on
   `cakemp run --gpus cpu:2` (layers 0-1 on one process, 2-3 on the other) against the
   single-process worker with 1 torch thread and with one per core.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
import yaml

from bench.front_floor import busy, echo_device
from cakemp.compute import tensors
from cakemp.ipc import FrontChannel, Hop, Hops, Op, Stage
from cakemp.master.client import WorkerClient
from cakemp.wire import DType, RawTensor
from tests.support.checkpoints import make_checkpoint

LAYERS = 4
BLOCK = 50  # decode steps per block when alternating between the two workers
PREFILL = 8
MAX_POSITIONS = 4096
# A runner's KV budget where a benchmark runs it with prefix reuse, as a node's device (which always
# has one): 1 GiB, room for every row these benchmarks keep.
REUSE_BUDGET = 1 << 30


def machine_line() -> str:
    """What a benchmark's figures were taken on: Python, torch, the machine and its load as it starts."""
    return (f"python {platform.python_version()} torch {torch.__version__} on {platform.machine()}, "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"worker exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("worker never listened")


def start_cakemp(model: Path, workdir: Path, gpus: str, *extra: str, source: Path | None = None,
                 layers: int = LAYERS, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """`cakemp run` over the model's `layers` layers, f32; from the checkout at `source` (e.g. a git
    worktree of an older commit) when given, else from this interpreter's path; `env`: variables set in
    its environment besides (a PYTHONPATH there replaces `source`'s)."""
    topology = workdir / f"topology-{model.name}.yml"
    topology.write_text(yaml.safe_dump({"w": {"host": "x:1", "layers": [f"model.layers.0-{layers - 1}"]}}))
    port = free_port()
    variables = ({} if source is None else {"PYTHONPATH": str(source)}) | (env or {})
    process = subprocess.Popen(
        [sys.executable, "-m", "cakemp", "run", "--name", "w", "--model", str(model), "--topology", str(topology),
         "--address", f"127.0.0.1:{port}", "--gpus", gpus, "--dtype", "f32", "--log-level", "warning", *extra],
        stdout=subprocess.DEVNULL, cwd=source, env={**os.environ, **variables} if variables else None)
    wait_listening(port, process)
    return process, port


def start_single(model: Path, threads: int, layers: int = LAYERS) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.single_worker", "--model", str(model), "--layers", f"model.layers.0-{layers - 1}",
         "--threads", str(threads)], stdout=subprocess.PIPE, text=True)
    port = int(process.stdout.readline().split()[1])
    return process, port


def raw(x: torch.Tensor, wire: DType = DType.F32) -> RawTensor:
    """x as a master sends it, in wire dtype `wire` (a node's --dtype, as Cake's master matches it)."""
    return tensors.to_raw(x, wire)


class Session:
    """One master session over a model's `layers` layers: a connection per layer, decode steps as Batches on the first."""

    def __init__(self, clients: list[WorkerClient], hidden: int, wire: DType = DType.F32):
        self.clients, self.hidden, self.wire, self.position = clients, hidden, wire, 0

    @classmethod
    async def open(cls, port: int, hidden: int, layers: int = LAYERS, wire: DType = DType.F32) -> Session:
        clients = []
        for _ in range(layers):
            client = await WorkerClient.connect("127.0.0.1", port)
            await client.hello()
            clients.append(client)
        session = cls(clients, hidden, wire)
        await session.restart()
        return session

    async def restart(self, prompt: int = PREFILL) -> None:
        """A new prompt of `prompt` tokens from position 0 (Goodbye clears the session's cache)."""
        await self.clients[0].goodbye()
        self.position = 0
        await self.step(prompt)

    async def step(self, tokens: int = 1, layers: int | None = None) -> None:
        """A Batch of `tokens` through the first `layers` layers (all of them by default)."""
        layers = len(self.clients) if layers is None else layers
        if self.position + tokens > MAX_POSITIONS:
            await self.restart()
        ops = [(f"model.layers.{i}", self.position, i) for i in range(layers)]
        await self.clients[0].batch(raw(torch.randn(1, tokens, self.hidden), self.wire), ops)
        if layers:
            self.position += tokens

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


async def relay_tax(ports: dict[str, int], hidden: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Round-trip times in µs: {worker: {"decode": [...], "empty": [...]}}, blocks alternating."""
    sessions = {name: await Session.open(port, hidden) for name, port in ports.items()}
    times = {name: {"decode": [], "empty": []} for name in ports}
    for kind, layers in (("decode", LAYERS), ("empty", 0)):
        for session in sessions.values():  # warm-up
            for _ in range(BLOCK):
                await session.step(layers=layers)
        for _ in range(steps // BLOCK):
            for name, session in sessions.items():
                for _ in range(BLOCK):
                    start = time.perf_counter()
                    await session.step(layers=layers)
                    times[name][kind].append((time.perf_counter() - start) * 1e6)
    for session in sessions.values():
        await session.close()
    return times


async def throughput(port: int, hidden: int, sessions: int, seconds: float,
                     mark: Callable[[], object] = lambda: None) -> float:
    """Aggregate decode steps/s of `sessions` masters decoding concurrently for `seconds`, after
    one warm-up step each, all at once. `mark` is called as the window opens and once every step
    in it has finished (e.g. to read the node's counters)."""
    opened = [await Session.open(port, hidden) for _ in range(sessions)]
    await asyncio.gather(*(session.step() for session in opened))
    counts = [0] * sessions

    async def loop(i: int) -> None:
        while time.perf_counter() < deadline:
            await opened[i].step()
            counts[i] += 1

    mark()
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(loop(i) for i in range(sessions)))
    elapsed = time.perf_counter() - start
    mark()
    for session in opened:
        await session.close()
    return sum(counts) / elapsed


def echo_unix(path: str, busy_s: float, nbytes: int) -> None:
    """The same echo over a plain Unix stream socket: the floor for any second process (2 thread hand-offs)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        while True:
            data = bytearray()
            while len(data) < nbytes:
                chunk = sock.recv(nbytes - len(data))
                if not chunk:
                    return
                data += chunk
            busy(busy_s)
            sock.sendall(data)


async def ipc_hop(workdir: Path, steps: int, busy_s: float, hidden: int = 4096) -> dict[str, list[float]]:
    """Round trips in µs, minus busy_s, of a decode-size Hop ([1, 1, hidden] f16) to an echoing
    device process: over cakemp's ZeroMQ channels and over a plain Unix socket, blocks alternating."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    endpoint = f"ipc://{workdir}/echo"
    replies: asyncio.Queue = asyncio.Queue()
    channel = FrontChannel(endpoint, replies.put_nowait, lambda error: None)
    zmq_child = context.Process(target=echo_device, args=(endpoint, reader, busy_s), daemon=True)
    zmq_child.start()
    body = memoryview(bytearray(hidden * 2))
    accepted: asyncio.Queue = asyncio.Queue()
    server = await asyncio.start_unix_server(lambda r, w: accepted.put_nowait((r, w)), str(workdir / "echo.sock"))
    unix_child = context.Process(target=echo_unix, args=(str(workdir / "echo.sock"), busy_s, len(body)), daemon=True)
    unix_child.start()
    unix_reader, unix_writer = await accepted.get()

    async def over_zmq(i: int) -> None:
        await channel.send(Hops((Hop(1, i, DType.F16, body.nbytes, 0, 1, (1, 1, hidden), (Stage.of(0, 1, (Op(0, i, 0),)),)),),
                                body))
        await replies.get()

    async def over_unix(i: int) -> None:
        unix_writer.write(body)
        await unix_reader.readexactly(len(body))

    times = await alternate({"ZeroMQ (cakemp's channels)": over_zmq, "plain Unix socket": over_unix}, steps, busy_s)
    for child in (zmq_child, unix_child):
        child.terminate()
        child.join()
    writer.close()
    unix_writer.close()
    server.close()
    channel.close()
    return times


async def alternate(ways: dict[str, Callable[[int], Awaitable[None]]], steps: int, busy_s: float,
                    block_size: int = BLOCK) -> dict[str, list[float]]:
    """Round trips of each way, in blocks of `block_size` taking turns (so the machine's drift hits
    them alike), the first block a warm-up: µs per call above `busy_s`, by way name. Each call
    gets its own request number."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for block in range(steps // block_size + 1):
        for name, way in ways.items():
            for i in range(block_size):
                start = time.perf_counter()
                await way(block * block_size + i)
                if block:
                    times[name].append((time.perf_counter() - start - busy_s) * 1e6)
    return times


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q < 100 else max(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=4.0, help="per concurrency cell; 0 skips part 2")
    args = parser.parse_args()
    print(f"python {platform.python_version()} torch {torch.__version__} on {platform.machine()}, "
          f"{os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = dict(num_hidden_layers=LAYERS, max_position_embeddings=MAX_POSITIONS)
        small = make_checkpoint(work / "small", "llama", hidden_size=256, intermediate_size=704,
                                num_attention_heads=4, num_key_value_heads=2, **common)
        big = make_checkpoint(work / "big", "llama", hidden_size=1024, intermediate_size=2816,
                              num_attention_heads=16, num_key_value_heads=4, **common)

        processes = []
        try:
            node, node_port = start_cakemp(small, work, "cpu:1", "--cpu-threads", "1")
            single, single_port = start_single(small, threads=1)
            processes += [node, single]
            times = asyncio.run(relay_tax({"cakemp cpu:1": node_port, "single process": single_port}, 256, args.steps))
            print(f"\n1. relay tax: decode Batch of {LAYERS} layers, hidden 256, f32, [1, 1, 256], 1 torch thread "
                  f"each; {args.steps} steps each, blocks of {BLOCK} alternating")
            print("| worker | Batch | p50 µs | p99 µs |\n|---|---|---:|---:|")
            for name, kinds in times.items():
                for kind, values in kinds.items():
                    label = f"{LAYERS} layers" if kind == "decode" else "empty (no layers)"
                    print(f"| {name} | {label} | {pct(values, 50):.0f} | {pct(values, 99):.0f} |")
            for kind in ("decode", "empty"):
                ours, base = (pct(times[name][kind], 50) for name in ("cakemp cpu:1", "single process"))
                print(f"p50, {kind}: cakemp / single process = {ours / base:.2f}×, difference {ours - base:+.0f} µs")
            compute_s = (pct(times["single process"]["decode"], 50) - pct(times["single process"]["empty"], 50)) / 1e6
            for process in (node, single):
                process.terminate()
                process.wait()
            print(f"\nthe ipc hop alone: front -> echoing process -> front, [1, 1, 4096] f16, {args.steps} round trips "
                  f"each, blocks of {BLOCK} alternating; µs above the echo's busy time")
            print("| transport | echo busy for | p50 µs | p99 µs |\n|---|---:|---:|---:|")
            for busy_s in (0.0, compute_s):
                for name, values in asyncio.run(ipc_hop(work, args.steps, busy_s)).items():
                    print(f"| {name} | {busy_s * 1e6:.0f} µs | {pct(values, 50):.0f} | {pct(values, 99):.0f} |")

            if not args.seconds:
                return
            # The single-process worker at 1 torch thread and at all cores: the better of the two
            # is the baseline (intra-op threads do not always pay on small CPUs).
            cores = len(os.sched_getaffinity(0))
            node, node_port = start_cakemp(big, work, "cpu:2")
            singles = {threads: start_single(big, threads) for threads in sorted({1, cores})}
            processes += [node, *(process for process, _ in singles.values())]
            print(f"\n2. concurrency: decode through {LAYERS} layers, hidden 1024, f32, {args.seconds:g} s per cell; "
                  f"cakemp cpu:2 runs {cores // 2} torch thread(s) per device process")
            header = " | ".join(f"single, {t} thread(s)" for t in singles)
            print(f"| sessions | {header} | cakemp cpu:2 | cakemp / best single |")
            print("|---:|" + "---:|" * (len(singles) + 2))
            for sessions in (1, 2, 4):
                base = {t: asyncio.run(throughput(port, 1024, sessions, args.seconds)) for t, (_, port) in singles.items()}
                pooled = asyncio.run(throughput(node_port, 1024, sessions, args.seconds))
                cells = " | ".join(f"{v:.1f}" for v in base.values())
                print(f"| {sessions} | {cells} | {pooled:.1f} | {pooled / max(base.values()):.2f}× |")
        finally:
            for process in processes:
                if process.poll() is None:
                    process.terminate()
                    process.wait()


if __name__ == "__main__":
    main()
