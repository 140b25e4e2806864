"""Trust on a network, against live zero-config nodes: a reflected handshake, pushed config.json
files that are no model, and cache directories the node did not make.

Every attack is refused on its own (the connection closed or answered WorkerError, the reason
logged), the front keeps running, nothing outside what the node wrote changes, and a master
holding the key is served after it. One node takes the hostile setups, then a good push whose
load SIGTERM interrupts; a second node on the same cache reuses it without a push and serves,
and takes the reflection attack while serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from cakemp.errors import ProtocolError, RemoteWorkerError
from cakemp.master.client import WorkerClient
from cakemp.master.model_push import model_chunks, model_hash
from cakemp.setup.cache import MARKER, OWNER
from cakemp.wire import (
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    ModelDataDone,
    Revision,
    WorkerError,
    WorkerInfo,
    WorkerReady,
    decode_payload,
    encode_frame,
    read_header,
)
from cakemp.wire.discovery import cluster_hash
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster
from tests.support.node import ZeroConfigNode
from tests.support.tolerance import assert_close

KEY = ZeroConfigNode.KEY
REVISION = Revision.V2
HIDDEN = 64
LAYER_INDICES = [1, 2]
LAYERS = tuple(f"model.layers.{i}" for i in LAYER_INDICES)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", shards=4)
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def waiting(home):
    """The first node: waiting for setup, it takes every hostile setup, then the good push."""
    node = ZeroConfigNode(home, REVISION)
    yield node
    node.kill()


def cache_of(home: Path, model: Path) -> Path:
    """`model`'s cache directory under `home` (its parent made, as the node makes it)."""
    (home / "cake").mkdir(exist_ok=True)
    return home / "cake" / f"{cluster_hash(KEY)}-{model_hash(model)}"


def variant(checkpoint: Path, where: Path, config_text: str) -> Path:
    """The checkpoint's files with another config.json (so another model hash, another cache directory)."""
    shutil.copytree(checkpoint, where)
    (where / "config.json").write_text(config_text)
    return where


async def connect(node: ZeroConfigNode) -> WorkerClient:
    return await WorkerClient.connect("127.0.0.1", node.port, cluster_key=KEY, revision=REVISION)


async def assign(node: ZeroConfigNode, model: Path) -> LayerAssignmentAck | WorkerError:
    """A keyed master's LayerAssignment for `model`, and what the node answers it with."""
    async with await connect(node) as client:
        await client.send(LayerAssignment(LAYERS, model_hash(model)))
        return await client.receive()


async def push(node: ZeroConfigNode, model: Path) -> bool:
    """A keyed master's whole setup of `model` (WorkerReady, or RemoteWorkerError); whether the files were needed."""
    async with await connect(node) as client:
        return await client.assign_layers(LAYERS, model_hash(model), model_chunks(model, LAYERS, REVISION))


def assert_waits_and_asks_for(node: ZeroConfigNode, model: Path) -> None:
    """The front still runs, waiting for setup, and a keyed master is asked for `model`'s files."""
    assert node.process.poll() is None
    assert run(assign(node, model)) == LayerAssignmentAck(True)


def logged_reflection(node: ZeroConfigNode, after: int) -> dict:
    return node.wait_for(lambda e: e.get("event", "").endswith("authentication failed")
                         and "reflection" in e.get("error", ""), after=after)


async def reflect(port: int, first_frame) -> object | None:
    """The reflection attack without the key: connection 1's challenge sent as connection 2's
    nonce, connection 2's MAC of it returned on connection 1, then `first_frame` on connection 1.
    Returns the node's answer to that frame, or None when connection 2 was closed unanswered."""
    reader1, writer1 = await asyncio.open_connection("127.0.0.1", port)
    reader2, writer2 = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer1.write(os.urandom(32))
        challenge = (await reader1.readexactly(64))[32:]
        writer2.write(challenge)
        try:
            mac = (await reader2.readexactly(64))[:32]
        except asyncio.IncompleteReadError as closed:
            assert closed.partial == b""
            writer1.write(bytes(32))  # all the attacker has left: connection 1 fails as well
            assert await reader1.read() == b""
            return None
        writer1.writelines([mac, *encode_frame(first_frame, REVISION)])
        header = await reader1.readexactly(8)
        return decode_payload(await reader1.readexactly(read_header(header)), REVISION)
    finally:
        writer1.close()
        writer2.close()


# --------------------------------------------------------------------------- the handshake


def test_a_reflected_handshake_is_refused_by_a_node_waiting_for_setup(waiting, checkpoint, home):
    """The attacker's second connection is closed without the MAC it asked for (logged as a
    reflection), so it never gets to send LayerAssignment; nothing is written, and a keyed
    master's setup is asked for the data."""
    mark, before = waiting.mark(), waiting.files()
    assert run(reflect(waiting.port, LayerAssignment(LAYERS, model_hash(checkpoint)))) is None
    logged_reflection(waiting, mark)
    assert waiting.files() == before
    assert_waits_and_asks_for(waiting, checkpoint)


