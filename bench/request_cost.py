"""Request cost benchmark: the CPU time a node spends per decode Batch, process by process.

    python -m bench.request_cost [--steps 200] [--rounds 4] [--counts 1,8] [--layers 2] [--hidden 256]
                                 [--dtype f32] [--profile-seconds 4] [--before DIR] [--prompt 512] [--prompts 10]
                                 [--pin-cpus] [--prefix-reuse] [--idle 0] [--floor] [--wait-all]

Writes a random Llama checkpoint of --layers layers (hidden 256 or --hidden, its MLP 3x that, 4 query heads on
2 kv heads, f32 or --dtype) and starts `cakemp run --gpus cpu:1 --cpu-threads 1 --no-prefix-reuse` over all its
layers (with --pin-cpus, pinned: the device to the first core, the front to the others; with
--prefix-reuse, without --no-prefix-reuse: as a node runs by default, the in-process runner
following its sessions too, under a KV budget of REUSE_BUDGET; with --idle N, N more sessions first
run a 16-row turn, say Goodbye and start another, then wait, connected, while the others are
measured: with prefix reuse, a chat server's idle users, each holding a retired prefix and a live
one). For each
count of sessions (--counts), that many Cake-style masters (bench.pool.Session: an 8-token prompt,
then one decode Batch through every layer per token, in the node's --dtype, as Cake's master sends
it) decode at once, --steps
Batches each per window; between windows every session starts over (a Goodbye and a new prompt,
outside the window), so contexts stay short. CPU time is each thread's sum_exec_runtime
(/proc/<pid>/task/<tid>/schedstat, in ns; utime and stime tick at 10 ms), what the machine's load
does not inflate much, unlike wall time, of the front process and of its device process, over
each window, divided by the requests in it (and, from each node's /metrics, the requests its device ran
a step: the in-process side runs every session in each step). Each window is followed by the same compute in this
process: BlockRunner.run_batch over the same layers (loaded as the node's device loads them: f32
weights packed, prefix reuse as the node has it, this process's loaded objects then frozen as a
device's are), one torch thread, on the same number of sessions' one-token
requests, its CPU time (time.process_time) per request. It is timed twice: steps back to back, and
steps each after IDLE_S asleep, as the node's device runs them (see there). --rounds windows of each, alternating;
figures are sums over all of them. The node's decode rate over in-process is the back-to-back steps' wall
time over the node's windows' (the same requests): what the masters get of the batched computation
through a node. Each process's CPU time is also split by thread: its main
thread, and ZeroMQ's I/O threads (ZMQbg/IO/0), whose work (moving frames between sockets) py-spy
does not see.

Then, for each count, a profile of each live process while the sessions decode: py-spy record
--format raw --nonblocking --gil on the front's pid and the device's, --profile-seconds each, both
at once; each sample is put in the stage of its innermost frame that some rule of STAGES names
(the file it is in), and each stage's share of the samples times the CPU µs per request of the
process's main thread (where its Python runs) is printed as its µs per request, then each
process's --top innermost frames and their shares. With --gil, py-spy counts only samples of the
thread holding the GIL, so a share is a share of the Python thread's own work: without it, a
thread preempted inside a syscall was counted as running there (a ZeroMQ send, whose write to its
I/O thread's eventfd let that thread run first, took ~200 µs of wall time for ~25 µs of CPU and
showed as half the front's samples).

Then --prompts prompts of --prompt tokens (0: none), each a fresh session's one Batch from
position 0 through every layer, through each node and in this process, taking turns: the wall
time a master waits for each, and the node's CPU time (front and device) for it, beside the same
prompt run in-process (BlockRunner.run, CPU time of this process) whole and in the node's
--prefill-chunk pieces (128 tokens, `chunk_bounds`), medians over the prompts.

With --floor, bench/front_floor.py's floor front (TCP, the Cake codec and ZeroMQ to an echo device,
and nothing else of the front) is measured beside the nodes the same way, and the front's CPU per
request is printed over it: what the front's own Python costs; its prompts too, which its echo answers
after its one busy step (FLOOR_BUSY_S): what carrying a prompt's activation there and back costs.

With --before DIR (a checkout of an earlier commit, e.g. `git archive <commit> | tar -x -C DIR`),
a second node runs from DIR (PYTHONPATH=DIR) beside this tree's, its windows taking turns with
this tree's in every round, and its front and device CPU per request are printed beside them
(profiles are of this tree's node only).

With --wait-all, another node of this tree runs beside it the same way, its device patched (through
bench/device_shim.py) to wait, between steps, up to WAIT_ALL_S for every session of its last step, where
device/scheduler.py's Gathering waits only as long as a step's fixed cost: what steps as full as there are
sessions would save of the CPU per request, against the decode rate they cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from bench.batching import batch_size_totals
from bench.device_shim import shim_environment
from bench.front_floor import Floor
from bench.pool import MAX_POSITIONS, REUSE_BUDGET, Session, free_port, machine_line, raw, start_cakemp
from bench.route import children
from cakemp import heap
from cakemp.compute import tensors
from cakemp.compute.runner import BlockRunner, Request
from cakemp.dtypes import COMPUTE_DTYPES
from cakemp.ipc.spec import PREFILL_CHUNK, chunk_bounds
from cakemp.wire import DType
from tests.support.checkpoints import make_checkpoint

LAYERS = 2  # the default of --layers
HIDDEN = 256  # the default of --hidden


def shape(hidden: int) -> dict[str, int]:
    """The checkpoint's shape at `hidden` (the MLP 3x wider, 4 query heads on 2 kv heads)."""
    return dict(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=MAX_POSITIONS)


