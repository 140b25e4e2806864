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
Then masters at three addresses on a node whose KV budget they overfill: each request the node answers
is answered as alone, and what it refuses for room (the runner alone, which has no budget, is then not
asked) or with the session given up to another address's (its master then starts afresh) is what the
budget's fair share must do; no device restarts, no error is logged. And a prompt that fails part-way
over a two-device route's budget leaves no rows of it for its session to continue past.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter

import pytest
import torch

from cakemp.compute.fair_share import GIVEN_UP
from cakemp.compute.runner import BlockRunner
from cakemp.errors import PositionGap, RecurrentRewind, RemoteWorkerError
from cakemp.master.client import WorkerClient
from tests.support.checkpoints import make_checkpoint
from tests.support.conversation import hits
from tests.support.families import family_checkpoint
from tests.support.master import from_raw, to_raw
from tests.support.node import RunningNode, scrape, write_topology
from tests.support.schedules import Schedule
from tests.support.tolerance import assert_close

LAYERS = [0, 1, 2, 3]
NAMES = [f"model.layers.{i}" for i in LAYERS]
MASTERS = 4
# The budgeted node's masters' addresses: one address holding more than its share of the budget beside two
# that come for theirs.
BUDGETED_SOURCES = ("127.0.0.1",) * 5 + ("127.0.0.2", "127.0.0.3") * 2
WIDE_NAMES = [f"model.layers.{i}" for i in range(8)]  # the budgeted node's layers: each row's K and V in 8 of them
STEPS = 30
MAX_CONTEXT = 96  # a master's session starts again below this
NO_ROOM = re.compile(r"the KV cache would need .* budget is left")  # CacheBudgetExceeded's words for a request
# A request failed after part of it ran (a later piece of a prompt the device cut, over the budget): the session's
# state was dropped rather than kept half-applied, and its next request is told so.
LOST = re.compile(r"failed part-way, after part of it had run.*start again with a fresh prefill")
# What each refusal a budgeted node may answer says (Schedule.ended names them so).
BUDGET_REFUSALS = (("given up", re.compile(re.escape(GIVEN_UP))), ("no room", NO_ROOM), ("lost", LOST))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Phi-4-mini's: a partial longrope whose factors switch past position 16 for a whole request, however the
    node cuts it, and a window of 5."""
    return family_checkpoint(tmp_path_factory.mktemp("ckpt"), "phi3")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Llama of 8 layers whose rows take 1 KiB of K and V a layer (4 KV heads of 32): a budget of 1 MiB holds
    64 blocks of 16 positions, a layer's each, what four sessions of 32 positions through its 8 layers take."""
    return make_checkpoint(tmp_path_factory.mktemp("wide"), "llama", hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=4, num_hidden_layers=len(WIDE_NAMES))


@pytest.fixture(scope="module", params=["cpu:2", "cpu:1"])
def node(request, checkpoint, tmp_path_factory):
    yield from running_node(checkpoint, tmp_path_factory, "--gpus", request.param)


@pytest.fixture(scope="module")
def budgeted_node(wide, tmp_path_factory):
    yield from running_node(wide, tmp_path_factory, "--gpus", "cpu:1", "--kv-budget-mib", "1", layers=len(WIDE_NAMES))


@pytest.fixture(scope="module")
def budgeted_pipeline(wide, tmp_path_factory):
    yield from running_node(wide, tmp_path_factory, "--gpus", "cpu:2", "--kv-budget-mib", "1", layers=len(WIDE_NAMES))


def running_node(checkpoint, tmp_path_factory, *flags: str, layers: int = len(NAMES)):
    """A node of the checkpoint's first `layers` layers with `flags`, prompts in pieces of 8; stopped cleanly, no
    error logged."""
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", [f"model.layers.0-{layers - 1}"])
    running = RunningNode(checkpoint, topology, *flags, "--dtype", "f32", "--prefill-chunk", "8",
                          "--max-context", "256", "--metrics-address", "127.0.0.1:0")
    yield running
    assert running.stop() == 0
    assert not [e for e in running.events() if e.get("level") == "error"]


