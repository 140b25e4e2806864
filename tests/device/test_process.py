"""The device process itself, spawned as the front spawns it, driven over its ipc socket."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import torch

from cakemp.compute.kv_cache import BLOCK
from cakemp.device import process
from cakemp.ipc import (
    Activation,
    Answers,
    Batch,
    ErrorCode,
    FrontChannel,
    Hop,
    Hops,
    Loaded,
    Op,
    Ping,
    Pong,
    PrefixReport,
    Ready,
    Stage,
    StartFailure,
    rows,
)
from cakemp.ipc.spec import DeviceSpec
from cakemp.wire import DType
from tests.device import faulting_gpu
from tests.support.checkpoints import HFLayers
from tests.support.tolerance import assert_close


class Front:
    """The front's end of one device's socket, its messages queued as they come."""

    def __init__(self, endpoint: str):
        self.messages: asyncio.Queue = asyncio.Queue()
        self.channel = FrontChannel(endpoint, self.messages.put_nowait, lambda error: None)

    async def receive(self, timeout: float):
        return await asyncio.wait_for(self.messages.get(), timeout)


async def spawn(spec: DeviceSpec, generation: int = 1, target=process.main):
    """The front's end of a freshly spawned device process: (front, process, parent pipe)."""
    front = Front(spec.endpoint)
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=target, args=(spec, reader, os.getpid(), generation, (spec.endpoint,)),
                            daemon=True)
    child.start()
    reader.close()
    return front, child, writer


def hops(*hops: tuple[int, int, tuple[int, ...], tuple[Stage, ...], bytes, tuple[int, ...]]) -> Hops:
    """A Hops message of (session, request id, shape, stages, f32 bytes, stamps) each."""
    return Hops(tuple(Hop(session, request_id, DType.F32, len(data), 0, 1, shape, stages, trace=stamps)
                      for session, request_id, shape, stages, data, stamps in hops), b"".join(h[4] for h in hops))


def answered(answers: Answers) -> list[tuple[object, bytes]]:
    """Each activation and failure of the answers, with its bytes (a failure's: its message)."""
    items = (*answers.activations, *answers.failures)
    return [(item, bytes(data)) for item, data in zip(items, rows(items, answers.data))]


async def join(child, timeout: float = 20.0) -> int:
    """The child's exit code once it exits (None if it still runs after `timeout` s)."""
    await asyncio.to_thread(child.join, timeout)
    return child.exitcode


def test_ready_then_serving_then_exit_when_the_parent_pipe_closes(tmp_path, checkpoint):
    """The process reports its load progress and Ready with its layers, answers a Ping, answers a Hop
    like HF's layer (with its KV bytes, after what prefix reuse keeps), survives a request that breaks
    the contract (answered INTERNAL, naming no detail), and exits 0 once the parent's end of the pipe
    closes."""
    spec = DeviceSpec(0, None, ("model.layers.1",), str(checkpoint), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json")
    x = torch.randn(1, 3, 64)

    async def main():
        front, child, parent_pipe = await spawn(spec)
        progress = [await front.receive(60) for _ in range(2)]
        assert progress == [Loaded(0, 1), Loaded(1, 1)]
        ready = await front.receive(60)
        assert isinstance(ready, Ready) and (ready.device, ready.layers) == ("cpu", 1) and ready.memory_bytes > 0
        await front.channel.send(Ping())
        assert await front.receive(10) == Pong()

        def stage(layer):
            return (Stage.of(0, 1, (Op(layer, 0, 1),)),)

        await front.channel.send(hops((1, 1, (1, 3, 64), stage(5), x.numpy().tobytes(), ())))
        refused = await front.receive(10)  # the step's one message: its failure and its batch
        await front.channel.send(hops((1, 2, (1, 3, 64), stage(0), x.numpy().tobytes(), ())))
        answers = await front.receive(10)
        parent_pipe.close()
        exitcode = await join(child)
        front.channel.close()
        return refused, answers, exitcode

    refused, answers, exitcode = asyncio.run(main())
    ((failure, message),) = answered(refused)
    assert (failure.code, message) == (ErrorCode.INTERNAL, b"internal error on device cpu:0")
    assert refused.batches == (Batch(1, 3),) and not refused.activations  # its step, counted as it began
    ((activation, data),) = answered(answers)
    assert activation.request_id == 2 and activation.kv[0] > 0 and answers.batches == (Batch(1, 3),)
    # Prefix reuse now keeps the session's 3 output rows (one block of BLOCK rows of 64 f32): said with the answer.
    assert answers.prefixes == (PrefixReport(0, 0, 0, 0, BLOCK * 64 * 4),)
    y = torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, 3, 64)
    assert_close(y, HFLayers(checkpoint, [1], torch.float32)(x, 0))
    assert exitcode == 0


