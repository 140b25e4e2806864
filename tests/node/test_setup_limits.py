"""What setup connections can hold on a live zero-config node: memory, time, places, the event loop.

One node waits for setup for the whole module (no setup completes: none needs its devices),
with a short frame timeout and a low descriptor limit (ulimit -n). Each test checks its
hostile connections' own outcome, the front's memory or descriptors where they are the
point, and that a master holding the key then gets its setup answered.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import pytest

from cakemp.errors import ProtocolError
from cakemp.master.client import WorkerClient
from cakemp.setup.exchange import MAX_FIRST_FRAME, MAX_SETUP_CONNECTIONS, MAX_SETUP_FRAME
from cakemp.sources import GRACE_S
from cakemp.wire import (
    HEADER_SIZE,
    MAGIC,
    LayerAssignment,
    LayerAssignmentAck,
    Revision,
    WorkerError,
    encode_frame,
)
from cakemp.wire.discovery import cluster_hash, encode_probe
from tests.support.checkpoints import make_config
from tests.support.node import ZeroConfigNode, open_fds, rss, scrape

KEY = ZeroConfigNode.KEY
LAYERS = ("model.layers.0", "model.layers.1")
FRAME_TIMEOUT_S = 3
NOFILE = 256
HANDSHAKE_PLACES = 64


def run(coro, timeout: float = 90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    running = ZeroConfigNode(tmp_path_factory.mktemp("home"), 2, "--metrics-address", "127.0.0.1:0",
                             "--frame-timeout", str(FRAME_TIMEOUT_S), nofile=NOFILE)
    yield running
    assert running.stop() == 0


def held(node: ZeroConfigNode) -> float:
    return scrape(node.metrics_port())["cakemp_buffered_bytes", ()]


async def connect(node: ZeroConfigNode) -> WorkerClient:
    return await WorkerClient.connect("127.0.0.1", node.port, cluster_key=KEY, revision=Revision.V2)


async def answer(client: WorkerClient):
    """The node's next message, or "closed"."""
    try:
        return await client.receive()
    except (ProtocolError, ConnectionError):  # the end of the stream, or a reset
        return "closed"


async def asks_for_data(node: ZeroConfigNode, model_hash: str = "0badcafe") -> None:
    """A master holding the key sends a setup and is asked for the data at once."""
    async with await connect(node) as client:
        await client.send(LayerAssignment(LAYERS, model_hash))
        reply = await asyncio.wait_for(client.receive(), 10)
        assert reply == LayerAssignmentAck(needs_data=True), reply


def test_a_first_frame_larger_than_any_layer_assignment_closes_the_connection_unread(node):
    """Three connections each announce a 64 MiB first frame and send 16 MiB of it: each is closed
    at its header, so the front's memory does not grow. (Before: the node read it all, up to
    512 MiB a connection.)"""
    pid = node.process.pid
    announced, sent = 64 << 20, 16 << 20
    mark = node.mark()

    async def main():
        before = rss(pid)
        clients = [await connect(node) for _ in range(3)]
        for client in clients:
            client._writer.write(struct.pack(">II", MAGIC, announced))
        for client in clients:
            try:
                for _ in range(sent >> 20):
                    client._writer.write(bytes(1 << 20))
                    await client._writer.drain()
            except ConnectionError:
                pass  # closed before it had all
        closed = [await asyncio.wait_for(answer(client), 10) for client in clients]
        after = rss(pid)
        for client in clients:
            await client.close()
        await asks_for_data(node)
        return before, after, closed

    before, after, closed = run(main())
    assert closed == ["closed"] * 3
    assert after - before < 8 << 20, f"front RSS grew {(after - before) >> 20} MiB"
    refusals = [e for e in node.events(mark) if e.get("event") == "setup connection closed: not Cake protocol"]
    assert len(refusals) == 3 and all(f"> maximum {MAX_FIRST_FRAME}" in e["error"] for e in refusals), refusals
    print(f"3 connections announcing {announced >> 20} MiB first frames: front RSS {before >> 20} MiB before, "
          f"{after >> 20} MiB after")


def test_a_frame_that_trickles_in_is_closed_at_its_deadline(node):
    """A LayerAssignment sent a byte every half second: the frame must arrive within the frame
    timeout of its header, so it is refused then, whatever trickles. (Before: the idle timeout
    restarted with every byte, so a trickle held the connection for ever.)"""
    frame = b"".join(bytes(piece) for piece in encode_frame(LayerAssignment(LAYERS, "0badcafe"), Revision.V2))

    async def main():
        async with await connect(node) as client:
            started = time.monotonic()
            client._writer.write(frame[:HEADER_SIZE])

            async def trickle():
                for byte in frame[HEADER_SIZE:]:
                    await asyncio.sleep(0.5)
                    client._writer.write(bytes([byte]))

            trickling = asyncio.create_task(trickle())
            try:
                reply = await asyncio.wait_for(client.receive(), 15)
            finally:
                trickling.cancel()
            return reply, time.monotonic() - started

    reply, elapsed = run(main())
    assert isinstance(reply, WorkerError) and f"did not arrive within {FRAME_TIMEOUT_S} s of its header" in reply.message
    assert elapsed < FRAME_TIMEOUT_S + 3, elapsed
    run(asks_for_data(node))