# --------------------------------------------------------------------------- pushed config.json


BAD_CONFIGS = {
    "no attention heads": lambda c: json.dumps(c | {"num_attention_heads": 0}),
    "no attention heads, no head_dim": lambda c: json.dumps({k: v for k, v in c.items() if k != "head_dim"}
                                                            | {"num_attention_heads": 0}),
    "a JSON list": lambda c: "[1, 2, 3]",
    "architectures a number": lambda c: json.dumps(c | {"architectures": 5}),
    "architectures nested": lambda c: json.dumps(c | {"architectures": [[1]]}),
    "an infinite context": lambda c: json.dumps(c)[:-1] + ', "max_position_embeddings": 1e400}',
    "rope_scaling a number": lambda c: json.dumps(c | {"rope_parameters": None, "rope_scaling": 5}),
    "fewer layers than assigned": lambda c: json.dumps(c | {"num_hidden_layers": 2}),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_pushed_config_that_is_no_model_is_refused_and_the_front_keeps_waiting(
        waiting, checkpoint, tmp_path, home, case):
    """The push is answered WorkerError naming what is wrong (no WorkerReady, no path), its files
    are removed (no marker), the front is alive, and the next setup is asked for the data again."""
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "bad", BAD_CONFIGS[case](config))

    with pytest.raises(RemoteWorkerError, match="cannot load the pushed model") as refused:
        run(push(waiting, model))
    assert str(home) not in str(refused.value)
    assert sorted(p.name for p in cache_of(home, model).iterdir()) == [OWNER]
    assert_waits_and_asks_for(waiting, model)


def test_a_refused_push_removes_only_the_files_it_wrote(waiting, checkpoint, tmp_path, home):
    """A file in the node's own cache directory that the push did not write survives the push's refusal."""
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "bad", json.dumps(config | {"num_attention_heads": 0, "note": "notes"}))
    with pytest.raises(RemoteWorkerError, match="num_attention_heads 0"):
        run(push(waiting, model))  # the directory is the node's from now on
    notes = cache_of(home, model) / "operator-notes.txt"
    notes.write_text("keep")
    with pytest.raises(RemoteWorkerError, match="num_attention_heads 0"):
        run(push(waiting, model))
    assert notes.read_text() == "keep" and not (notes.parent / MARKER).exists()


def test_a_complete_cache_whose_config_is_no_model_is_not_reused(waiting, checkpoint, tmp_path, home):
    """A cache left complete around a bad config.json (as a node that marked before parsing did) is
    asked for again, not loaded: the front neither crashes nor counts it."""
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "poisoned", json.dumps(config | {"num_attention_heads": 0, "note": "old"}))
    cache = cache_of(home, model)
    shutil.copytree(model, cache)
    sizes = {p.name: p.stat().st_size for p in cache.iterdir()}
    (cache / MARKER).write_text(json.dumps({"files": sizes}))
    assert_waits_and_asks_for(waiting, model)


# --------------------------------------------------------------------------- cache directories


def refusal(node: ZeroConfigNode, model: Path, cache: Path) -> str:
    """The WorkerError a keyed setup of `model` is refused with (before any push): it names no
    path, while the node's log names the directory."""
    mark = node.mark()
    reply = run(assign(node, model))
    assert isinstance(reply, WorkerError), reply
    assert str(cache.parent) not in reply.message
    node.wait_for(lambda e: e.get("event") == "model cache directory refused" and e.get("cache") == str(cache), after=mark)
    return reply.message


def test_a_symlinked_cache_directory_is_refused_and_its_target_untouched(waiting, checkpoint, tmp_path, home):
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "linked", json.dumps(config | {"note": "linked"}))
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("id_rsa", "important.txt"):
        (victim / name).write_text("keep")
    cache = cache_of(home, model)
    cache.symlink_to(victim)
    assert "symbolic link" in refusal(waiting, model, cache)
    assert sorted(p.name for p in victim.iterdir()) == ["id_rsa", "important.txt"]
    assert_waits_and_asks_for(waiting, checkpoint)


def test_a_cache_directory_of_files_the_node_did_not_write_is_refused_and_left(waiting, checkpoint, tmp_path, home):
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "foreign", json.dumps(config | {"note": "foreign"}))
    cache = cache_of(home, model)
    cache.mkdir()
    (cache / "notes.txt").write_text("keep")
    (cache / "config.json").write_text('{"num_hidden')  # what an interrupted Cake push may leave
    assert "did not write" in refusal(waiting, model, cache)
    assert sorted(p.name for p in cache.iterdir()) == ["config.json", "notes.txt"]
    assert_waits_and_asks_for(waiting, checkpoint)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_cache_directory_of_another_user_is_refused(waiting, checkpoint, tmp_path, home):
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "theirs", json.dumps(config | {"note": "theirs"}))
    cache = cache_of(home, model)
    cache.mkdir()
    os.chown(cache, 65534, 65534)
    assert "belongs to uid 65534" in refusal(waiting, model, cache)
    assert list(cache.iterdir()) == []
    assert_waits_and_asks_for(waiting, checkpoint)


