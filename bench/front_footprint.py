"""Front footprint: import time and resident memory of the front, this tree against another.

    python -m bench.front_footprint --before /path/to/older/tree [--imports 15] [--requests 300]

For each tree (put first on PYTHONPATH of the child processes), side by side in one run:

1. import time: `python -X importtime -c "import cakemp.cli"` (what `cakemp run` imports before
   it does anything), the cumulative microseconds of `cakemp.cli`, median over --imports runs,
   the two trees alternating; and how many modules that leaves in sys.modules;
2. RSS of a running front: `cakemp run --gpus cpu:1` on a small synthetic checkpoint, VmRSS of
   the front process (not its device process) once it listens, and again after --requests
   decode Batches on one session (the metrics, stats and logging paths warmed up).

Also the import cost of prometheus_client on top of the front's imports, which decided whether
the front's metrics use it (see cakemp/prometheus.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from cakemp.compute import tensors
from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from cakemp.master.client import WorkerClient
from cakemp.wire import DType

HERE = Path(__file__).resolve().parents[1]
SPEC = SyntheticSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)


def child_env(tree: Path) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("CAKEMP_")}, "PYTHONPATH": str(tree)}


def import_micros(tree: Path, extra: str = "") -> tuple[int, int]:
    """(cumulative µs of `cakemp.cli` or of `extra`'s top module, modules loaded) in a fresh interpreter."""
    code = f"import cakemp.cli{'; import ' + extra if extra else ''}; import sys; print(len(sys.modules))"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=child_env(tree),
                          capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    target = extra or "cakemp.cli"
    line = next(row for row in done.stderr.splitlines() if row.rstrip().endswith(f"| {target}"))
    return int(line.split("|")[1]), int(done.stdout.strip())


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


async def decode(port: int, steps: int) -> None:
    client = await WorkerClient.connect("127.0.0.1", port)
    await client.hello()
    ops = [(f"model.layers.{i}", 0, i) for i in range(SPEC.num_hidden_layers)]
    for position in range(steps):
        x = torch.randn(1, 1, SPEC.hidden_size)
        await client.batch(tensors.to_raw(x, DType.F32), [(name, position, index) for name, _, index in ops])
    await client.goodbye()
    await client.close()


def front_rss(tree: Path, model: Path, work: Path, requests: int) -> tuple[int, int]:
    """(RSS once listening, RSS after `requests` decode steps) of the front started from `tree`."""
    topology = work / "topology.yml"
    topology.write_text(yaml.safe_dump({"w": {"host": "x:1", "layers": [f"model.layers.0-{SPEC.num_hidden_layers - 1}"]}}))
    log = work / f"front-{tree.name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "cakemp", "run", "--name", "w", "--model", str(model), "--topology", str(topology),
             "--address", "127.0.0.1:0", "--gpus", "cpu:1", "--dtype", "f32", "--log-format", "json"],
            stdout=out, stderr=subprocess.STDOUT, env=child_env(tree), cwd=work)
    try:
        port = wait_listening(log, process)
        ready = rss_bytes(process.pid)
        asyncio.run(decode(port, requests))
        return ready, rss_bytes(process.pid)
    finally:
        process.terminate()
        process.wait(60)


def wait_listening(log: Path, process: subprocess.Popen, timeout: float = 300.0) -> int:
    """The port from the front's listening event (named "listening" now, "listening on …" before)."""
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"front exited with {process.returncode}: {log.read_text()[-2000:]}")
        for line in log.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event", "").startswith("listening"):
                return json.loads(line)["port"]
        time.sleep(0.2)
    raise RuntimeError("front never listened")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other source tree (its root)")
    parser.add_argument("--imports", type=int, default=15)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": HERE}

    times: dict[str, list[int]] = {name: [] for name in trees}
    modules: dict[str, int] = {}
    for _ in range(args.imports):
        for name, tree in trees.items():
            micros, count = import_micros(tree)
            times[name].append(micros)
            modules[name] = count
    prometheus = [import_micros(HERE, "prometheus_client")[0] for _ in range(args.imports)]

    with tempfile.TemporaryDirectory(prefix="cakemp-footprint-") as tmp:
        work = Path(tmp)
        model = work / "model"
        model.mkdir()
        write_checkpoint(model, SPEC)
        rss = {name: front_rss(tree, model, work, args.requests) for name, tree in trees.items()}

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; import time median of {args.imports} runs each")
    for name in trees:
        median = statistics.median(times[name]) / 1000
        ready, served = rss[name]
        print(f"{name:7s} import cakemp.cli {median:6.1f} ms, {modules[name]} modules; front RSS listening "
              f"{ready / 2**20:5.1f} MiB, after {args.requests} decode requests {served / 2**20:5.1f} MiB")
    ratio = statistics.median(times["after"]) / statistics.median(times["before"])
    print(f"after/before import time {ratio:.2f}x; RSS listening {rss['after'][0] / rss['before'][0]:.2f}x, "
          f"after requests {rss['after'][1] / rss['before'][1]:.2f}x")
    print(f"prometheus_client on top of the front's imports: {statistics.median(prometheus) / 1000:.1f} ms median "
          f"({statistics.median(prometheus) / statistics.median(times['after']):.0%} of cakemp.cli's)")


if __name__ == "__main__":
    main()