SHAPE = shape(HIDDEN)
NODE_ARGS = ("--cpu-threads", "1", "--no-prefix-reuse")
# --wait-all: a node whose device, between steps, waits up to WAIT_ALL_S for every session of its last step
# (device/scheduler.py's Gathering waits only as long as a step's fixed cost, for those that came back in
# time before): steps as full as the sessions, against the rate that costs (bench/device_shim.py).
WAIT_ALL_NODE = "waiting for every session"
WAIT_ALL = '''
WAIT_ALL_S = 0.010


def install():
    from cakemp.device.scheduler import Gathering

    stepped = Gathering.stepped

    def waiting_for_all(self, sessions, step_s, now, decodes=None):
        stepped(self, sessions, step_s, now, decodes)
        self.window_s = WAIT_ALL_S

    Gathering.stepped = waiting_for_all
    Gathering.awaited = lambda self: set(self._answered)
'''
# The in-process steps are timed twice: back to back, and idle this long before each, as a node's
# device is between a step's answer and the next request (about a master's round trip at one
# session): a step started cold (caches taken by the front and the master meanwhile, the core
# idle) costs more CPU than one run straight after the last.
IDLE_S = 0.001
FLOOR = "floor"  # the floor front's name among the measured nodes (--floor)
FLOOR_BUSY_S = 0.001  # its echo device's busy work a step: about a decode step's compute at one session here

# (stage, the path fragments of the files whose frames belong to it), tried in this order on each
# frame from the innermost out: a sample is the stage of the first frame a rule names.
STAGES = (
    ("frame read/write (wire/frames)", ("cakemp/wire/frames",)),
    ("wire decode/encode", ("cakemp/wire/",)),
    ("admission", ("admission", "buffer_budget")),
    ("routing", ("cakemp/front/router",)),
    ("ipc codec", ("cakemp/ipc/codec", "cakemp/ipc/message")),
    ("ipc send/receive (ZeroMQ)", ("cakemp/ipc/channel", "zmq/")),
    ("metrics", ("metrics", "prometheus", "cakemp/front/stats")),
    ("logging", ("logging/", "cakemp/log.py")),
    ("tracing", ("cakemp/ipc/trace", "cakemp/front/tracing")),
    ("scheduler", ("cakemp/device/scheduler",)),
    ("tensor conversion", ("cakemp/compute/tensors",)),
    ("compute (runner, blocks, torch)", ("cakemp/compute/", "cakemp/model/", "torch/")),
    ("device loop (process, service)", ("cakemp/device/",)),
    ("front: connection, session, pool", ("cakemp/front/",)),
    ("socket I/O (asyncio transports)", ("asyncio/selector_events", "asyncio/streams")),
    ("select (epoll)", ("selectors",)),
    ("event loop", ("asyncio/",)),
)