# --------------------------------------------------------------------------- loads that fail


def test_a_pushed_model_whose_weights_do_not_match_its_config_is_refused_and_removed(
        waiting, checkpoint, tmp_path, home):
    """A config.json that parses but does not fit the weights fails on the devices: the master
    gets WorkerError, the files this push wrote are removed (their fault), and the node waits again."""
    config = json.loads((checkpoint / "config.json").read_text())
    model = variant(checkpoint, tmp_path / "misfit", json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(RemoteWorkerError, match="cannot load the assigned layers: .*give shape"):
        run(push(waiting, model))
    assert sorted(p.name for p in cache_of(home, model).iterdir()) == [OWNER]
    assert_waits_and_asks_for(waiting, model)


# --------------------------------------------------------------------------- an interrupted load


@pytest.fixture(scope="module")
def interrupted(waiting, checkpoint) -> tuple[object, int]:
    """The good push after the bad ones, and SIGTERM while its layers load: the setup's reply and
    the node's exit status (what the restart below starts from, whichever test runs first)."""

    async def main():
        async with await connect(waiting) as client:
            await client.send(LayerAssignment(LAYERS, model_hash(checkpoint)))
            assert await client.receive() == LayerAssignmentAck(True)
            mark = waiting.mark()
            for chunk in model_chunks(checkpoint, LAYERS, REVISION):
                await client.send(chunk)
            await client.send(ModelDataDone())
            await asyncio.to_thread(waiting.wait_for, lambda e: e.get("event") == "device layers", 60, mark)
            waiting.process.send_signal(signal.SIGTERM)
            return await client.receive()

    reply = run(main())
    return reply, waiting.process.wait(timeout=30)


def test_sigterm_while_a_good_push_loads_keeps_the_complete_cache(interrupted, checkpoint, home):
    """The good push after the bad ones is accepted (marker written); SIGTERM while its layers
    load refuses the setup ("stopping") and exits 0, and the cache keeps every file and its marker."""
    reply, status = interrupted
    assert isinstance(reply, WorkerError) and "stopping" in reply.message
    assert status == 0
    cache = cache_of(home, checkpoint)
    assert {"config.json", "tokenizer.json", MARKER} <= {p.name for p in cache.iterdir()}


@pytest.fixture(scope="module")
def restarted(interrupted, home, checkpoint):
    """A second node on the same cache, set up without a push (needs_data false) and serving."""
    node = ZeroConfigNode(home, REVISION)
    try:
        needed = run(push(node, checkpoint))
        node.wait_for(lambda e: e.get("event") == "listening")
        yield node, needed
    finally:
        node.kill()


def test_a_restart_reuses_the_interrupted_cache_and_serves_it(restarted, checkpoint):
    node, needed = restarted
    assert needed is False
    run(serves_hf(node, checkpoint))


async def serves_hf(node: ZeroConfigNode, checkpoint: Path) -> None:
    """A keyed Cake-style master gets HF's hidden states for the layers."""
    ref = HFLayers(checkpoint, LAYER_INDICES, torch.float32)
    master = await CakeMaster.connect(node.port, LAYER_INDICES, cluster_key=KEY, revision=REVISION)
    try:
        x = torch.randn(1, 4, HIDDEN)
        assert_close(await master.forward(x, 0), ref(x, 0))
    finally:
        await master.close()


def test_a_reflected_handshake_is_refused_by_a_serving_node(restarted, checkpoint):
    """Without the key, the reflection gets no Hello answered: the second connection is closed
    and logged; a keyed master is served as before."""
    node, _ = restarted
    mark = node.mark()
    assert run(reflect(node.port, Hello())) is None
    logged_reflection(node, mark)

    async def hello():
        async with await connect(node) as client:
            return await client.hello()

    assert isinstance(run(hello()), WorkerInfo)
    run(serves_hf(node, checkpoint))


def test_the_served_node_still_answers_a_matching_setup(restarted, checkpoint):
    """After the attack the node's own setup is intact: the same assignment is ready at once."""
    node, _ = restarted

    async def main():
        async with await connect(node) as client:
            await client.send(LayerAssignment(LAYERS, model_hash(checkpoint)))
            assert await client.receive() == LayerAssignmentAck(False)
            assert await client.receive() == WorkerReady()
            with pytest.raises((ProtocolError, ConnectionError)):
                await client.receive()

    run(main())