def test_a_load_failure_is_reported_before_exiting(tmp_path):
    """A model directory that cannot be loaded is reported as a StartFailure with the checkpoint's code
    after the first (empty) progress report, then the process exits 1."""
    spec = DeviceSpec(0, None, ("model.layers.0",), str(tmp_path / "absent"), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json")

    async def main():
        front, child, parent_pipe = await spawn(spec)
        assert await front.receive(60) == Loaded(0, 1)
        failure = await front.receive(60)
        exitcode = await join(child)
        front.channel.close()
        parent_pipe.close()
        return failure, exitcode

    failure, exitcode = asyncio.run(main())
    assert isinstance(failure, StartFailure) and failure.code in (ErrorCode.CHECKPOINT, ErrorCode.CONFIG)
    assert "absent" in failure.message
    assert exitcode == 1


def test_a_poisoned_context_fails_its_request_then_the_process_exits(tmp_path, checkpoint):
    """After a sticky CUDA error the device answers the request with DeviceLost, then exits 1 by
    itself (its parent still there), for the front's pool to restart it."""
    spec = DeviceSpec(0, None, ("model.layers.1",), str(checkpoint), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json")
    x = torch.randn(1, 3, 64)

    async def main():
        front, child, parent_pipe = await spawn(spec, target=faulting_gpu.main)
        while not isinstance(await front.receive(60), Ready):
            pass
        await front.channel.send(hops((1, 4, (1, 3, 64), (Stage.of(0, 1, (Op(0, 0, 1),)),), x.numpy().tobytes(), ())))
        ((failure, message),) = answered(await front.receive(10))
        exitcode = await join(child)
        front.channel.close()
        parent_pipe.close()
        return failure, message, exitcode

    failure, message, exitcode = asyncio.run(main())
    assert (failure.request_id, failure.code) == (4, ErrorCode.DEVICE_LOST)
    assert b"illegal memory access" in message
    assert exitcode == 1


def test_a_pinned_polling_device_answers_and_stamps_only_traced_hops(tmp_path, checkpoint):
    """A device told to poll before sleeping (poll_s) and pinned to one core runs on that core alone,
    answers a session's steps that come while it polls and after it has gone to sleep, like HF's
    layer; a Hop carrying stamps comes back with the device's four (received, stepping, stepped,
    sending) after them, in order, within the send and the answer; an untraced one with none."""
    core = min(os.sched_getaffinity(0))
    spec = DeviceSpec(0, None, ("model.layers.1",), str(checkpoint), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json", cpus=(core,), poll_s=0.05)
    ref = HFLayers(checkpoint, [1], torch.float32)
    xs = [torch.randn(1, 1, 64) for _ in range(3)]

    async def step(front, position: int, stamps: tuple[int, ...]) -> tuple[tuple[Activation, bytes], int, int]:
        sent = time.monotonic_ns()
        await front.channel.send(hops((1, position + 1, (1, 1, 64), (Stage.of(0, 1, (Op(0, position, 1),)),),
                                       xs[position].numpy().tobytes(), stamps)))
        while not isinstance(reply := await front.receive(10), Answers) or not reply.activations:
            pass
        return answered(reply)[0], sent, time.monotonic_ns()

    async def main():
        front, child, parent_pipe = await spawn(spec)
        while not isinstance(await front.receive(60), Ready):
            pass
        affinity = os.sched_getaffinity(child.pid)
        traced = await step(front, 0, (7, 8))
        untraced = await step(front, 1, ())  # within the 50 ms the device polls for
        await asyncio.sleep(0.2)  # past it: the device sleeps until the next
        late = await step(front, 2, ())
        parent_pipe.close()
        await join(child)
        front.channel.close()
        return affinity, traced, untraced, late

    affinity, (traced, sent, got), untraced, late = asyncio.run(main())
    assert affinity == {core}
    stamps = traced[0].trace
    assert stamps[:2] == (7, 8) and len(stamps) == 2 + 4
    assert sent <= stamps[2] <= stamps[3] <= stamps[4] <= stamps[5] <= got
    assert untraced[0][0].trace == () and late[0][0].trace == ()
    # Three decode steps are HF's layer over the three tokens at once.
    outputs = [torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, 1, 64)
               for _, data in (traced, untraced[0], late[0])]
    assert_close(torch.cat(outputs, dim=1), ref(torch.cat(xs, dim=1), 0))
