"""Codec benchmark: encode and decode of a decode-size and a prefill-size Batch.

    python -m bench.codec [--before DIR] [--rounds 3]

Both Batches carry 16 layer ops (one worker serving 16 layers): the decode step's hidden
state is [1, 1, 4096] f16 (8 KiB), the prefill's [1, 512, 4096] f16 (4 MiB). The decode
ratio (prefill / decode-size, decode_payload only) is ≈ 1 when decoding does not copy the
tensor bytes. encode_frame's is ≈ 1 too (the tensor goes to the writer by reference);
encode_payload joins everything into one bytes object and FrameDecoder copies what it is fed
into its buffer once, so theirs grow with the tensor, as any single-buffer path must.

With --before DIR (a checkout of an earlier commit), the decode-size Batch's operations and a
TensorMessage's (what a node decodes and encodes per decode request), and the ipc messages of a
device step of STEP such requests (the front's Hops to its device, the device's Answers back, each
encoded at one end and decoded at the other) are timed in this tree and in DIR's, each in a process
of its own, the trees taking turns for --rounds rounds; printed: each tree's best msg/s and this
tree's time over DIR's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

from cakemp import ipc
from cakemp.wire import (
    Batch,
    DType,
    FrameDecoder,
    LayerOp,
    RawTensor,
    Revision,
    TensorMessage,
    decode_payload,
    encode_frame,
    encode_payload,
)

HIDDEN = 4096
REVISION = Revision.V2
STEP = 16  # requests in the device step whose ipc messages are timed


def batch(seq_len: int) -> Batch:
    x = RawTensor(bytes(seq_len * HIDDEN * 2), DType.F16, (1, seq_len, HIDDEN))
    return Batch(x, tuple(LayerOp(f"model.layers.{i}", 0, i) for i in range(16)))


def operations(msg: Batch) -> dict[str, Callable[[], object]]:
    payload = encode_payload(msg, REVISION)
    frame = b"".join(encode_frame(msg, REVISION))

    def frame_decoder() -> None:
        decoder = FrameDecoder(REVISION)
        decoder.feed(frame)
        decoder.next_message()

    return {
        "encode_frame": lambda: encode_frame(msg, REVISION),
        "encode_payload": lambda: encode_payload(msg, REVISION),
        "decode_payload": lambda: decode_payload(payload, REVISION),
        "FrameDecoder": frame_decoder,
    }


def side_by_side(small: Callable[[], object], large: Callable[[], object], repeat: int = 7) -> tuple[float, float]:
    """Calls per second of each, best of `repeat` runs of about 0.2 s, the two runs taken in
    turn so that load from other processes hits both alike."""
    timers = [timeit.Timer(small), timeit.Timer(large)]
    numbers = [timer.autorange()[0] for timer in timers]
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        best = [min(b, timer.timeit(number)) for b, timer, number in zip(best, timers, numbers)]
    return numbers[0] / best[0], numbers[1] / best[1]


def per_request() -> dict[str, float]:
    """Calls per second of what a node's front does per decode request with the Cake codec (decode
    the decode-size Batch, encode its TensorMessage answer), and what a master does (the reverse)."""
    msg = batch(1)
    answer = TensorMessage(msg.x)
    payloads = {name: encode_payload(m, REVISION) for name, m in (("Batch", msg), ("TensorMessage", answer))}
    hops, answers = step_messages(msg)
    frames = {name: ipc.encode(m) for name, m in (("Hops", hops), ("Answers", answers))}
    operations = {
        "decode Batch": lambda: decode_payload(payloads["Batch"], REVISION),
        "encode TensorMessage": lambda: encode_frame(answer, REVISION),
        "encode Batch": lambda: encode_frame(msg, REVISION),
        "decode TensorMessage": lambda: decode_payload(payloads["TensorMessage"], REVISION),
        f"encode a step's Hops ({STEP})": lambda: ipc.encode(hops),
        f"decode a step's Hops ({STEP})": lambda: ipc.decode(frames["Hops"]),
        f"encode a step's Answers ({STEP})": lambda: ipc.encode(answers),
        f"decode a step's Answers ({STEP})": lambda: ipc.decode(frames["Answers"]),
    }
    rates = {}
    for name, call in operations.items():
        timer = timeit.Timer(call)
        number = timer.autorange()[0]
        rates[name] = number / min(timer.repeat(5, number))
    return rates


def step_messages(msg: Batch) -> tuple[ipc.Hops, ipc.Answers]:
    """The Hops a front sends one device for STEP sessions' decode Batches `msg` through its 16 layers,
    and the Answers it gets back."""
    x, data = msg.x, ipc.joined([msg.x.data] * STEP)
    nbytes = memoryview(x.data).nbytes
    stage = ipc.Stage(0, 1, tuple(range(16)), (17,) * 16, tuple(range(16)))
    hops = tuple(ipc.Hop(session, 1000 + session, x.dtype, nbytes, 0, 1, x.shape, (stage,)) for session in range(STEP))
    answers = tuple(ipc.Activation(1000 + session, x.dtype, nbytes, 0, x.shape) for session in range(STEP))
    return ipc.Hops(hops, data), ipc.Answers(answers, data=data)


def before_and_after(before: Path, rounds: int) -> None:
    """Time `per_request` in this tree and in `before`'s, in turn, `rounds` times each; print the best of each."""
    trees = {"this tree": Path(__file__).resolve().parents[1], "before": before.resolve()}
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            # This file run by its path: `cakemp` is then the one of `tree`.
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                 check=True).stdout
            for operation, rate in json.loads(out).items():
                best[name][operation] = max(best[name].get(operation, 0.0), rate)
    print(f"decode-size Batch (16 ops), its TensorMessage answer, and a device step of {STEP} such requests' ipc "
          f"messages; best of {rounds} rounds, the trees in turn")
    print("| operation | before msg/s | this tree msg/s | time, this tree / before |")
    print("|---|---:|---:|---:|")
    for operation, rate in best["this tree"].items():
        print(f"| {operation} | {best['before'][operation]:,.0f} | {rate:,.0f} | {best['before'][operation] / rate:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="checkout of an earlier commit, timed in turn with this tree")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each tree, with --before")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one tree's per_request, as JSON
    args = parser.parse_args()
    if args.child:
        print(json.dumps(per_request()))
        return
    print(f"python {platform.python_version()} on {platform.machine()}")
    if args.before is not None:
        before_and_after(args.before, args.rounds)
        return
    small, large = batch(1), batch(512)
    sizes = [sum(memoryview(p).nbytes for p in encode_frame(m, REVISION)) for m in (small, large)]
    print(f"frame sizes: decode-size {sizes[0]:,} B, prefill-size {sizes[1]:,} B")
    print("| operation | decode-size msg/s | prefill-size msg/s | time ratio prefill / decode-size |")
    print("|---|---:|---:|---:|")
    small_ops, large_ops = operations(small), operations(large)
    for name in small_ops:
        fast, slow = side_by_side(small_ops[name], large_ops[name])
        print(f"| {name} | {fast:,.0f} | {slow:,.0f} | {fast / slow:.2f} |")


if __name__ == "__main__":
    main()
