"""Fuzzing the decoder: mutated frames raise nothing but ProtocolError or BadTensor and allocate in proportion to the
input."""

from __future__ import annotations

import random
import struct
import tracemalloc

from cakemp.errors import BadTensor, ProtocolError
from cakemp.wire import (
    Batch,
    DType,
    FrameDecoder,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOp,
    ModelDataChunk,
    ModelDataDone,
    ModelDataResume,
    RawTensor,
    Revision,
    SingleOp,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    WorkerReady,
    encode_frame,
)

FRAMES = 12_000

SEEDS = [
    Hello(),
    Goodbye(),
    ModelDataDone(),
    WorkerReady(),
    WorkerInfo("0.1.0", "F16", "linux", "x86_64", "cuda", 2, 42),
    Batch(RawTensor(bytes(64), DType.F16, (1, 2, 16)), tuple(LayerOp(f"model.layers.{i}", 7, i) for i in range(16))),
    SingleOp("model.layers.5", RawTensor(bytes(16), DType.F32, (1, 4)), 42, 5),
    TensorMessage(RawTensor(bytes(24), DType.BF16, (1, 3, 4))),
    LayerAssignment(tuple(f"model.layers.{i}" for i in range(8)), "deadbeef"),
    LayerAssignmentAck(True),
    WorkerError("could not find layer model.layers.99"),
]
SEEDS_BY_REVISION = {
    Revision.V1: SEEDS + [ModelDataChunk("model.safetensors", 0, 3, b"\x01\x02\x03")],
    Revision.V2: SEEDS + [
        ModelDataChunk("model.safetensors", 0, 3, b"\x01\x02\x03", checksum=0x55BC801D),
        ModelDataResume("config.json", 3),
    ],
}
BIG_U32 = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x10000000, 256]


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """One random corruption of a valid frame; the header length is usually kept consistent
    with the corrupted payload so that the payload decoder sees it."""
    payload = bytearray(frame[8:])
    kind = rng.randrange(6)
    if kind == 0 and payload:  # flip a few bytes
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
    elif kind == 1:  # truncate
        del payload[rng.randrange(len(payload) + 1) :]
    elif kind == 2 and len(payload) >= 4:  # a count, length or tag claiming something extreme
        at = rng.randrange(len(payload) - 3)
        payload[at : at + 4] = struct.pack(">I", rng.choice(BIG_U32 + [rng.getrandbits(32)]))
    elif kind == 3:  # insert random bytes
        at = rng.randrange(len(payload) + 1)
        payload[at:at] = rng.randbytes(rng.randint(1, 12))
    elif kind == 4:  # pure noise
        payload = bytearray(rng.randbytes(rng.randint(0, 64)))
    header = bytearray(struct.pack(">II", 0x0104F4C7, len(payload)))
    if rng.random() < 0.05:  # now and then, corrupt the header itself
        header[rng.randrange(8)] = rng.randrange(256)
    return bytes(header + payload)


def decode_all(frame: bytes, revision: Revision) -> bool:
    """Whether the frame decoded; False when it raised ProtocolError or BadTensor (anything else escapes)."""
    decoder = FrameDecoder(revision)
    decoder.feed(frame)
    try:
        decoder.next_message()
    except (ProtocolError, BadTensor):
        return False
    return True


def test_fuzzed_frames_raise_only_peer_faults_within_an_input_sized_allocation():
    """Over 12,000 mutated frames, decoding raises only ProtocolError or BadTensor and never allocates more than
    a small multiple of the frame's own size (a count claiming 4 G items must not allocate them)."""
    rng = random.Random(20260330)
    seeds = {rev: [b"".join(encode_frame(m, rev)) for m in msgs] for rev, msgs in SEEDS_BY_REVISION.items()}
    decoded = 0
    tracemalloc.start()
    try:
        for i in range(FRAMES):
            revision = Revision.V1 if i % 2 else Revision.V2
            frame = mutate(rng, rng.choice(seeds[revision]))
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            decoded += decode_all(frame, revision)
            peak = tracemalloc.get_traced_memory()[1] - base
            # Decoded objects (str, LayerOp, int) weigh more than their wire bytes (about 12x
            # at worst here) plus a fixed few KiB; a count believed without checking would
            # cost gigabytes.
            assert peak <= 16 * len(frame) + 8192, (frame.hex(), peak)
    finally:
        tracemalloc.stop()
    # The mutations exercise both outcomes: a fuzz that only ever failed at the header, or never
    # failed at all, would test nothing.
    assert 0.1 * FRAMES < decoded < 0.9 * FRAMES