def device_pid(front: int) -> int:
    """The front's device process (its one spawned child that is not multiprocessing's resource tracker)."""
    for pid in children(front):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("the node has no device process")


def thread_seconds(pids: dict[str, int]) -> Counter:
    """CPU seconds of every thread of the processes in `pids`, summed by process and thread name
    ("front" and "front ZMQbg/IO/0", say: the Python thread's name is the process's own), and each
    process's in all ("front (process)"): the scheduler's own count of the time each ran
    (sum_exec_runtime in /proc/<pid>/task/<tid>/schedstat, in ns; utime and stime tick at 10 ms)."""
    seconds = Counter()
    for name, pid in pids.items():
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                thread = (task / "comm").read_text().strip()
                ran = int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:  # the thread ended meanwhile
                continue
            seconds[name if task.name == str(pid) else f"{name} {thread}"] += ran
            seconds[f"{name} (process)"] += ran
    return seconds


RAN = ("requests run", "steps run")  # what a node's devices ran, from its /metrics


def devices_ran(metrics: int | None) -> Counter:
    """The requests and steps a node's devices have run so far (RAN), from its `metrics` port (None: nothing)."""
    return Counter() if metrics is None else Counter(dict(zip(RAN, batch_size_totals(metrics))))


async def node_window(sessions: list[Session], steps: int, pids: dict[str, int], metrics: int | None = None) -> Counter:
    """CPU seconds of each process in `pids`, and of each of its threads by name, while every
    session decodes `steps` Batches at once; with the node's `metrics` port, the requests and steps its
    devices ran meanwhile (RAN), read outside the window (the front serves /metrics)."""
    for session in sessions:
        await session.restart()
    ran = devices_ran(metrics)
    threads, start = thread_seconds(pids), time.perf_counter()

    async def decode(session: Session) -> None:
        for _ in range(steps):
            await session.step()

    await asyncio.gather(*(decode(session) for session in sessions))
    wall = time.perf_counter() - start
    spent = thread_seconds(pids)
    spent.subtract(threads)
    spent["wall"] = wall
    spent.update(devices_ran(metrics))
    spent.subtract(ran)
    return spent


def in_process_window(runner: BlockRunner, count: int, steps: int, idle_s: float = 0.0) -> tuple[float, float]:
    """CPU seconds of this process for `steps` run_batch steps over `count` sessions' one-token requests,
    idle `idle_s` before each (sleeping: no CPU); and their wall seconds, the sleeps left out."""
    layers = runner.layers
    sessions = range(1, count + 1)
    with torch.inference_mode():
        for session in sessions:
            runner.free_session(session)
            runner.run(session, torch.randn(1, 8, runner.config.hidden_size).to(runner.dtype),
                       runner.ops([(layer, 0, i) for i, layer in enumerate(layers)]))
        inputs = [[torch.randn(1, 1, runner.config.hidden_size).to(runner.dtype) for _ in sessions] for _ in range(steps)]
        start, wall = time.process_time(), 0.0
        for position, xs in enumerate(inputs, 8):
            time.sleep(idle_s)
            began = time.perf_counter()
            ops = runner.ops([(layer, position, i) for i, layer in enumerate(layers)])
            runner.run_batch([Request(session, x, ops) for session, x in zip(sessions, xs)])
            wall += time.perf_counter() - began
        return time.process_time() - start, wall


