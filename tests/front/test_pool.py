"""DevicePool over real ZeroMQ sockets and spawned processes: what one wake-up's requests send a
device, and where a long prompt is cut. The devices here echo (no torch): each answers every hop
of a Hops message with its own bytes, in one Answers message that reports the message as one
batch of its hops and their tokens (the pool's batch metrics)."""

from __future__ import annotations

import asyncio
import io
import math
import os

from cakemp.front.metrics import Metrics
from cakemp.front.notify import Notifier
from cakemp.front.pool import DevicePool
from cakemp.front.status import NodeStatus
from cakemp.ipc import Activation, Answers, Batch, DeviceChannel, Hops, Loaded, Ready
from cakemp.ipc.spec import TEXT, DeviceSpec
from cakemp.wire import DType, LayerOp, LayerOps, RawTensor

HIDDEN = 4


def echo_device(spec: DeviceSpec, parent_pipe, parent_pid: int, generation: int, peers) -> None:
    """A device process that answers each Hops message at once, reporting it as one batch."""
    channel = DeviceChannel(spec.endpoint, parent_pipe.fileno(), peers)
    channel.send(Loaded(0, len(spec.parts)))
    channel.send(Ready("cpu", 0, len(spec.parts)))
    while (messages := channel.receive()) is not None:
        for message in messages:
            if not isinstance(message, Hops):
                continue
            hops = message.hops
            channel.send(Answers(tuple(Activation(hop.request_id, hop.dtype, hop.nbytes, hop.chunk, hop.shape)
                                       for hop in hops),
                                 batches=(Batch(len(hops), sum(math.prod(hop.shape[:-1]) for hop in hops)),),
                                 data=message.data))
    channel.close()


def batches(metrics: Metrics, label: str) -> tuple[float, float]:
    """(messages, hops) the device `label` reported: the batch size histogram's count and sum, as /metrics says."""
    lines = dict(line.rsplit(" ", 1) for line in metrics.batch_size.render() if not line.startswith("#"))
    return (float(lines.get(f'cakemp_device_batch_size_count{{device="{label}"}}', 0)),
            float(lines.get(f'cakemp_device_batch_size_sum{{device="{label}"}}', 0)))


async def pool_of(tmp_path, devices: int) -> tuple[DevicePool, Metrics]:
    metrics = Metrics()
    specs = [DeviceSpec(i, None, (f"model.layers.{i}",), "", "f32", f"ipc://{tmp_path}/device-{i}")
             for i in range(devices)]
    status = NodeStatus(Notifier(None), metrics, [spec.label for spec in specs], [1] * devices, progress_window=60,
                        stream=io.StringIO())
    pool = DevicePool(specs, echo_device, status=status, metrics=metrics, request_timeout=30, restart_attempts=1,
                      workload=TEXT, prefill_chunk=128)
    await pool.start()
    return pool, metrics


def tensor(tokens: int) -> RawTensor:
    return RawTensor(os.urandom(tokens * HIDDEN * 4), DType.F32, (1, tokens, HIDDEN))


def test_the_requests_of_one_wake_up_go_to_their_device_in_one_message(tmp_path):
    """Eight sessions' decode requests made in one turn of the event loop reach the device as one
    Hops message (one batch of 8), and each gets its own bytes back."""

    async def main():
        pool, metrics = await pool_of(tmp_path, 1)
        try:
            xs = [tensor(1) for _ in range(8)]
            route = pool.route(LayerOps.of([LayerOp("model.layers.0", 5, 0)]))
            outputs = await asyncio.gather(*(pool.run(session, x, route) for session, x in enumerate(xs, 1)))
            return xs, outputs, batches(metrics, "cpu:0")
        finally:
            await pool.stop()

    xs, outputs, (messages, hops) = asyncio.run(main())
    assert [bytes(output.data) for output in outputs] == [bytes(x.data) for x in xs]
    assert (messages, hops) == (1, 8)


def test_a_long_prompt_goes_whole_to_one_device_and_in_chunks_down_a_route_of_two(tmp_path):
    """A 300-token prompt (--prefill-chunk 128) whose layers are on one device is sent it whole, for
    the device to cut; across two devices the front cuts it into 3 chunks of 100, sent together, and
    joins their answers in order."""

    async def main():
        pool, metrics = await pool_of(tmp_path, 2)
        try:
            x = tensor(300)
            alone = await pool.run(1, x, pool.route(LayerOps.of([LayerOp("model.layers.0", 0, 0)])))
            one = batches(metrics, "cpu:0")
            both = await pool.run(2, x, pool.route(LayerOps.of([LayerOp("model.layers.0", 0, 0), LayerOp("model.layers.1", 0, 1)])))
            return x, alone, one, both, batches(metrics, "cpu:0")
        finally:
            await pool.stop()

    x, alone, one, both, two = asyncio.run(main())
    assert one == (1, 1)  # one message, one hop: the whole prompt
    assert two == (2, 4)  # then one message of the 3 chunks
    assert bytes(alone.data) == bytes(x.data) and alone.shape == (1, 300, HIDDEN)
    assert bytes(both.data) == bytes(x.data) and both.shape == (1, 300, HIDDEN)