def test_a_push_frame_is_read_within_the_node_buffer_budget_and_is_capped(node):
    """A chunk's frame takes its size from the node's buffer budget (shared with serving
    connections) while it arrives, and gives it back when its connection is closed for not
    sending the rest in time; a chunk frame over 128 MiB and a little is closed unread.
    (Before: setup frames were not counted, and could announce 512 MiB.)"""
    size = 128 << 20

    async def main():
        async with await connect(node) as client:
            await client.send(LayerAssignment(LAYERS, "0badcafe"))
            assert await client.receive() == LayerAssignmentAck(needs_data=True)
            client._writer.write(struct.pack(">II", MAGIC, size) + bytes(1 << 20))
            deadline = time.monotonic() + 10
            while (holding := await asyncio.to_thread(held, node)) < size:
                assert time.monotonic() < deadline, holding
                await asyncio.sleep(0.05)
            reply = await asyncio.wait_for(client.receive(), 10)
        assert isinstance(reply, WorkerError) and "did not arrive within" in reply.message, reply
        async with await connect(node) as client:
            await client.send(LayerAssignment(LAYERS, "0badcafe"))
            assert await client.receive() == LayerAssignmentAck(needs_data=True)
            client._writer.write(struct.pack(">II", MAGIC, MAX_SETUP_FRAME + 1))
            over = await asyncio.wait_for(answer(client), 10)
        return holding, over

    mark = node.mark()
    holding, over = run(main())
    assert holding == size and over == "closed"
    assert node.wait_for(lambda e: e.get("event") == "setup connection closed: not Cake protocol", 10, mark)
    deadline = time.monotonic() + 10
    while held(node) != 0:
        assert time.monotonic() < deadline, "setup frame bytes still held"
        time.sleep(0.05)
    run(asks_for_data(node))


def test_setup_connections_beyond_the_cap_are_refused_and_the_next_is_served(node):
    """With as many setup connections open as the node handles at once, one more is answered
    WorkerError; once they close, a setup is asked for its data. (Before: no cap.)"""

    async def main():
        idle = [await connect(node) for _ in range(MAX_SETUP_CONNECTIONS)]
        async with await connect(node) as extra:
            await extra.send(LayerAssignment(LAYERS, "0badcafe"))
            refused = await asyncio.wait_for(extra.receive(), 10)
        for client in idle:
            await client.close()
        await asyncio.sleep(0.5)  # the node sees the closes
        await asks_for_data(node)
        return refused

    refused = run(main())
    assert isinstance(refused, WorkerError) and f"{MAX_SETUP_CONNECTIONS} setup connections are open" in refused.message


def test_connects_that_never_authenticate_cannot_crowd_out_a_setup(node):
    """300 connects that never send a byte, from 38 addresses (more than the node has descriptors for):
    at most 64 are in the handshake at once, descriptors stay bounded, and a master holding the key
    is asked for its data at once, once their grace is over. (Before: no limit at all before setup.)"""
    pid = node.process.pid

    async def main():
        before = open_fds(pid)
        idle = [(await asyncio.open_connection("127.0.0.1", node.port, local_addr=(f"127.0.1.{i % 38 + 1}", 0)))[1]
                for i in range(300)]
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(scrape, node.metrics_port()))["cakemp_handshakes", ()] < HANDSHAKE_PLACES:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        at_cap = open_fds(pid)
        await asyncio.sleep(GRACE_S)  # the idle connects' grace is over: the master displaces one of them
        started = time.monotonic()
        await asks_for_data(node)
        answered_s = time.monotonic() - started
        for writer in idle:
            writer.close()
        return before, at_cap, answered_s

    before, at_cap, answered_s = run(main())
    assert at_cap <= before + HANDSHAKE_PLACES + 8, (before, at_cap)
    print(f"300 idle connects before setup: front fds {before} before, {at_cap} at the cap (ulimit -n {NOFILE}); "
          f"a setup answered in {answered_s * 1000:.0f} ms")


def test_the_cache_check_runs_off_the_event_loop(node):
    """A cache left by Cake whose index maps 300,000 tensors, checked against 48 layers, takes the
    node seconds to judge (and then refuses it); discovery is answered meanwhile. (Before: the check ran on the event
    loop, so nothing else was served until it ended.)"""
    model_hash = "5eed5eed"
    cache = node.home / "cake" / f"{cluster_hash(KEY)}-{model_hash}"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(make_config("llama").to_json_string())
    layers = tuple(f"model.layers.{i}" for i in range(48))
    # Each layer's one tensor comes last, after 300,000 of no layer asked for: every layer's search scans them all.
    shard = "model-00001-of-00001.safetensors"
    weight_map = {f"model.layers.9999.w{i}": shard for i in range(300_000)} | {f"{layer}.w": shard for layer in layers}
    (cache / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (cache / shard).write_bytes(bytes(8))

    def probe() -> float:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(60)
            started = time.monotonic()
            sock.sendto(encode_probe(cluster_hash(KEY)), ("127.0.0.1", node.discovery_port))
            sock.recv(65536)
            return time.monotonic() - started

    async def main():
        async with await connect(node) as client:
            started = time.monotonic()
            await client.send(LayerAssignment(layers, model_hash))
            await asyncio.sleep(0.3)  # the check is under way
            probe_s = await asyncio.to_thread(probe)
            await asyncio.wait_for(client.receive(), 120)  # answered once the check ended
            return probe_s, time.monotonic() - started

    probe_s, answered_s = run(main(), timeout=180)
    print(f"cache check: answered after {answered_s:.2f} s; a discovery probe during it took {probe_s * 1000:.0f} ms")
    assert answered_s > 0.5, "the check was too quick to tell"
    assert probe_s < answered_s / 4, (probe_s, answered_s)
    run(asks_for_data(node))