async def measure(nodes: dict[str, tuple[int, dict[str, int]]], runner: BlockRunner, counts: list[int], steps: int,
                  rounds: int, idle: int = 0, metrics: dict[str, int] | None = None) -> dict[str, dict[int, dict[str, float]]]:
    """{node: {count: {process: CPU µs per request}}} for each node (its port and pids) and "in-process",
    their windows taking turns; `idle` sessions connected to each node meanwhile, having said Goodbye once.
    Where a node's `metrics` port is given, its "requests a step": the requests its devices ran per step."""
    metrics = metrics or {}
    hidden, wire = runner.config.hidden_size, tensors.wire_dtype(runner.dtype)
    waiting = [await idle_session(port, hidden, len(runner.layers), wire) for port, _ in nodes.values() for _ in range(idle)]
    figures = {name: {} for name in nodes}
    for count in counts:
        sessions = {name: [await Session.open(port, hidden, len(runner.layers), wire) for _ in range(count)]
                    for name, (port, _) in nodes.items()}
        for name, (_, pids) in nodes.items():
            await node_window(sessions[name], 5, pids)  # warm-up
        in_process_window(runner, count, 5)
        totals = {name: Counter() for name in nodes}
        for _ in range(rounds):
            for name, (_, pids) in nodes.items():
                totals[name].update(await node_window(sessions[name], steps, pids, metrics.get(name)))
            in_process, in_process_wall = in_process_window(runner, count, steps)
            idle, _ = in_process_window(runner, count, steps, IDLE_S)
            for name in nodes:
                totals[name]["in-process"] += in_process
                totals[name]["in-process wall"] += in_process_wall
                totals[name]["in-process idle"] += idle
        for session in (session for group in sessions.values() for session in group):
            await session.close()
        for name in nodes:
            ran = {key: totals[name].pop(key) for key in RAN if key in totals[name]}
            walls = totals[name].pop("wall"), totals[name].pop("in-process wall")
            figures[name][count] = {key: seconds / (rounds * steps * count) * 1e6 for key, seconds in totals[name].items()}
            figures[name][count]["rate over in-process"] = walls[1] / walls[0]  # the same requests in each
            if ran.get("steps run"):
                figures[name][count]["requests a step"] = ran["requests run"] / ran["steps run"]
    for session in waiting:
        await session.close()
    return figures


async def idle_session(port: int, hidden: int, layers: int, wire: DType) -> Session:
    """A session that ran a 16-row turn (its prompt and 8 decode steps), said Goodbye and started another."""
    session = await Session.open(port, hidden, layers, wire)
    for _ in range(8):
        await session.step()
    await session.restart()
    return session


