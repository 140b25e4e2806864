"""Device stages benchmark: where a node's device process spends its CPU per decode request, stage by stage.

    python -m bench.device_stages [--counts 1,8,32] [--steps 200] [--rounds 3] [--layers 2] [--hidden 256]

bench/request_cost.py says how much CPU a device spends per request beyond the same step computed
in-process, and py-spy's samples of where; but py-spy with --gil counts only the samples where the
thread holds the GIL, which torch's ops release, so it overstates the device's own Python against
its compute. This counts each stage's thread CPU time instead (time.thread_time around each call):
`cakemp run --gpus cpu:1 --cpu-threads 1 --no-prefix-reuse` over a random Llama of --layers layers
(hidden --hidden, its MLP 3x that, f32) is started with a `sitecustomize` module on its
PYTHONPATH (bench/device_shim.py) that, as the device starts, wraps its stages: receiving (ZeroMQ and the
ipc decode within it), turning a message into tasks, the scheduler, the step (and the runner's
run_batch within it), and sending the step's answers (the ipc encode and ZeroMQ's send within it);
the device writes its sums when sent SIGUSR1. For each count of sessions (bench.pool's masters, as
request_cost's), --rounds windows of --steps decode Batches per session, each followed by the same
step in this process (BlockRunner.run_batch, back to back: request_cost's in-process side); printed
per request, summed over the windows: each stage, what the loop did outside them, the device's
Python thread in all, and run_batch in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from bench.device_shim import shim_environment
from bench.pool import Session, machine_line, start_cakemp
from bench.request_cost import device_pid, in_process_window, shape
from cakemp.compute import tensors
from cakemp.compute.runner import BlockRunner
from tests.support.checkpoints import make_checkpoint

# (stage, the module (and class) its function is in, the function), as the device's loop calls them.
STAGES = (
    ("receive", "channel.DeviceChannel", "receive"), ("ipc decode", "channel", "decode"),
    ("tasks", "service.DeviceService", "tasks"),
    ("scheduler add", "scheduler.Scheduler", "add"), ("scheduler next step", "scheduler.Scheduler", "next_step"),
    ("step", "service.DeviceService", "run_step"), ("run_batch", "runner.BlockRunner", "run_batch"),
    ("send the step's answers", "process", "_send_step"), ("channel send", "channel.DeviceChannel", "send"),
    ("ipc encode", "channel", "encode"),
)
# The stages that run inside another (printed below it, indented).
INSIDE = {"ipc decode": "receive", "run_batch": "step", "channel send": "send the step's answers",
          "ipc encode": "channel send"}

# Run in the device before it loads (bench/device_shim.py): wraps STAGES (the loop looks each of them up
# when it calls it), and the process writes its sums to STAGES_FILE.<pid> on SIGUSR1.
INSTALL = '''
import importlib, json, os, signal, time

STAGES = {stages!r}
sums = {{"thread": 0.0}}


def wrap(owner, name, stage):
    call = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            sums[stage] = sums.get(stage, 0.0) + time.thread_time() - start

    setattr(owner, name, timed)


def install():
    modules = {{"channel": "cakemp.ipc.channel", "service": "cakemp.device.service", "scheduler": "cakemp.device.scheduler",
               "runner": "cakemp.compute.runner", "process": "cakemp.device.process"}}
    for stage, where, name in STAGES:
        module, _, cls = where.partition(".")
        owner = importlib.import_module(modules[module])
        wrap(getattr(owner, cls) if cls else owner, name, stage)

    def dump(signum, frame):
        sums["thread"] = time.thread_time()
        with open(f"{{os.environ['STAGES_FILE']}}.{{os.getpid()}}", "w") as f:
            json.dump(sums, f)

    signal.signal(signal.SIGUSR1, dump)
'''


def start_node(model: Path, work: Path, layers: int) -> tuple:
    """`cakemp run` over every layer with the stage clock in its device (its port, process and stages file)."""
    stages_file = work / "stages"
    env = shim_environment(work / "shim", INSTALL.format(stages=STAGES)) | {"STAGES_FILE": str(stages_file)}
    node, port = start_cakemp(model, work, "cpu:1", "--cpu-threads", "1", "--no-prefix-reuse", layers=layers, env=env)
    return port, node, stages_file


def read_stages(pid: int, stages_file: Path) -> Counter:
    """The device's sums so far (seconds of thread CPU by stage, and its thread's in all)."""
    path = Path(f"{stages_file}.{pid}")
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    for _ in range(500):  # the device writes them between two calls of its loop
        if path.exists() and path.stat().st_size:
            time.sleep(0.01)
            return Counter(json.loads(path.read_text()))
        time.sleep(0.01)
    raise RuntimeError("the device wrote no stage sums")


async def measure(port: int, pid: int, stages_file: Path, runner: BlockRunner, count: int, steps: int,
                  rounds: int) -> tuple[Counter, float]:
    """(the device's seconds by stage, this process's run_batch seconds) over `rounds` windows of `count` sessions."""
    hidden, layers = runner.config.hidden_size, len(runner.layers)
    sessions = [await Session.open(port, hidden, layers) for _ in range(count)]
    spent, in_process = Counter(), 0.0
    for round_ in range(rounds + 1):  # the first warms up
        for session in sessions:
            await session.restart()
        before = read_stages(pid, stages_file)

        async def decode(session: Session) -> None:
            for _ in range(steps):
                await session.step()

        await asyncio.gather(*(decode(session) for session in sessions))
        after = read_stages(pid, stages_file)
        seconds, _ = in_process_window(runner, count, steps)
        if round_:
            after.subtract(before)
            spent.update(after)
            in_process += seconds
    for session in sessions:
        await session.close()
    return spent, in_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,8,32")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_checkpoint(work, "llama", num_hidden_layers=args.layers, **shape(args.hidden))
        runner = BlockRunner.load(model, [f"model.layers.{i}" for i in range(args.layers)], "cpu",
                                  tensors.compute_dtype("f32"), pack_weights=True)
        port, node, stages_file = start_node(model, work, args.layers)
        try:
            pid = device_pid(node.pid)
            figures = {count: asyncio.run(measure(port, pid, stages_file, runner, count, args.steps, args.rounds))
                       for count in [int(c) for c in args.counts.split(",")]}
        finally:
            node.terminate()
            node.wait()
    print(f"\n{args.layers} layers, hidden {args.hidden}, f32, `cakemp run --gpus cpu:1 --cpu-threads 1 --no-prefix-reuse`; "
          f"{args.rounds} windows of {args.steps} decode Batches per session; the device's thread CPU µs per request")
    counts = list(figures)
    print("| stage | " + " | ".join(f"{count} session(s)" for count in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    requests = {count: args.rounds * args.steps * count for count in counts}

    def row(name: str, value) -> None:
        print(f"| {name} | " + " | ".join(f"{value(count) / requests[count] * 1e6:.1f}" for count in counts) + " |")

    def depth(stage: str) -> int:
        return 0 if stage not in INSIDE else 1 + depth(INSIDE[stage])

    for stage, _, _ in STAGES:
        row("&nbsp;&nbsp;" * depth(stage) + ("of which " if stage in INSIDE else "") + stage,
            lambda count, stage=stage: figures[count][0][stage])
    outer = [stage for stage, _, _ in STAGES if stage not in INSIDE]
    row("the loop outside these", lambda count: figures[count][0]["thread"] - sum(figures[count][0][s] for s in outer))
    row("the device's Python thread in all", lambda count: figures[count][0]["thread"])
    row("run_batch in-process, back to back", lambda count: figures[count][1])
    row("the device beyond that", lambda count: figures[count][0]["thread"] - figures[count][1])


if __name__ == "__main__":
    main()
