"""Route benchmark: a Batch whose layers span two device processes, against one process.

    python -m bench.route [--base DIR] [--chunks 32,64,128] [--steps 200] [--prefills 3]
    python -m bench.route --breakdown [--steps 200] [--prefills 5] [--node-args "..."]   (bench/breakdown.py)

Writes a random 8-layer Llama checkpoint (hidden 1024, f32) and starts, side by side in one
run: bench/single_worker.py (the same layers in one process, one torch thread: Cake's
design), `cakemp run --gpus cpu:2 --cpu-threads 1` from this tree once per --prefill-chunk
value, and, with --base, the same command from another checkout (a git worktree of the
commit before the change) for "today's" figures (node and master: bench/route_node.py). A
Cake-style master then measures, the workers alternating:

1. decode: round trip of a [1, 1, 1024] Batch through all 8 layers (4 per device), p50 and
   p99 over --steps steps each, in blocks of 25; each worker's p50 extra over the single
   process; and the CPU time its processes spent per step (user + system, from /proc: what
   the machine's load does not inflate much, unlike wall time);
2. prefill: a 512-token Batch at position 0 through all 8 layers, --prefills times each,
   median; and its ratio to the single process (the median over rounds, then each round's);
3. the hops alone: two echoing device processes (no torch) that each busy-wait `--busy-us`
   per request, a [1, 1, 1024] f32 activation sent through both as a route (front → 0 → 1 →
   front, three one-way hops) and as two requests one after the other (front → 0 → front → 1
   → front, four, as before the change); p50 and p99 above the busy time.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
from pathlib import Path

from bench import breakdown
from bench.pool import alternate, busy, machine_line, pct, start_single
from bench.route_node import HIDDEN, LAYERS, MAX_POSITIONS, PROMPT, Master, start_node
from cakemp.ipc import Activation, Answers, DeviceChannel, FrontChannel, Hop, Hops, Op, Stage
from tests.support.checkpoints import make_checkpoint

BLOCK = 25


def children(pid: int) -> list[int]:
    """The pids of `pid`'s children (a node's device processes, and multiprocessing's resource tracker)."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def process_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` alone (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its children (a node's front and device processes)."""
    return sum(process_seconds(one) for one in [pid, *children(pid)])


async def measure(ports: dict[str, int], pids: dict[str, int], steps: int, prefills: int) -> tuple[dict, dict, dict]:
    masters = {name: await Master.open(port) for name, port in ports.items()}
    for master in masters.values():  # warm-up: first prompt, a few decode steps
        await master.prompt()
        for _ in range(5):
            await master.batch(1)
    # One list per round (a block of decode steps, or one prompt, from every worker in turn), so
    # that each worker can also be compared with the single process within the same round.
    decode = {name: [] for name in ports}
    cpu = {name: 0.0 for name in ports}  # CPU seconds the worker's processes spent on the decode steps
    for _ in range(steps // BLOCK):
        for name, master in masters.items():
            before = cpu_seconds(pids[name])
            decode[name].append([await master.batch(1) * 1e3 for _ in range(BLOCK)])
            cpu[name] += cpu_seconds(pids[name]) - before
    prefill = {name: [] for name in ports}
    for _ in range(prefills):
        for name, master in masters.items():
            prefill[name].append(await master.prompt() * 1e3)
    for master in masters.values():
        await master.client.close()
    return decode, prefill, cpu


def echo_device(endpoint: str, peers: tuple[str, ...], parent_pipe, busy_s: float) -> None:
    """A device process that busy-waits `busy_s` per Hop, then hands it on or answers the front."""
    channel = DeviceChannel(endpoint, parent_pipe.fileno(), peers)
    while (messages := channel.receive()) is not None:
        for message in messages:
            (hop,) = message.hops
            busy(busy_s)
            rest = hop.stages[1:]
            if rest:
                channel.hand_off(rest[0].device, Hops((Hop(hop.session, hop.request_id, hop.dtype, hop.nbytes, 0, 1,
                                                           hop.shape, rest),), message.data))
            else:
                channel.send(Answers((Activation(hop.request_id, hop.dtype, hop.nbytes, 0, hop.shape),),
                                     data=message.data))


async def hops(workdir: Path, steps: int, busy_s: float) -> dict[str, list[float]]:
    """µs above 2 x busy_s of one activation through two echoing devices, routed and relayed, blocks alternating."""
    context = multiprocessing.get_context("spawn")
    endpoints = tuple(f"ipc://{workdir}/echo-{i}" for i in range(2))
    replies: asyncio.Queue = asyncio.Queue()
    channels = [FrontChannel(endpoint, replies.put_nowait, lambda error: None) for endpoint in endpoints]
    children, pipes = [], []
    for endpoint in endpoints:
        reader, writer = context.Pipe(duplex=False)
        child = context.Process(target=echo_device, args=(endpoint, endpoints, reader, busy_s), daemon=True)
        child.start()
        children.append(child)
        pipes.append(writer)
    body = memoryview(bytearray(HIDDEN * 4))
    stage = [Stage.of(i, 1, (Op(0, 0, 0),)) for i in range(2)]

    async def routed(i: int) -> None:
        await channels[0].send(Hops((Hop(1, i, 0, body.nbytes, 0, 1, (1, 1, HIDDEN), (stage[0], stage[1])),), body))
        await replies.get()

    async def relayed(i: int) -> None:
        data = body
        for device in range(2):
            await channels[device].send(Hops((Hop(1, i, 0, body.nbytes, 0, 1, (1, 1, HIDDEN), (stage[device],)),), data))
            data = (await replies.get()).data

    times = await alternate({"routed: front → 0 → 1 → front": routed, "relayed: front → 0 → front → 1 → front": relayed},
                            steps, 2 * busy_s, BLOCK)
    for child in children:
        child.terminate()
        child.join()
    for channel, pipe in zip(channels, pipes):
        channel.close()
        pipe.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=Path, help="checkout of the commit to compare with (e.g. a git worktree)")
    parser.add_argument("--chunks", default="32,64,128", help="--prefill-chunk values to run this tree with")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefills", type=int, default=3)
    parser.add_argument("--busy-us", type=float, default=12000.0, help="each echo device's busy time (part 3)")
    parser.add_argument("--hops-only", action="store_true", help="part 3 only")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead: where a decode Batch's time goes, stage by stage (bench/breakdown.py)")
    parser.add_argument("--node-args", default="", help="more `cakemp run` flags for the node (with --breakdown)")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    print(machine_line())
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.hops_only:
            print_hops(asyncio.run(hops(work, args.steps, args.busy_us / 1e6)), args)
            return
        model = make_checkpoint(work, "llama", num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2816,
                                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS)
        if args.breakdown:
            breakdown.run(model, work, args.steps, BLOCK, args.prefills, tuple(args.node_args.split()))
            print(f"load average {os.getloadavg()[0]:.1f} at the end")
            return
        try:
            single, single_port = start_single(model, threads=1, layers=LAYERS)
            processes.append(single)
            ports = {"single process, 1 thread": single_port}
            pids = {"single process, 1 thread": single.pid}
            if args.base is not None:
                name = f"cakemp {args.base.name} cpu:2"
                process, ports[name] = start_node(model, work, args.base.resolve())
                processes.append(process)
                pids[name] = process.pid
            for chunk in args.chunks.split(","):
                name = f"cakemp cpu:2, chunk {chunk}"
                process, ports[name] = start_node(model, work, here, "--prefill-chunk", chunk)
                processes.append(process)
                pids[name] = process.pid
            decode, prefill, cpu = asyncio.run(measure(ports, pids, args.steps, args.prefills))
        finally:
            for process in processes:
                process.terminate()
                process.wait()
    single_name = next(iter(ports))
    single_blocks, single_prompts = decode[single_name], prefill[single_name]
    print(f"\n{LAYERS} layers, hidden {HIDDEN}, f32; cakemp: 4 layers on each of 2 device processes, 1 torch thread "
          f"each; decode {args.steps} steps each in blocks of {BLOCK}, prefill {PROMPT} tokens x {args.prefills} "
          f"each, workers alternating")
    print("decode extra: median over rounds of (block p50 - the single process's block p50 in the same round); "
          "prefill ratio: median over rounds of (prompt time / the single process's in the same round)")
    print("| worker | decode p50 ms | p99 ms | decode extra over one process, ms | CPU ms per decode step | "
          "prefill 512 ms (median) | prefill vs one process |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ports:
        steps_ms = [t for block in decode[name] for t in block]
        extra = statistics.median(pct(mine, 50) - pct(theirs, 50) for mine, theirs in zip(decode[name], single_blocks))
        ratio = statistics.median(mine / theirs for mine, theirs in zip(prefill[name], single_prompts))
        print(f"| {name} | {pct(steps_ms, 50):.2f} | {pct(steps_ms, 99):.2f} | {extra:+.2f} | "
              f"{cpu[name] / len(steps_ms) * 1e3:.1f} | {statistics.median(prefill[name]):.0f} | {ratio:.2f}x |")
    for name in list(ports)[1:]:
        rounds = " ".join(f"{mine / theirs:.3f}" for mine, theirs in zip(prefill[name], single_prompts))
        print(f"prefill rounds, {name} / single process: {rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        print_hops(asyncio.run(hops(Path(tmp), args.steps, args.busy_us / 1e6)), args)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def print_hops(times: dict[str, list[float]], args) -> None:
    print(f"\nthe hops alone: [1, 1, {HIDDEN}] f32 through 2 echoing device processes busy {args.busy_us:.0f} µs each; "
          f"{args.steps} round trips each, blocks of {BLOCK} alternating; µs above the busy time")
    print("| way | p50 µs | p99 µs |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {pct(values, 50):.0f} | {pct(values, 99):.0f} |")


if __name__ == "__main__":
    main()