def in_process_prompt(runner: BlockRunner, x: torch.Tensor, chunked: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of x ([1, T, H]) through every layer from position 0 in this process: whole, or
    in the node's chunks one after another."""
    layers = runner.layers
    runner.free_session(1)
    bounds = chunk_bounds(x.shape[1], PREFILL_CHUNK) if chunked else ((0, x.shape[1]),)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for a, b in bounds:
            runner.run(1, x[:, a:b], runner.ops([(layer, a, i) for i, layer in enumerate(layers)]))
    return time.perf_counter() - start, time.process_time() - cpu


async def prompts(nodes: dict[str, tuple[int, dict[str, int]]], runner: BlockRunner, tokens: int,
                  count: int) -> dict[str, dict[str, float]]:
    """{node or in-process way: {"wall": median s, "cpu": median s}} of `count` prompts of `tokens`
    tokens each, through each node (its front and device CPU) and in-process, taking turns."""
    hidden, wire = runner.config.hidden_size, tensors.wire_dtype(runner.dtype)
    sessions = {name: await Session.open(port, hidden, len(runner.layers), wire) for name, (port, _) in nodes.items()}
    times = {name: {"wall": [], "cpu": []} for name in [*nodes, "in-process whole", "in-process in chunks"]}
    layers = [(layer, 0, i) for i, layer in enumerate(runner.layers)]
    for round_ in range(count + 1):  # the first round warms up
        x = torch.randn(1, tokens, hidden)
        sent = raw(x, wire)  # as the master holds it: its conversion is not the node's time
        for name, (_, pids) in nodes.items():
            session = sessions[name]
            await session.clients[0].goodbye()
            before = thread_seconds(pids)
            start = time.perf_counter()
            await session.clients[0].batch(sent, layers)
            wall = time.perf_counter() - start
            if round_:
                times[name]["wall"].append(wall)
                spent = thread_seconds(pids)
                times[name]["cpu"].append(sum(spent[f"{process} (process)"] - before[f"{process} (process)"]
                                              for process in pids))
        for name, chunked in (("in-process whole", False), ("in-process in chunks", True)):
            wall, cpu = in_process_prompt(runner, x.to(runner.dtype), chunked)
            if round_:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
    for session in sessions.values():
        await session.close()
    return {name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in times.items()}


def print_prompts(figures: dict[str, dict[str, float]], tokens: int, count: int) -> None:
    whole = figures["in-process whole"]
    print(f"\na {tokens}-token prompt (one Batch from position 0 through every layer), median of {count}: ms, "
          "and its ratio to the same prompt in-process whole")
    print("| way | wall ms | wall ratio | CPU ms | CPU ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, cost in figures.items():
        print(f"| {name} | {cost['wall'] * 1e3:.2f} | {cost['wall'] / whole['wall']:.2f} | {cost['cpu'] * 1e3:.2f} | "
              f"{cost['cpu'] / whole['cpu']:.2f} |")


async def profile(port: int, pids: dict[str, int], count: int, hidden: int, layers: int, wire: DType, seconds: int,
                  workdir: Path) -> dict[str, tuple[Counter, Counter]]:
    """{process: samples by stage, and by innermost frame} from py-spy on each live process while `count`
    sessions decode through `layers` layers."""
    sessions = [await Session.open(port, hidden, layers, wire) for _ in range(count)]
    outputs = {name: workdir / f"{name}.raw" for name in pids}
    spies = [subprocess.Popen(["py-spy", "record", "--format", "raw", "--nonblocking", "--gil", "--rate", "500",
                               "--duration", str(seconds), "--pid", str(pid), "--output", str(outputs[name])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()]

    async def decode(session: Session) -> None:
        while any(spy.poll() is None for spy in spies):
            await session.step()
            if session.position > 200:
                await session.restart()

    await asyncio.gather(*(decode(session) for session in sessions))
    for session in sessions:
        await session.close()
    return {name: stages(path.read_text()) for name, path in outputs.items()}


def stages(raw: str) -> tuple[Counter, Counter]:
    """Samples by stage, and by innermost frame, from py-spy's raw output: lines of `frame;frame;... count`,
    outermost first."""
    by_stage, by_frame = Counter(), Counter()
    for line in raw.splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = stack.split(";")
        by_stage[stage(frames)] += int(samples)
        by_frame[frames[-1]] += int(samples)
    return by_stage, by_frame


def stage(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, paths in STAGES:
            if any(path in frame for path in paths):
                return name
    return "other"


def print_profile(profiled: dict[str, tuple[Counter, Counter]], per_request: dict[str, float], count: int,
                  top: int) -> None:
    samples = {name: by_stage for name, (by_stage, _) in profiled.items()}
    names = list(samples)
    print(f"\nprofile at {count} session(s), by stage: share of each process's samples, and that share of its "
          "main thread's CPU µs per request")
    print("| stage | " + " | ".join(f"{name} % | {name} µs" for name in names) + " |")
    print("|---|" + "---:|---:|" * len(names))
    rows = sorted({stage for counts in samples.values() for stage in counts},
                  key=lambda stage: -max(counts[stage] / max(sum(counts.values()), 1) for counts in samples.values()))
    for row in rows:
        cells = []
        for name in names:
            share = samples[name][row] / max(sum(samples[name].values()), 1)
            cells.append(f"{share * 100:.1f} | {share * per_request[name]:.0f}")
        print(f"| {row} | " + " | ".join(cells) + " |")
    print("samples: " + ", ".join(f"{name} {sum(counts.values())}" for name, counts in samples.items()))
    for name, (by_stage, by_frame) in profiled.items():
        total = max(sum(by_stage.values()), 1)
        print(f"{name}'s innermost frames: " + "; ".join(f"{frame} {n / total * 100:.1f}%"
                                                        for frame, n in by_frame.most_common(top)))


def print_beside(other: str, theirs: dict[int, dict[str, float]], ours: dict[int, dict[str, float]]) -> None:
    """Another node's front and device CPU µs per request beside this tree's, and this tree's over the other's."""
    print(f"\n{other} against this tree, CPU µs per request, measured in the same rounds (ratio: this tree's over the other's)")
    print("| sessions | front, other | this tree | ratio | device, other | this tree | ratio "
          "| device beyond in-process, other | this tree | the node's requests a step, other | this tree "
          "| decode rate over in-process, other | this tree |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count in ours:
        old, new = theirs[count], ours[count]
        front_old, front_new = old["front (process)"], new["front (process)"]
        device_old, device_new = old["device (process)"], new["device (process)"]
        beyond = [cost["device (process)"] - cost["in-process"] for cost in (old, new)]
        steps = [cost.get("requests a step", float("nan")) for cost in (old, new)]
        print(f"| {count} | {front_old:.0f} | {front_new:.0f} | {front_new / front_old:.3f} | "
              f"{device_old:.0f} | {device_new:.0f} | {device_new / device_old:.3f} | {beyond[0]:+.0f} | {beyond[1]:+.0f} | "
              f"{steps[0]:.1f} | {steps[1]:.1f} | {old['rate over in-process']:.2f} | {new['rate over in-process']:.2f} |")


def print_floor(figures: dict[int, dict[str, float]], floor: dict[int, dict[str, float]]) -> None:
    """This tree's front against the floor front's (the least a front of this design costs), CPU µs per request."""
    print(f"\nthe front against the floor front (bench/front_floor.py: TCP, the Cake codec and ZeroMQ alone, "
          f"its echo device busy {FLOOR_BUSY_S * 1e3:g} ms a step), CPU µs per request, measured in the same rounds")
    print("| sessions | front | floor front | front over the floor | floor's ZeroMQ I/O thread |")
    print("|---:|---:|---:|---:|---:|")
    for count, cost in figures.items():
        front, least = cost["front (process)"], floor[count]["front (process)"]
        print(f"| {count} | {front:.0f} | {least:.0f} | {front - least:+.0f} | {floor[count].get('front ZMQbg/IO/0', 0):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="decode Batches per session per window")
    parser.add_argument("--rounds", type=int, default=4, help="windows per count (node and in-process alternating)")
    parser.add_argument("--counts", default="1,8", help="concurrent sessions to measure")
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers of the model, all served by the node")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the model's hidden size (its MLP 3x that)")
    parser.add_argument("--dtype", choices=COMPUTE_DTYPES, default="f32", help="the node's --dtype, and the in-process side's")
    parser.add_argument("--profile-seconds", type=int, default=4, help="py-spy's time on each process; 0: none")
    parser.add_argument("--top", type=int, default=10, help="innermost frames listed per process")
    parser.add_argument("--prompt", type=int, default=512, help="tokens of the prompt measured (0, or --prompts 0: none)")
    parser.add_argument("--prompts", type=int, default=10, help="prompts measured through each node and in-process")
    parser.add_argument("--before", type=Path, help="checkout of an earlier commit, whose node runs beside this tree's")
    parser.add_argument("--pin-cpus", action="store_true", help="start the nodes with --pin-cpus")
    parser.add_argument("--prefix-reuse", action="store_true", help="start the nodes with prefix reuse, as by default")
    parser.add_argument("--idle", type=int, default=0, help="sessions connected to each node, idle, while it is measured")
    parser.add_argument("--floor", action="store_true", help="measure bench/front_floor.py's floor front beside the nodes")
    parser.add_argument("--wait-all", action="store_true",
                        help="beside this tree's node, one whose device waits for every session of its last step")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    node_args = tuple(arg for arg in NODE_ARGS if not (args.prefix_reuse and arg == "--no-prefix-reuse")) + \
        (("--pin-cpus",) if args.pin_cpus else ()) + ("--dtype", args.dtype)
    torch.set_num_threads(1)
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_checkpoint(work, "llama", num_hidden_layers=args.layers, **shape(args.hidden))
        layers = [f"model.layers.{i}" for i in range(args.layers)]
        runner = BlockRunner.load(model, layers, "cpu", tensors.compute_dtype(args.dtype), pack_weights=True,
                                  prefix_reuse=args.prefix_reuse,
                                  kv_budget_bytes=REUSE_BUDGET if args.prefix_reuse else None)
        # As a device once loaded: the in-process side collects only what it allocates, and reuses the
        # memory a prompt freed.
        heap.keep_freed_memory()
        heap.freeze_loaded()
        # Each node: the checkout it runs from (None: this one) and its environment besides.
        trees = {"this tree": (None, None)}
        if args.before is not None:
            trees = {f"before ({args.before.name})": (args.before.resolve(), None), **trees}
        if args.wait_all:
            trees[WAIT_ALL_NODE] = (None, shim_environment(work / "wait-all", WAIT_ALL))
        metrics = {name: free_port() for name in trees}  # each node's: the requests its device runs a step
        started = {name: start_cakemp(model, work, "cpu:1", *node_args, "--metrics-address", f"127.0.0.1:{metrics[name]}",
                                      layers=args.layers, source=tree, env=env)
                   for name, (tree, env) in trees.items()}
        floor = Floor(work, FLOOR_BUSY_S) if args.floor else None
        try:
            nodes = {name: (port, {"front": node.pid, "device": device_pid(node.pid)})
                     for name, (node, port) in started.items()}
            measured = nodes | ({FLOOR: (floor.port, floor.pids)} if floor else {})
            by_node = asyncio.run(measure(measured, runner, counts, args.steps, args.rounds, args.idle, metrics))
            floor_figures = by_node.pop(FLOOR, None)
            prompt = asyncio.run(prompts(measured, runner, args.prompt, args.prompts)) if args.prompt and args.prompts else None
            figures = by_node["this tree"]
            port, pids = nodes["this tree"]
            samples = {count: asyncio.run(profile(port, pids, count, args.hidden, args.layers, tensors.wire_dtype(runner.dtype),
                                                    args.profile_seconds, work))
                       for count in counts if args.profile_seconds}
        finally:
            for node, _ in started.values():
                node.terminate()
                node.wait()
            if floor is not None:
                floor.stop()
    print(f"\n{args.layers} layers, hidden {args.hidden}, {args.dtype}, `cakemp run --gpus cpu:1 {' '.join(node_args)}`; "
          f"{args.rounds} windows of {args.steps} decode Batches per session" +
          (f", {args.idle} idle sessions connected" if args.idle else "") + "; CPU µs per request")
    print(f"| sessions | front | device | in-process run_batch | device beyond in-process | in-process, {IDLE_S * 1e3:g} ms "
          "idle before each step | device beyond that | the node's requests a step | the node's decode rate over in-process |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count, cost in figures.items():
        front, device, hot, idle = (cost[key] for key in ("front (process)", "device (process)", "in-process",
                                                          "in-process idle"))
        print(f"| {count} | {front:.0f} | {device:.0f} | {hot:.0f} | {device - hot:+.0f} | {idle:.0f} | {device - idle:+.0f} | "
              f"{cost.get('requests a step', float('nan')):.1f} | {cost['rate over in-process']:.2f} |")
    print("by thread (the unnamed one is the process's Python thread; ZMQbg: ZeroMQ's I/O threads), µs per request: "
          + "; ".join(f"{count} session(s): " + ", ".join(f"{name} {value:.0f}" for name, value in sorted(cost.items())
                                                          if "(process)" not in name and not name.startswith("in-process")
                                                          and name not in ("requests a step", "rate over in-process"))
                      for count, cost in figures.items()))
    for name in by_node:
        if name != "this tree":
            print_beside(name, by_node[name], figures)
    if floor_figures is not None:
        print_floor(figures, floor_figures)
    if prompt is not None:
        print_prompts(prompt, args.prompt, args.prompts)
    for count, by_process in samples.items():
        print_profile(by_process, {name: figures[count][name] for name in pids}, count, args.top)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
