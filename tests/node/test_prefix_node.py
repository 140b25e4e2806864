"""Prefix reuse through `cakemp run --gpus cpu:2` (Llama layers 0-3, two on each device), driven as a
Cake master serving its chat API drives a worker: each turn the whole history again from position 0,
after a Goodbye, on the same connections.

The node keeps a 1 MiB KV budget per device, so that retired prefixes soon fill it and must give way
to live sessions; prompts are cut into chunks of 32 rows, so that reuse follows a prompt chunk by chunk.
Each turn ends with Goodbye, whose answer comes after every report the devices sent before it: the
metrics are up to date once a turn returns.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cakemp.wire import Revision
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.conversation import Conversation, evictions, hits, retired_bytes, reuse, rows
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, scrape, wait_until, write_topology
from tests.support.tolerance import F32_REL

LAYERS = [0, 1, 2, 3]
DEVICES = ("cpu:0", "cpu:1")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", shards=2)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--kv-budget-mib", "1",
                          "--prefill-chunk", "32", "--max-context", "4096", "--metrics-address", "127.0.0.1:0")
    yield running
    assert running.stop() == 0


async def connect(node) -> CakeMaster:
    return await CakeMaster.connect(node.port, LAYERS, revision=Revision.V2)


def test_a_three_turn_chat_matches_hf_and_reuses_the_history(node, checkpoint):
    """Turns of 40, 30 and 30 new rows with 6 generated each: every prefill is within the f32 bound of
    HF's layers computing it afresh, and each device answers the whole earlier history from kept
    rows (46, then 82 positions), device 1 too, since device 0's kept rows are its input bit for bit."""
    port = node.metrics_port()

    async def main():
        chat = Conversation(await connect(node), HFLayers(checkpoint, LAYERS, torch.float32))
        before = reuse(port)
        errors = [await chat.turn(rows(40, 1), 6, 2)]
        after_first = reuse(port)
        errors.append(await chat.turn(rows(30, 3), 6, 4))
        after_second = reuse(port)
        errors.append(await chat.turn(rows(30, 5), 6, 6))
        after_third = reuse(port)
        await chat.master.close()
        return errors, [before, after_first, after_second, after_third]

    errors, figures = run(main())
    assert max(errors) <= F32_REL
    gained = [[b - a for a, b in zip(earlier, later)] for earlier, later in zip(figures, figures[1:])]
    assert gained == [[0, 0], [46, 46], [82, 82]]


def test_a_history_differing_in_one_early_row_reuses_nothing_past_it(node, checkpoint):
    """The second turn's history differs from the first's at row 20: each device reuses the 20 rows
    before it and nothing after (device 1's row 20 on are computed by device 0 from other rows),
    and the answer is HF's."""
    port = node.metrics_port()

    async def main():
        chat = Conversation(await connect(node), HFLayers(checkpoint, LAYERS, torch.float32))
        await chat.turn(rows(40, 11), 2, 12)
        chat.history = chat.history.clone()
        chat.history[0, 20] += 0.5
        before = reuse(port)
        error = await chat.turn(rows(10, 13), 0, 14)
        await chat.master.close()
        return error, [b - a for a, b in zip(before, reuse(port))]

    error, gained = run(main())
    assert error <= F32_REL and gained == [20, 20]


def test_another_connection_does_not_reuse_a_prefix_and_a_closed_one_frees_its_own(node):
    """A second master sending a first master's retired rows computes them all; once the first
    closes, its retired prefix is freed on both devices."""
    port = node.metrics_port()
    history = rows(48, 21)

    async def main():
        first, second = await connect(node), await connect(node)
        await first.forward(history, 0)
        await first.goodbye()
        before = reuse(port)
        await second.forward(history, 0)
        await second.goodbye()
        gained = [b - a for a, b in zip(before, reuse(port))]
        await first.close()
        await second.close()
        return gained

    assert run(main()) == [0, 0]
    wait_until(lambda: all(retired_bytes(scrape(port), device) == 0 for device in DEVICES),
               what="the closed connections' retired prefixes freed")


def test_retired_prefixes_give_way_to_growing_live_sessions(node):
    """Six masters each leave a retired prefix of 200 rows (their KV slots and kept rows fill most of
    each device's 1 MiB), then two live sessions grow to 700 positions: every request succeeds, the
    retired prefixes are evicted for them, and the two sessions, sent the same rows, answer the same."""
    port = node.metrics_port()

    async def main():
        masters = [await connect(node) for _ in range(6)]
        for i, master in enumerate(masters):
            await master.forward(rows(200, 30 + i), 0)
            await master.goodbye()
        assert all(retired_bytes(scrape(port), device) > 0 for device in DEVICES)
        before = [evictions(scrape(port), device) for device in DEVICES]
        live = masters[:2]
        for master in live:
            await master.forward(rows(500, 40), 0)
        for position in range(500, 700, 20):  # both sessions grow, turn by turn
            for master in live:
                await master.forward(rows(20, position), position)
        last = [await master.forward(rows(1, 99), 700) for master in live]
        seen = scrape(port)
        for master in masters:
            await master.close()
        return last, [evictions(seen, device) - b for device, b in zip(DEVICES, before)]

    last, evicted = run(main())
    assert torch.equal(last[0], last[1])  # the same rows in each session: the same hidden states
    assert all(count > 0 for count in evicted)


def test_hits_are_counted_per_device(node, checkpoint):
    """One turn reusing a retired prefix counts one hit on each device."""
    port = node.metrics_port()

    async def main():
        chat = Conversation(await connect(node), HFLayers(checkpoint, LAYERS, torch.float32))
        await chat.turn(rows(20, 50), 0, 51)
        before = [hits(scrape(port), device) for device in DEVICES]
        await chat.turn(rows(5, 52), 0, 53)
        gained = [hits(scrape(port), device) - b for device, b in zip(DEVICES, before)]
        await chat.master.close()
        return gained

    assert run(main()) == [1, 1]
