"""Codec benchmark: encode and decode of a decode-size and a prefill-size Batch.

    python -m bench.codec

Both Batches carry 16 layer ops (one worker serving 16 layers): the decode step's hidden
state is [1, 1, 4096] f16 (8 KiB), the prefill's [1, 512, 4096] f16 (4 MiB). The decode
ratio (prefill / decode-size, decode_payload only) is ≈ 1 when decoding does not copy the
tensor bytes. encode_frame's is ≈ 1 too (the tensor goes to the writer by reference);
encode_payload joins everything into one bytes object and FrameDecoder copies what it is fed
into its buffer once, so theirs grow with the tensor, as any single-buffer path must.
"""

from __future__ import annotations

import platform
import timeit
from collections.abc import Callable

from cakemp.wire import (
    Batch,
    DType,
    FrameDecoder,
    LayerOp,
    RawTensor,
    Revision,
    decode_payload,
    encode_frame,
    encode_payload,
)

HIDDEN = 4096
REVISION = Revision.V2


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


def main() -> None:
    small, large = batch(1), batch(512)
    print(f"python {platform.python_version()} on {platform.machine()}")
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
