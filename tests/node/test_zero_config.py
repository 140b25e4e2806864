"""`cakemp run --cluster-key K` without a topology, as a real process: discovery, setup, push, serving.

One node per protocol revision starts waiting for setup; the hostile pushes run against it
first (each refused, the next setup asked for the data again), then a real push in many
small chunks, then a Cake-style master whose hidden states match HF's layers. A second node
on the revision-2 cache takes the same assignment without a push; SIGTERM exits 0 while serving
(each node's teardown) and while waiting.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import zlib
from pathlib import Path

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from cakemp.errors import AuthError, ProtocolError, RemoteWorkerError
from cakemp.master.client import WorkerClient
from cakemp.master.discovery import discover
from cakemp.master.model_push import model_chunks, model_hash
from cakemp.wire import (
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    ModelDataChunk,
    ModelDataDone,
    Revision,
    WorkerError,
    WorkerReady,
)
from cakemp.wire.discovery import cluster_hash, decode_announcement, encode_probe
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster
from tests.support.node import ZeroConfigNode
from tests.support.tolerance import assert_close

KEY = ZeroConfigNode.KEY
HIDDEN = 64
LAYER_INDICES = [1, 2]
LAYERS = tuple(f"model.layers.{i}" for i in LAYER_INDICES)
CHUNK_BYTES = 16 << 10  # the checkpoint's shards are ~150 KiB: many chunks per file


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Revision 1 pushes a single model.safetensors, revision 2 an index and the two shards of layers 1-2."""
    root = tmp_path_factory.mktemp("ckpt")
    paths = {Revision.V1: make_checkpoint(root, "llama", seed=1), Revision.V2: make_checkpoint(root, "llama", shards=4)}
    for path in paths.values():
        (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')  # Cake's master refuses to push without one
    return paths


@pytest.fixture(scope="module", params=[Revision.V1, Revision.V2], ids=["rev1", "rev2"])
def node(request, tmp_path_factory):
    """A zero-config node waiting for setup (set up by `served`, after the hostile tests)."""
    running = ZeroConfigNode(tmp_path_factory.mktemp("home"), request.param)
    yield running
    assert running.stop() == 0  # SIGTERM while serving (or still waiting) exits 0


async def connect(node: ZeroConfigNode, key: str = KEY) -> WorkerClient:
    return await WorkerClient.connect("127.0.0.1", node.port, cluster_key=key, revision=node.revision)


async def assign(client: WorkerClient, model: Path, layers=LAYERS, hash_: str | None = None) -> bool:
    """Send a LayerAssignment and return the Ack's needs_data."""
    await client.send(LayerAssignment(tuple(layers), model_hash(model) if hash_ is None else hash_))
    reply = await client.receive()
    assert isinstance(reply, LayerAssignmentAck), reply
    return reply.needs_data


async def refusal(client: WorkerClient) -> str:
    """What the node answered a refused setup with: its WorkerError's message, or "closed"."""
    try:
        reply = await client.receive()
    except (ProtocolError, ConnectionError):
        return "closed"
    assert isinstance(reply, WorkerError), reply
    try:  # then it closes the connection
        await client.receive()
    except (ProtocolError, ConnectionError):
        return reply.message
    raise AssertionError("the node kept the refused setup connection open")


def chunk(name: str, offset: int, data: bytes, total: int | None = None, *, revision: Revision,
          compressed: bool = False, crc: int | None = None) -> ModelDataChunk:
    if revision < Revision.V2:
        return ModelDataChunk(name, offset, len(data) if total is None else total, data)
    return ModelDataChunk(name, offset, len(data) if total is None else total, data, compressed,
                          zlib.crc32(data) if crc is None else crc)


def assert_asks_for_data_again(node: ZeroConfigNode, model: Path) -> None:
    """The node still waits for setup, and the next one is asked for the data (the cache is not valid)."""

    async def main():
        async with await connect(node) as client:
            assert await assign(client, model) is True

    run(main())


def pushed_chunks(model: Path, revision: Revision) -> list[ModelDataChunk]:
    return list(model_chunks(model, LAYERS, revision, CHUNK_BYTES))


# --------------------------------------------------------------------------- discovery


def test_discovery_answers_its_cluster_with_the_bound_tcp_port_and_ignores_the_rest(node):
    """Garbage and another cluster's probe get no answer; this cluster's probe gets the reply, unicast back."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        target = ("127.0.0.1", node.discovery_port)
        for junk in (b"", b"CAKE", b"CAKE{not json", b"CAKE[1,2]", b"\xff" * 4000, encode_probe("00000000")):
            sock.sendto(junk, target)
        sock.sendto(encode_probe(cluster_hash(KEY)), target)
        sock.settimeout(30)
        reply = decode_announcement(sock.recv(65536))
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # datagrams are handled in order: nothing came before the reply
            sock.recv(65536)
    assert (reply.cluster_hash, reply.worker_name, reply.port) == (cluster_hash(KEY), "worker", node.port)
    assert reply.os == "linux" and reply.hostname == socket.gethostname() and reply.backend == "CPU"
    (gpu,) = reply.gpus
    assert gpu.name.startswith("CPU (") and gpu.vram_bytes > 0 and gpu.tflops == 2.0


def test_the_master_side_discovers_the_node(node):
    """cakemp's own master finds the node by unicast and reaches it at the reply's address and port."""
    (worker,) = run(discover(KEY, ["127.0.0.1"], port=node.discovery_port, timeout=30, min_workers=1))
    assert (worker.name, worker.address) == ("worker", f"127.0.0.1:{node.port}")


# --------------------------------------------------------------------------- hostile setups


def hostile_pushes(revision: Revision, model: Path) -> dict[str, list[ModelDataChunk]]:
    """Pushes that must be refused, each after a valid LayerAssignment; the data is good except where noted."""
    good = pushed_chunks(model, revision)
    config = (model / "config.json").read_bytes()
    cases = {
        "traversal by name": [chunk("../escaped.json", 0, config, revision=revision)],
        "absolute name": [chunk(str(model.parent / "absolute.json"), 0, config, revision=revision)],
        "name with a directory": [chunk("sub/config.json", 0, config, revision=revision)],
        "file not in the push list": [chunk("evil.bin", 0, config, revision=revision)],
        "gap in the offsets": [chunk("config.json", 0, config[:10], len(config), revision=revision),
                               chunk("config.json", 20, config[20:], len(config), revision=revision)],
        "more bytes than total_size": [chunk("config.json", 0, config, len(config) - 1, revision=revision)],
        "push ended short": [chunk("config.json", 0, config[:10], len(config), revision=revision)],
        "a shard the index does not name": good[:3] + [chunk("model-00001-of-00004.safetensors", 0, b"x" * 8,
                                                              revision=revision)],
        "no config.json": [c for c in good if c.filename != "config.json"],
    }
    if revision >= Revision.V2:
        frame = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(config)
        bomb = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(64 << 20))
        cases |= {
            "bad CRC": [chunk("config.json", 0, config, revision=revision, crc=zlib.crc32(config) ^ 1)],
            "truncated zstd frame": [chunk("config.json", 0, frame[:-6], len(config), revision=revision,
                                           compressed=True)],
            "not zstd at all": [chunk("config.json", 0, config, revision=revision, compressed=True)],
            "zstd past total_size": [chunk("config.json", 0, bomb, 1000, revision=revision, compressed=True)],
        }
    else:
        cases = {k: v for k, v in cases.items() if k != "a shard the index does not name"}  # one file at rev 1
    return cases


CASES = ["traversal by name", "absolute name", "name with a directory", "file not in the push list",
         "gap in the offsets", "more bytes than total_size", "push ended short", "a shard the index does not name",
         "no config.json", "bad CRC", "truncated zstd frame", "not zstd at all", "zstd past total_size"]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_push_is_refused_writes_nothing_outside_the_cache_and_the_next_setup_asks_again(
        node, checkpoints, case):
    """Each push is answered WorkerError (never WorkerReady) and closed; the node keeps waiting."""
    model = checkpoints[node.revision]
    pushes = hostile_pushes(node.revision, model)
    if case not in pushes:
        pytest.skip(f"{case!r} needs a revision-2 chunk or a sharded checkpoint")
    before = node.files()

    async def main():
        async with await connect(node) as client:
            assert await assign(client, model) is True
            try:
                for c in pushes[case] + [ModelDataDone()]:
                    await client.send(c)
            except ConnectionError:
                pass  # refused at an earlier chunk
            return await refusal(client)

    message = run(main())
    assert message != "closed", "expected a WorkerError saying why"
    cache = node.home / "cake" / f"{cluster_hash(KEY)}-{model_hash(model)}"
    assert {p for p in node.files() - before if cache not in p.parents} == set()
    assert not (cache / ".cakemp-complete").exists()
    assert not (model.parent / "absolute.json").exists() and not (node.home / "cake" / "escaped.json").exists()
    assert_asks_for_data_again(node, model)


@pytest.mark.parametrize("hash_", ["../../escaped", "DEADBEEF", "/tmp", "abc", "0123456789"])
def test_a_model_hash_that_is_not_8_hex_digits_is_refused_before_any_directory_is_made(node, checkpoints, hash_):
    """The model hash becomes a path component: anything but 8 lowercase hex digits is refused."""
    before = {p for p in node.home.rglob("*")}

    async def main():
        async with await connect(node) as client:
            await client.send(LayerAssignment(LAYERS, hash_))
            return await refusal(client)

    assert "model hash" in run(main())
    assert {p for p in node.home.rglob("*")} == before
    assert_asks_for_data_again(node, checkpoints[node.revision])


def test_a_push_cut_off_midway_leaves_the_cache_invalid(node, checkpoints):
    """Half the chunks, then the connection closes: no marker, no partial file left, data asked again."""
    model = checkpoints[node.revision]
    chunks = pushed_chunks(model, node.revision)

    async def main():
        async with await connect(node) as client:
            assert await assign(client, model) is True
            for c in chunks[: len(chunks) // 2 + 1]:
                await client.send(c)

    run(main())
    assert_asks_for_data_again(node, model)  # it is also served after the abort of the cut push
    assert not [p for p in node.files() if p.name.endswith(".partial")]


def test_a_wrong_key_a_silent_connection_and_a_hello_do_not_block_or_end_the_setup(node, checkpoints):
    """A master with the wrong key is refused at the handshake; a Hello before setup gets WorkerError;
    a connection that never speaks stays open meanwhile without holding the next setup up."""

    async def main():
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", node.port)
        with pytest.raises(AuthError):
            await connect(node, key="wrong key")
        async with await connect(node) as client:
            await client.send(Hello())
            assert "LayerAssignment" in await refusal(client)
        async with await connect(node) as client:
            assert await assign(client, checkpoints[node.revision]) is True
        silent_writer.close()

    run(main())


def test_a_newer_setup_replaces_a_push_left_hanging(node, checkpoints):
    """A push that stops midway (its master gone quiet) does not hold up a reconnecting master:
    the newer setup is asked for the data, and the stale one is told it was replaced."""
    model = checkpoints[node.revision]
    chunks = pushed_chunks(model, node.revision)

    async def main():
        async with await connect(node) as stale:
            assert await assign(stale, model) is True
            for c in chunks[:2]:
                await stale.send(c)
            async with await connect(node) as newer:
                assert await assign(newer, model) is True
                assert "replaced" in await refusal(stale)

    run(main())


async def answers(client: WorkerClient) -> list[str]:
    """The type names of everything the node sends on `client` until it closes the connection."""
    received = []
    while True:
        try:
            reply = await client.receive()
        except (ProtocolError, ConnectionError):
            return received
        received.append(type(reply).__name__ if not isinstance(reply, WorkerError) else reply.message)


def test_setups_in_quick_succession_leave_the_next_able_to_complete_without_flooding_the_log(node, checkpoints):
    """A push left hanging, then three setups at once and one abandoned right after its assignment
    (masters restarting together, or retrying fast): each is answered or closed, the next setup is
    asked for the data at once (the `served` fixture's master then completes it), and the node
    logs a line or two per connection, not a flood of warnings."""
    model = checkpoints[node.revision]
    assignment = LayerAssignment(LAYERS, model_hash(model))
    mark = node.mark()

    async def main():
        stale = await connect(node)
        assert await assign(stale, model) is True  # and its push never comes
        together = [await connect(node) for _ in range(3)]
        await asyncio.gather(*(client.send(assignment) for client in together))
        abandoned = await connect(node)
        await abandoned.send(assignment)
        await abandoned.close()
        async with await connect(node) as last:
            assert await asyncio.wait_for(assign(last, model), 15) is True
            # Everyone before it was told it was replaced (after its Ack, if it got that far) and closed.
            for client in (stale, *together):
                told = await asyncio.wait_for(answers(client), 15)
                assert told[-1] == "a newer setup replaced this one", told
                await client.close()

    run(main())
    lines = node.lines[mark:]
    assert len(lines) < 60, f"{len(lines)} log lines for 6 setup connections"


def test_a_pushed_model_that_cannot_load_is_refused_and_the_node_waits_again(node, tmp_path):
    """Whole files holding the layers, but an architecture cakemp does not run: the push is refused
    (its config.json is checked before the cache counts), the master gets WorkerError (not
    WorkerReady), and the cache does not count (revision 2 only, as when the devices refused it)."""
    if node.revision < Revision.V2:
        pytest.skip("one device start suffices")
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    (model / "tokenizer.json").write_text("{}")
    save_file({f"{layer}.weight": torch.zeros(2) for layer in LAYERS}, model / "model.safetensors")

    async def main():
        async with await connect(node) as client:
            with pytest.raises(RemoteWorkerError, match="cannot load") as refused:
                await client.assign_layers(LAYERS, model_hash(model), model_chunks(model, LAYERS, node.revision))
            assert "GPT2LMHeadModel" in str(refused.value) and str(node.home) not in str(refused.value)

    run(main())
    assert_asks_for_data_again(node, model)


# --------------------------------------------------------------------------- the real push


@pytest.fixture(scope="module")
def served(node, checkpoints):
    """The node after a full push of layers 1-2 in many chunks: it answered WorkerReady and serves."""
    model = checkpoints[node.revision]
    chunks = pushed_chunks(model, node.revision)

    async def main():
        async with await connect(node) as client:
            return await client.assign_layers(LAYERS, model_hash(model), chunks)

    assert run(main()) is True
    node.wait_for(lambda e: e.get("event") == "listening")
    return node, chunks


def test_a_full_push_in_many_chunks_then_the_layers_match_hf(served, checkpoints):
    """The pushed layers serve per-layer connections (as Cake's master opens them) matching HF's layers."""
    node, chunks = served
    model = checkpoints[node.revision]
    assert len(chunks) > 10
    if node.revision >= Revision.V2:
        assert any(c.compressed for c in chunks) and not all(c.compressed for c in chunks)
    ref = HFLayers(model, LAYER_INDICES, torch.float32)

    async def main():
        master = await CakeMaster.connect(node.port, LAYER_INDICES, cluster_key=KEY, revision=node.revision)
        x = torch.randn(1, 5, HIDDEN)
        assert_close(await master.forward(x, 0), ref(x, 0))
        x = torch.randn(1, 1, HIDDEN)
        assert_close(await master.forward(x, 5), ref(x, 5))
        await master.close()

    run(main())


def test_discovery_keeps_answering_while_serving(served):
    """A restarted master can find the node again once it serves."""
    node, _ = served
    (worker,) = run(discover(KEY, ["127.0.0.1"], port=node.discovery_port, timeout=30, min_workers=1))
    assert worker.address == f"127.0.0.1:{node.port}"


def test_a_new_assignment_while_serving_is_ready_when_it_matches_and_refused_when_it_does_not(served, checkpoints):
    """A restarted master sending the same setup is answered Ack(false), WorkerReady; other layers get WorkerError."""
    node, _ = served
    model = checkpoints[node.revision]

    async def main():
        async with await connect(node) as client:
            assert await assign(client, model) is False
            assert isinstance(await client.receive(), WorkerReady)
        async with await connect(node) as client:
            await client.send(LayerAssignment(("model.layers.0",), model_hash(model)))
            return await refusal(client)

    assert "restart it" in run(main())


def test_a_restart_reuses_the_cache_without_a_push(served, checkpoints, tmp_path):
    """A second node on the same cache says needs_data=false, receives nothing and serves the layers
    (at revision 2 only: a node start is dear, and the cache does not depend on the revision)."""
    node, _ = served
    if node.revision < Revision.V2:
        pytest.skip("one restart suffices")
    model = checkpoints[node.revision]
    second = ZeroConfigNode(node.home, node.revision)
    try:
        async def main():
            async with await WorkerClient.connect("127.0.0.1", second.port, cluster_key=KEY,
                                                  revision=node.revision) as client:
                return await client.assign_layers(LAYERS, model_hash(model), ())

        assert run(main()) is False
        second.wait_for(lambda e: e.get("event") == "listening")
        ref = HFLayers(model, LAYER_INDICES, torch.float32)

        async def forward():
            master = await CakeMaster.connect(second.port, LAYER_INDICES, cluster_key=KEY, revision=node.revision)
            x = torch.randn(1, 3, HIDDEN)
            assert_close(await master.forward(x, 0), ref(x, 0))
            await master.close()

        run(forward())
    finally:
        assert second.stop() == 0


def test_sigterm_while_waiting_for_setup_exits_0_and_the_name_defaults_to_the_host_name(tmp_path):
    """A node started without --name advertises the host name; never set up, it stops cleanly on SIGTERM."""
    waiting = ZeroConfigNode(tmp_path, Revision.V2, name=None)
    assert waiting.started["worker_name"] == socket.gethostname()
    waiting.process.send_signal(signal.SIGTERM)
    assert waiting.process.wait(timeout=30) == 0
