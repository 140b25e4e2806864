"""Masters following seeded random schedules (tests/support/schedules.py) through a live node at once, each
answer checked against the same request run alone on a runner in this process.

Each master holds one connection, one session on the node: it sends a prompt, decodes, sends prompt chunks,
rewinds, asks for a position it has not reached (refused by the node as by the runner alone), says Goodbye
and starts again (often repeating the first rows of an earlier prompt: prefix reuse, on by default, keeps
them), or closes its connection and opens another. Two nodes of Phi-4-mini's layers 0-3 (its longrope's
factors picked by where a whole request ends, however the node cuts it), prompts in pieces of 8 rows: on
`--gpus cpu:2` every route spans both devices, so the front cuts a prompt into chunks that flow from one
device to the next; on `--gpus cpu:1` the device cuts it into pieces between its decode steps.
The masters' requests meet in the devices' batched steps at whatever positions their schedules reach.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cakemp.compute.runner import BlockRunner
from cakemp.errors import PositionGap, RemoteWorkerError
from cakemp.master.client import WorkerClient
from tests.support.conversation import hits
from tests.support.families import family_checkpoint
from tests.support.master import from_raw, to_raw
from tests.support.node import RunningNode, scrape, write_topology
from tests.support.schedules import Schedule
from tests.support.tolerance import assert_close

LAYERS = [0, 1, 2, 3]
NAMES = [f"model.layers.{i}" for i in LAYERS]
MASTERS = 4
STEPS = 30
MAX_CONTEXT = 96  # a master's session starts again below this


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Phi-4-mini's: a partial longrope whose factors switch past position 16 for a whole request, however the
    node cuts it, and a window of 5."""
    return family_checkpoint(tmp_path_factory.mktemp("ckpt"), "phi3")


@pytest.fixture(scope="module", params=["cpu:2", "cpu:1"])
def node(request, checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", request.param, "--dtype", "f32", "--prefill-chunk", "8",
                          "--max-context", "256", "--metrics-address", "127.0.0.1:0")
    yield running
    assert running.stop() == 0
    assert not [e for e in running.events() if e.get("level") == "error"]


@pytest.mark.parametrize("seed", [0, 1])
def test_masters_on_random_schedules_are_each_answered_as_alone(node, checkpoint, seed):
    alone = BlockRunner.load(checkpoint, NAMES, "cpu", torch.float32)

    async def masters():
        return await asyncio.gather(*(master(node.port, alone, 100 * seed + m) for m in range(MASTERS)))

    answered = asyncio.run(asyncio.wait_for(masters(), 240))
    assert all(count > STEPS // 2 for count in answered)  # most requests were answered, by every master
    assert hits(scrape(node.metrics_port()), "cpu:0") > 0  # a prompt began with rows kept from a Goodbye


async def master(port: int, alone: BlockRunner, seed: int) -> int:
    """One master's schedule through the node, on its connection (session `seed` on `alone`): how many of its
    requests were answered, each as `alone` answers it; a request `alone` refuses the node refuses too."""
    schedule = Schedule(random.Random(seed), alone.config.hidden_size, MAX_CONTEXT)
    client = await connected(port)
    answered = 0
    try:
        for _ in range(STEPS):
            asked = schedule.next(0) if 0 in schedule.cached else schedule.start(0)
            ops = [(name, asked.position, i) for i, name in enumerate(NAMES)]
            try:
                expected = alone.run(seed, asked.x, alone.ops(ops))
            except PositionGap:
                with pytest.raises(RemoteWorkerError, match="does not follow"):
                    await client.batch(to_raw(asked.x), ops)
            else:
                assert_close(from_raw(await client.batch(to_raw(asked.x), ops)), expected)
                schedule.answered(asked)
                answered += 1
            for _, goodbye in schedule.leaving():
                if goodbye:
                    await client.goodbye()
                    alone.clear_session(seed)
                else:  # the connection closes: the node frees the session
                    await client.close()
                    client = await connected(port)
                    alone.free_session(seed)
    finally:
        await client.close()
    return answered


async def connected(port: int) -> WorkerClient:
    client = await WorkerClient.connect("127.0.0.1", port)
    await client.hello()
    return client
