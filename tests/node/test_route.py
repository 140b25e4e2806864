"""`cakemp run --gpus cpu:3`: a Batch passes device to device, a long prompt flows down the route in chunks.

Layers 0-1 are on device 0, 2 on device 1, 3 on device 2; with --prefill-chunk 2 any prompt
of 3 tokens or more through them is cut into chunks that follow each other down the route.
One node serves the module; the killing test runs last.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from cakemp.errors import RemoteWorkerError
from cakemp.ipc import trace
from cakemp.master.client import WorkerClient
from tests.support.checkpoints import HFLayers
from tests.support.master import CakeMaster, from_raw, to_raw
from tests.support.node import RunningNode, gone, write_topology

HIDDEN = 64
LAYERS = [0, 1, 2, 3]
CHUNK = 2
F32_ATOL = 1e-4


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])
    stamps = tmp_path_factory.mktemp("trace") / "trace.txt"  # each request's stamps (cakemp/ipc/trace.py)
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:3", "--dtype", "f32", "--cpu-threads", "1",
                          "--prefill-chunk", str(CHUNK), timeout=180, env={trace.ENV: str(stamps)})
    running.trace_file = stamps
    yield running
    running.kill()


def hf(checkpoint, layers=LAYERS) -> HFLayers:
    return HFLayers(checkpoint, layers, torch.float32)


def freed(node: RunningNode, after: int) -> list[dict]:
    return [e for e in node.events(after) if e.get("event") == "session freed"]


def test_the_layers_span_all_three_devices(node):
    """Each device process loaded its own share: 2, 1 and 1 layers."""
    def ready(index: int) -> dict:
        return node.wait_for(lambda e: e.get("event") == "device ready" and e.get("device") == index)

    assert {index: ready(index)["layers"] for index in range(3)} == {0: 2, 1: 1, 2: 1}


def test_a_chunked_prefill_then_decode_match_hf(node, checkpoint):
    """A 13-token prompt (7 chunks flowing through three devices) and three decode steps match HF's layers."""
    ref = hf(checkpoint)

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        x = torch.randn(1, 13, HIDDEN)
        torch.testing.assert_close(await master.forward(x, 0), ref(x, 0), atol=F32_ATOL, rtol=0)
        for pos in range(13, 16):
            x = torch.randn(1, 1, HIDDEN)
            torch.testing.assert_close(await master.forward(x, pos), ref(x, pos), atol=F32_ATOL, rtol=0)
        await master.close()

    run(main())


def test_a_traced_node_writes_each_answered_requests_stamps_in_order(node, checkpoint):
    """With CAKEMP_TRACE, a decode Batch through the three devices adds a line of the front's 4 stamps,
    each device's 4 and the front's last 3, never going back, within the master's send and reply (but
    the last, taken after the write); a refused request adds none."""
    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            sent = trace.now()
            await client.batch(to_raw(torch.randn(1, 1, HIDDEN)), [(f"model.layers.{i}", 0, i) for i in LAYERS])
            got = trace.now()
            with pytest.raises(RemoteWorkerError):
                await client.batch(to_raw(torch.randn(1, 1, HIDDEN)), [("model.layers.0", 9, 0)])
            # Its line was written before the refusal was served; earlier tests' lines start before `sent`.
            lines = [line.split() for line in node.trace_file.read_text().splitlines()]
            return [[int(value) for value in line] for line in lines if int(line[0]) >= sent], sent, got

    lines, sent, got = run(main())
    assert len(lines) == 1
    stamps = lines[0]
    assert len(trace.stamp_names(len(stamps))) == 4 + 3 * 4 + 3
    # "written" is taken once the front's write returns, which can be after the master has read the
    # reply: every other stamp falls between the master's send and its reply.
    *served, written = stamps
    assert [sent, *served, got] == sorted([sent, *served, got])
    assert written >= served[-1]


def test_a_three_token_prompt_is_cut_and_still_matches_hf(node, checkpoint):
    """Three tokens make two chunks (2 + 1): the result equals HF's, then a chunked continuation at 3 does too."""
    ref = hf(checkpoint)

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        for pos, length in ((0, 3), (3, 5)):
            x = torch.randn(1, length, HIDDEN)
            torch.testing.assert_close(await master.forward(x, pos), ref(x, pos), atol=F32_ATOL, rtol=0)
        await master.close()

    run(main())


def test_a_route_starting_on_a_later_device_matches_hf(node, checkpoint):
    """A run of layers 2-3 goes device 1 → device 2 → front, chunked, and matches HF's layers 2-3."""
    ref = hf(checkpoint, [2, 3])

    async def main():
        master = await CakeMaster.connect(node.port, [2, 3])
        for pos, length in ((0, 6), (6, 1)):
            x = torch.randn(1, length, HIDDEN)
            torch.testing.assert_close(await master.forward(x, pos), ref(x, pos), atol=F32_ATOL, rtol=0)
        await master.close()

    run(main())


