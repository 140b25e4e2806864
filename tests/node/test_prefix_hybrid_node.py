"""Prefix reuse through `cakemp run --gpus cpu:2 --share-prefixes` on Qwen3.5 (dense), whose
linear-attention layers keep a state that cannot be rewound: layers 0-1 (linear) on device 0,
2-3 (linear, full attention) on device 1.

Reuse resumes a recurrent run only where a state was kept (each request's end and each retired
prefix's end), so the rows a turn sends again are answered from kept rows while they agree and
the state follows them from one kept state to the next. Prompts go in chunks of 32 rows, which
end elsewhere each turn. Each turn ends with Goodbye: its answer comes after the devices'
reports, so the metrics are up to date once a turn returns.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from cakemp.wire import Revision
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.conversation import Conversation, reuse, rows
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, quiescent, write_topology
from tests.support.tolerance import F32_REL

PREFIX = "model.language_model.layers"
LAYERS = [0, 1, 2, 3]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3_5", shards=2)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", [f"{PREFIX}.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--share-prefixes",
                          "--prefill-chunk", "32", "--metrics-address", "127.0.0.1:0")
    yield running
    assert running.stop() == 0


async def connect(node) -> CakeMaster:
    return await CakeMaster.connect(node.port, LAYERS, revision=Revision.V2, prefix=PREFIX)


def test_a_three_turn_chat_matches_hf_and_reuses_the_history(node, checkpoint):
    """Turns of 40, 30 and 30 new rows with 6 generated each: every prefill is within the f32 bound of
    HF's layers computing it afresh, and each device
    answers the whole earlier history from kept rows (46, then 82 positions)."""
    port = node.metrics_port()

    async def main():
        chat = Conversation(await connect(node), HFLayers(checkpoint, LAYERS, torch.float32))
        figures, errors = [reuse(port)], []
        for turn, new in enumerate((40, 30, 30)):
            errors.append(await chat.turn(rows(new, 2 * turn), 6, 2 * turn + 1))
            figures.append(reuse(port))
        await chat.master.close()
        return errors, figures

    errors, figures = run(main())
    assert max(errors) <= F32_REL
    gained = [[b - a for a, b in zip(earlier, later)] for earlier, later in zip(figures, figures[1:])]
    assert gained == [[0, 0], [46, 46], [82, 82]]


def test_shared_prefixes_are_reused_across_connections(node, checkpoint):
    """With --share-prefixes a second master's prompt reuses the rows a first, closed connection
    left (its End retires them as a Goodbye would), and is answered HF's hidden states."""
    port = node.metrics_port()
    history = rows(50, 7)

    async def main():
        first = await connect(node)
        await first.forward(history, 0)
        await first.close()
        quiescent(port)  # the closed session's End answered by each device
        second = Conversation(await connect(node), HFLayers(checkpoint, LAYERS, torch.float32), history)
        before = reuse(port)
        error = await second.turn(rows(10, 8), 0, 9)
        await second.master.close()
        return error, [b - a for a, b in zip(before, reuse(port))]

    error, gained = run(main())
    assert error <= F32_REL and gained == [50, 50]
