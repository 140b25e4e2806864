"""The device process itself, spawned as the front spawns it, driven over its ipc socket."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import torch

from cakemp.compute.tensors import to_bytes, to_tensor
from cakemp.device import process
from cakemp.device.spec import DeviceSpec
from cakemp.ipc import Activation, Failure, Forward, FrontChannel, Loaded, Op, Ready
from cakemp.wire import DType
from tests.checkpoints import HFLayers
from tests.device import faulting_gpu


async def spawn(spec: DeviceSpec, target=process.main):
    """The front's end of a freshly spawned device process: (channel, process, parent pipe)."""
    channel = FrontChannel(spec.endpoint)
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=target, args=(spec, reader, os.getpid()), daemon=True)
    child.start()
    reader.close()
    return channel, child, writer


async def join(child, timeout: float = 20.0) -> int:
    for _ in range(int(timeout / 0.05)):
        if not child.is_alive():
            break
        await asyncio.sleep(0.05)
    child.join(0)
    return child.exitcode


def test_ready_then_serving_then_exit_when_the_parent_pipe_closes(tmp_path, checkpoint):
    """The process reports its load progress and Ready with its layers, answers a Forward like HF's
    layer (with its KV bytes), survives a bad request, and exits 0 once the parent's end of the pipe closes."""
    spec = DeviceSpec(0, None, ("model.layers.1",), str(checkpoint), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json")
    x = torch.randn(1, 3, 64)

    async def main():
        channel, child, parent_pipe = await spawn(spec)
        progress = [await asyncio.wait_for(channel.receive(), 60) for _ in range(2)]
        assert progress == [Loaded(0, 1), Loaded(1, 1)]
        ready = await asyncio.wait_for(channel.receive(), 60)
        assert isinstance(ready, Ready) and (ready.device, ready.layers) == ("cpu", 1) and ready.memory_bytes > 0
        await channel.send(Forward(1, 1, DType.F32, (1, 3, 64), (Op(5, 0, 1),), bytearray(to_bytes(x, DType.F32))))
        refused = await asyncio.wait_for(channel.receive(), 10)
        await channel.send(Forward(1, 2, DType.F32, (1, 3, 64), (Op(0, 0, 1),), bytearray(to_bytes(x, DType.F32))))
        answered = await asyncio.wait_for(channel.receive(), 10)
        parent_pipe.close()
        exitcode = await join(child)
        channel.close()
        return refused, answered, exitcode

    refused, answered, exitcode = asyncio.run(main())
    assert isinstance(refused, Failure) and refused.error == "UnknownLayer"
    assert isinstance(answered, Activation) and answered.request_id == 2 and answered.kv_bytes > 0
    y = to_tensor(bytearray(answered.data), answered.dtype, answered.shape)
    torch.testing.assert_close(y, HFLayers(checkpoint, [1], torch.float32)(x, 0), atol=1e-4, rtol=0)
    assert exitcode == 0


def test_a_load_failure_is_reported_before_exiting(tmp_path):
    """A model directory that cannot be loaded is reported as a start Failure after the first (empty)
    progress report, then the process exits 1."""
    spec = DeviceSpec(0, None, ("model.layers.0",), str(tmp_path / "absent"), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json")

    async def main():
        channel, child, parent_pipe = await spawn(spec)
        assert await asyncio.wait_for(channel.receive(), 60) == Loaded(0, 1)
        failure = await asyncio.wait_for(channel.receive(), 60)
        exitcode = await join(child)
        channel.close()
        parent_pipe.close()
        return failure, exitcode

    failure, exitcode = asyncio.run(main())
    assert isinstance(failure, Failure) and failure.request_id == 0 and "absent" in failure.message
    assert exitcode == 1


def test_a_poisoned_context_fails_its_request_then_the_process_exits(tmp_path, checkpoint):
    """After a sticky CUDA error the device answers the request with DeviceLost, then exits 1 by
    itself (its parent still there), for the front's pool to restart it."""
    spec = DeviceSpec(0, None, ("model.layers.1",), str(checkpoint), "f32", f"ipc://{tmp_path}/device-0",
                      threads=1, log_format="json")
    x = torch.randn(1, 3, 64)

    async def main():
        channel, child, parent_pipe = await spawn(spec, faulting_gpu.main)
        while not isinstance(await asyncio.wait_for(channel.receive(), 60), Ready):
            pass
        await channel.send(Forward(1, 4, DType.F32, (1, 3, 64), (Op(0, 0, 1),), bytearray(x.numpy().tobytes())))
        failure = await asyncio.wait_for(channel.receive(), 10)
        exitcode = await join(child)
        channel.close()
        parent_pipe.close()
        return failure, exitcode

    failure, exitcode = asyncio.run(main())
    assert isinstance(failure, Failure) and (failure.request_id, failure.error) == (4, "DeviceLost")
    assert "illegal memory access" in failure.message
    assert exitcode == 1