@pytest.mark.parametrize("seed", [0, 1])
def test_masters_on_random_schedules_are_each_answered_as_alone(node, checkpoint, seed):
    alone = BlockRunner.load(checkpoint, NAMES, "cpu", torch.float32)
    outcomes = asyncio.run(masters(node.port, alone, seed))
    assert all(count["answered"] > STEPS // 2 for count in outcomes)  # most requests were answered, by every master
    assert hits(scrape(node.metrics_port()), "cpu:0") > 0  # a prompt began with rows kept from a Goodbye


@pytest.mark.parametrize("seed", [0, 1])
def test_masters_overfilling_the_kv_budget_are_answered_as_alone_or_refused_for_room(budgeted_node, wide, seed):
    alone = BlockRunner.load(wide, WIDE_NAMES, "cpu", torch.float32)
    outcomes = sum(asyncio.run(masters(budgeted_node.port, alone, seed, BUDGETED_SOURCES)), Counter())
    assert outcomes["answered"] > len(BUDGETED_SOURCES) * STEPS // 3 and outcomes["no room"] > 0 and outcomes["given up"] > 0


def test_a_prompt_failing_part_way_over_the_budget_leaves_no_rows_of_it_behind(budgeted_pipeline):
    """Two-device route, each device's 1 MiB holding 256 positions of its 4 layers. One session holds 200; another's
    200-row prompt flows down the route in chunks of 8 until one finds no room, after its first chunks ran on
    both devices. Their rows are not kept for it to continue past: its next request continuing is told its
    state was dropped, the one after it refused as the fresh session it is, and a new prompt is served."""

    async def main():
        holder, client = await connected(budgeted_pipeline.port, None), await connected(budgeted_pipeline.port, None)
        ops = lambda position: [(name, position, i) for i, name in enumerate(WIDE_NAMES)]  # noqa: E731
        await holder.batch(to_raw(torch.randn(1, 200, 128)), ops(0))
        with pytest.raises(RemoteWorkerError, match=NO_ROOM):
            await client.batch(to_raw(torch.randn(1, 200, 128)), ops(0))
        with pytest.raises(RemoteWorkerError, match=LOST):
            await client.batch(to_raw(torch.randn(1, 1, 128)), ops(8))  # (the first chunk ran)
        with pytest.raises(RemoteWorkerError, match="does not follow the 0 positions"):
            await client.batch(to_raw(torch.randn(1, 1, 128)), ops(8))
        await client.batch(to_raw(torch.randn(1, 4, 128)), ops(0))
        await client.batch(to_raw(torch.randn(1, 1, 128)), ops(4))
        await asyncio.gather(holder.close(), client.close())

    asyncio.run(asyncio.wait_for(main(), 60))


async def masters(port: int, alone: BlockRunner, seed: int, budgeted: tuple[str, ...] = ()) -> list[Counter]:
    """MASTERS masters at once, or where `budgeted` a master at each of its addresses: what became of each one's
    requests."""
    sources = budgeted or (None,) * MASTERS
    return await asyncio.wait_for(asyncio.gather(*(
        master(port, alone, 100 * seed + m, source, bool(budgeted)) for m, source in enumerate(sources))), 240)


async def master(port: int, alone: BlockRunner, seed: int, source: str | None, budgeted: bool) -> Counter:
    """One master's schedule through the node, on its connection from `source` (session `seed` on `alone`): what
    became of its requests. Each the node answers is answered as `alone` answers it; each it refuses, `alone`
    refuses alike, but for room where `budgeted` (see `refusal`)."""
    schedule = Schedule(random.Random(seed), alone.config.hidden_size, MAX_CONTEXT)
    client = await connected(port, source)
    outcomes = Counter()
    try:
        for _ in range(STEPS):
            asked = schedule.next(0) if 0 in schedule.cached else schedule.start(0)
            ops = [(name, asked.position, i) for i, name in enumerate(WIDE_NAMES if budgeted else NAMES)]
            try:
                answer = from_raw(await client.batch(to_raw(asked.x), ops))
            except RemoteWorkerError as e:
                outcome = refusal(e, alone, seed, asked, ops, budgeted)
                if schedule.ended(asked, outcome):
                    alone.free_session(seed)
            else:
                assert_close(answer, alone.run(seed, asked.x, alone.ops(ops)))
                schedule.answered(asked)
                outcome = "answered"
            outcomes[outcome] += 1
            for _, goodbye in schedule.leaving():
                if goodbye:
                    await client.goodbye()
                    alone.clear_session(seed)
                else:  # the connection closes: the node frees the session
                    await client.close()
                    client = await connected(port, source)
                    alone.free_session(seed)
    finally:
        await client.close()
    return outcomes


def refusal(error: RemoteWorkerError, alone: BlockRunner, seed: int, asked, ops, budgeted: bool) -> str:
    """Why the node refused a request: where `budgeted`, for room ("no room": `alone`, which has no budget, is not
    asked), with its session given up ("given up"), or with its state dropped after a request of it failed
    part-way ("lost"); else as `alone` refuses it, in the same words ("refused")."""
    text = str(error)
    if budgeted:
        for outcome, words in BUDGET_REFUSALS:
            if words.search(text):
                return outcome
    with pytest.raises((PositionGap, RecurrentRewind)) as refused:
        alone.run(seed, asked.x, alone.ops(ops))
    assert str(refused.value) in text
    return "refused"


async def connected(port: int, source: str | None) -> WorkerClient:
    client = await WorkerClient.connect("127.0.0.1", port, source=source)
    await client.hello()
    return client