def test_an_error_on_the_second_devices_part_is_the_requests_worker_error(node, checkpoint):
    """A chunked Batch whose layer 2 (device 1) skips past its cache gets WorkerError naming the gap; the
    same connection then serves a good prompt that matches HF."""
    ops = [(f"model.layers.{i}", 0, i) for i in LAYERS]
    gap = [("model.layers.0", 0, 0), ("model.layers.1", 0, 1), ("model.layers.2", 40, 2), ("model.layers.3", 0, 3)]

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            with pytest.raises(RemoteWorkerError, match="index_pos 40 for block 2 does not follow"):
                await client.batch(to_raw(torch.randn(1, 5, HIDDEN)), gap)
            x = torch.randn(1, 5, HIDDEN)
            y = await client.batch(to_raw(x), ops)
            torch.testing.assert_close(from_raw(y), hf(checkpoint)(x, 0), atol=F32_ATOL, rtol=0)

    run(main())


def test_a_tensor_of_300_dimensions_gets_worker_error_and_nothing_is_left_owed(node, checkpoint):
    """A Batch whose shape has 300 dimensions (a one-byte ndim used to wrap) is answered WorkerError, from
    the count, before the shape is built; no device is taken for hung, and the connection then serves a
    good prompt."""
    mark = node.mark()
    shape = (1,) * 299 + (HIDDEN,)
    ops = [(f"model.layers.{i}", 0, i) for i in LAYERS]

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            bad = to_raw(torch.randn(1, 1, HIDDEN))
            with pytest.raises(RemoteWorkerError, match="Batch.x has a shape of 300 dimensions, at most 8"):
                await client.batch(type(bad)(bad.data, bad.dtype, shape), ops)
            x = torch.randn(1, 3, HIDDEN)
            torch.testing.assert_close(from_raw(await client.batch(to_raw(x), ops)), hf(checkpoint)(x, 0),
                                       atol=F32_ATOL, rtol=0)

    run(main())
    assert not [e for e in node.events(mark) if e.get("event") == "device failed; restarting it"]


def test_goodbye_then_close_free_the_session_on_every_device(node, checkpoint):
    """Goodbye clears the session on all three devices (a fresh prefill matches HF), and closing the
    connection frees it on each of them (and the master's other connections, which only said Hello,
    nowhere)."""
    mark = node.mark()

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        sessions = [client.local_address for client in master.clients]  # how the node's log names them
        await master.forward(torch.randn(1, 9, HIDDEN), 0)
        await master.goodbye()
        x = torch.randn(1, 4, HIDDEN)
        torch.testing.assert_close(await master.forward(x, 0), hf(checkpoint)(x, 0), atol=F32_ATOL, rtol=0)
        await master.close()
        return sessions

    def devices_by_session() -> dict[str, list[int]]:
        # Only this master's sessions: an earlier test's connection may be freed after the mark.
        by_session: dict[str, list[int]] = {}
        for event in freed(node, mark):
            if event["session"] in sessions:
                by_session.setdefault(event["session"], []).append(event["device"])
        return by_session

    sessions = run(main())
    # The master's first connection is the session that ran the Batches.
    node.wait_for(lambda e: len(devices_by_session().get(sessions[0], [])) == 3, after=mark)
    assert {session: sorted(devices) for session, devices in devices_by_session().items()} == {sessions[0]: [0, 1, 2]}


def test_a_device_killed_mid_route_fails_that_request_alone(node, checkpoint):
    """With device 1 stopped under a chunked request, SIGKILL fails the request with WorkerError; a session
    on device 0's layers is served meanwhile; devices 0 and 2 keep their processes; once device 1 is back
    the session is told once that its state was lost, and a fresh prefill matches HF."""
    pids = {index: node.device_pid(index) for index in range(3)}
    victim = pids[1]
    mark = node.mark()

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        await master.forward(torch.randn(1, 4, HIDDEN), 0)
        os.kill(victim, signal.SIGSTOP)  # the next request cannot get past device 1
        in_flight = asyncio.create_task(master.forward(torch.randn(1, 6, HIDDEN), 4))
        other = await CakeMaster.connect(node.port, [0, 1])
        x = torch.randn(1, 3, HIDDEN)
        torch.testing.assert_close(await other.forward(x, 0), hf(checkpoint, [0, 1])(x, 0), atol=F32_ATOL, rtol=0)
        assert not in_flight.done()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RemoteWorkerError, match=r"device cpu:1 died \(exit code -9\)"):
            await in_flight
        await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "device restarted" and e.get("device") == 1,
                                60, mark)
        with pytest.raises(RemoteWorkerError, match=r"device cpu:1 restarted; this session's KV state was lost"):
            await master.forward(torch.randn(1, 1, HIDDEN), 10)
        x = torch.randn(1, 5, HIDDEN)
        torch.testing.assert_close(await master.forward(x, 0), hf(checkpoint)(x, 0), atol=F32_ATOL, rtol=0)
        await master.close()
        await other.close()

    run(main())
    assert gone(victim) and node.process.poll() is None
    assert node.device_pid(1) != victim
    assert [e["device"] for e in node.events(mark) if e.get("event") == "device restarted"] == [1]
    assert all(not gone(pids[index]) for index in (0, 2))
