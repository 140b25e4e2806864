"""How long a correct master waits for its Hello and its first Batch beside hostile peers.

    python -m bench.peer_bounds [--before DIR] [--frame-timeout 10] [--connects 12]

Writes a small Llama checkpoint (2 layers, hidden 64, f32) and, for each scenario, starts a
fresh keyed node (`cakemp run`, --max-buffered-mib 2, --max-context 4096, --frame-timeout as
given) from this tree and, with --before DIR (a checkout of an older commit, e.g. `git archive`
of it unpacked), one from DIR (PYTHONPATH=DIR), side by side in one run:

* `stalled-6`, `stalled-64`: that many masters holding the key (from 127.0.0.1), each sending
  twelve 0.5 MiB requests (echoed: no layer to run) and never reading a reply;
* `flood`: one address (127.0.0.3) connecting from four threads as fast as they can, never
  sending a byte; the master is 100 ms away (a round trip, through tests/support/distance.py),
  so its proof is on the way while the flood's newer connects arrive.

Then a correct master from 127.0.0.2 connects --connects times, one after another: the key
handshake and Hello, then a Batch of 5 positions through both layers. Printed per scenario and
tree: the median and the worst time to WorkerInfo and to the Batch's answer, and how many of the
connects failed (reset, closed or past 3 frame timeouts); then this tree's medians against the
before tree's as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.pool import free_port, machine_line, wait_listening
from cakemp.auth import authenticate_worker
from cakemp.master.client import WorkerClient
from cakemp.wire import Batch, DType, Hello, RawTensor, Revision, encode_frame
from tests.support.checkpoints import make_checkpoint
from tests.support.distance import Distance
from tests.support.flood import ConnectFlood

KEY = "bench peer bounds"
HIDDEN = 64
CONTEXT = 4096
STALLED_POSITIONS = 2048  # 0.5 MiB of f32 per request
STALLED_REQUESTS = 12  # 6 MiB of replies per stalled master: more than the node's socket buffer takes
OPS = [(f"model.layers.{i}", 0, i) for i in range(2)]
SCENARIOS = ("stalled-6", "stalled-64", "flood")


def start_node(model: Path, workdir: Path, frame_timeout: float, source: Path | None) -> tuple[subprocess.Popen, int]:
    topology = workdir / "topology.yml"
    topology.write_text(yaml.safe_dump({"w": {"host": "x:1", "layers": ["model.layers.0-1"]}}))
    port = free_port()
    env = {**os.environ, "CAKE_CLUSTER_KEY": KEY, **({} if source is None else {"PYTHONPATH": str(source)})}
    process = subprocess.Popen(
        [sys.executable, "-m", "cakemp", "run", "--name", "w", "--model", str(model), "--topology", str(topology),
         "--address", f"127.0.0.1:{port}", "--gpus", "cpu", "--dtype", "f32", "--log-level", "error",
         "--max-context", str(CONTEXT), "--max-buffered-mib", "2", "--frame-timeout", str(frame_timeout),
         "--max-connections", "4096"],
        stdout=subprocess.DEVNULL, cwd=source, env=env)
    wait_listening(port, process)
    return process, port


async def stall(port: int) -> asyncio.StreamWriter:
    """A keyed master that says Hello, sends STALLED_REQUESTS of 0.5 MiB and never reads anything."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    await authenticate_worker(reader, writer, KEY)
    echo = Batch(RawTensor(bytes(STALLED_POSITIONS * HIDDEN * 4), DType.F32, (1, STALLED_POSITIONS, HIDDEN)), ())
    requests = [piece for _ in range(STALLED_REQUESTS) for piece in encode_frame(echo, Revision.V2)]
    writer.writelines([*encode_frame(Hello(), Revision.V2), *requests])
    return writer


async def one_master(port: int, limit: float, source: str | None = "127.0.0.2") -> tuple[float, float] | None:
    """Seconds to WorkerInfo and to the first Batch's answer, from `source` (None: a Distance's port
    relays it from its own); None if it failed."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(limit):
            client = await WorkerClient.connect("127.0.0.1", port, cluster_key=KEY, source=source, timeout=limit)
            async with client:
                await client.hello()
                hello_s = time.perf_counter() - started
                await client.batch(RawTensor(bytes(5 * HIDDEN * 4), DType.F32, (1, 5, HIDDEN)), OPS)
                return hello_s, time.perf_counter() - started
    except Exception:  # reset, closed, refused or past the limit: a failed connect
        return None


async def scenario(name: str, port: int, connects: int, frame_timeout: float) -> list[tuple[float, float] | None]:
    if name == "flood":
        with ConnectFlood(port, "127.0.0.3"), Distance(port, "127.0.0.2", 0.05) as far:
            await asyncio.sleep(1)
            return [await one_master(far.port, 3 * frame_timeout, source=None) for _ in range(connects)]
    stalled = [await stall(port) for _ in range(int(name.split("-")[1]))]
    await asyncio.sleep(1)  # their frames taken, their replies stuck
    try:
        return [await one_master(port, 3 * frame_timeout) for _ in range(connects)]
    finally:
        for writer in stalled:
            writer.transport.abort()


def summary(times: list[tuple[float, float] | None]) -> tuple[str, float, float]:
    done = [t for t in times if t is not None]
    if not done:
        return f"all {len(times)} failed", float("nan"), float("nan")
    hello, batch = statistics.median(t[0] for t in done), statistics.median(t[1] for t in done)
    return (f"Hello median {hello * 1000:8.1f} ms, worst {max(t[0] for t in done) * 1000:8.1f} ms; "
            f"first Batch median {batch * 1000:8.1f} ms, worst {max(t[1] for t in done) * 1000:8.1f} ms; "
            f"failed {len(times) - len(done)}/{len(times)}"), hello, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="checkout of an older commit to compare with")
    parser.add_argument("--frame-timeout", type=float, default=10.0)
    parser.add_argument("--connects", type=int, default=12)
    args = parser.parse_args()
    print(machine_line())
    trees = {"this tree": None, **({f"before ({args.before.name})": args.before.resolve()} if args.before else {})}
    with tempfile.TemporaryDirectory() as work:
        model = make_checkpoint(Path(work) / "model", "llama", num_hidden_layers=2, max_position_embeddings=CONTEXT)
        medians: dict[tuple[str, str], tuple[float, float]] = {}
        for name in SCENARIOS:
            for tree, source in trees.items():
                process, port = start_node(model, Path(work), args.frame_timeout, source)
                try:
                    line, hello, batch = summary(asyncio.run(scenario(name, port, args.connects, args.frame_timeout)))
                finally:
                    process.kill()
                    process.wait()
                medians[name, tree] = hello, batch
                print(f"{name:10} {tree:24} {line}", flush=True)
        if args.before is not None:
            before = next(tree for tree in trees if tree != "this tree")
            for name in SCENARIOS:
                (hello, batch), (old_hello, old_batch) = medians[name, "this tree"], medians[name, before]
                print(f"{name:10} median wait, this tree / before: Hello {hello / old_hello:.4f}x, "
                      f"first Batch {batch / old_batch:.4f}x")


if __name__ == "__main__":
    main()
