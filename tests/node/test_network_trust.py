"""Who may reach a live node, and what it keeps to itself: --allow-from on TCP and discovery, the
discovery rate limit, the push's disk limit, the key kept out of what the front starts, and a CPU
device's default KV budget.

One zero-config node serves the module, allowing 127.0.0.2 and 127.0.0.3 only (on loopback a
client picks its source address by binding it). 127.0.0.1 plays the peer outside the list, and
each refusal is shown beside a listed master that is still served: it sets the node up, and its
hidden states then match HF's layers. nvidia-smi is a stand-in on PATH that records the
environment it was started with.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import zlib
from pathlib import Path

import pytest
import torch

from cakemp.auth import authenticate_worker
from cakemp.master.client import WorkerClient
from cakemp.master.model_push import model_chunks, model_hash
from cakemp.setup.cache import OWNER
from cakemp.setup.discovery import REPLIES_PER_SOURCE
from cakemp.wire import LayerAssignment, LayerAssignmentAck, ModelDataChunk, Revision, WorkerError
from cakemp.wire.discovery import cluster_hash, decode_announcement, encode_probe
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import from_raw, to_raw
from tests.support.node import ZeroConfigNode, scrape
from tests.support.tolerance import assert_close

KEY = ZeroConfigNode.KEY
LISTED, ALSO_LISTED, OUTSIDE = "127.0.0.2", "127.0.0.3", "127.0.0.1"
LAYER_INDICES = [1, 2]
LAYERS = tuple(f"model.layers.{i}" for i in LAYER_INDICES)
HIDDEN = 64
REFUSED = ("cakemp_refused_connections_total", (("reason", "allow-from"),))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", shards=4)
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return path


@pytest.fixture(scope="module")
def smi_records(tmp_path_factory) -> Path:
    """Where the stand-in nvidia-smi writes the environment of each of its runs."""
    return tmp_path_factory.mktemp("smi-env")


@pytest.fixture(scope="module")
def node(tmp_path_factory, smi_records):
    """The node, with `--gpus all` against an nvidia-smi that lists no GPU (so it asks it, then
    serves on one CPU device)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nenv > "{smi_records}/run-$$"\nexit 0\n')
    smi.chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        running = ZeroConfigNode(tmp_path_factory.mktemp("home"), 2, "--gpus", "all", "--metrics-address",
                                 "127.0.0.1:0", "--allow-from", f"{LISTED}/32, {ALSO_LISTED}")
    yield running
    running.kill()


async def connect_from(source: str, node: ZeroConfigNode) -> WorkerClient:
    """A master's connection from `source`, through the key handshake."""
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port, local_addr=(source, 0))
    try:
        await authenticate_worker(reader, writer, KEY)
    except BaseException:
        writer.close()
        raise
    return WorkerClient(reader, writer, Revision.V2, f"127.0.0.1:{node.port}")


async def closed_unanswered(source: str, node: ZeroConfigNode) -> float:
    """Connect from `source` and send nothing: seconds until the node closes, having sent no byte."""
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port, local_addr=(source, 0))
    start = time.monotonic()
    try:
        assert await reader.read(1) == b""
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    return time.monotonic() - start


def udp_from(source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))
    return sock


def pending(sock: socket.socket) -> list[bytes]:
    """The datagrams `sock` has received and not yet read."""
    sock.setblocking(False)
    datagrams = []
    while True:
        try:
            datagrams.append(sock.recv(65536))
        except BlockingIOError:
            return datagrams


def probe_answered(sock: socket.socket, node: ZeroConfigNode) -> bool:
    """Probe from `sock` and wait for the reply (the node handles datagrams in order, so every
    earlier one from any source has been handled once it comes)."""
    sock.sendto(encode_probe(cluster_hash(KEY)), ("127.0.0.1", node.discovery_port))
    sock.settimeout(30)
    return decode_announcement(sock.recv(65536)).port == node.port


# --------------------------------------------------------------------------- while waiting for setup


def test_a_peer_outside_the_list_is_closed_on_accept_and_counted_while_a_listed_master_authenticates(node):
    """Closed before the handshake: nothing sent, long before the 10 s a handshake may take; logged
    and counted by reason. A master from a listed address gets the handshake."""
    mark = node.mark()
    assert run(closed_unanswered(OUTSIDE, node)) < 5
    refused = node.wait_for(lambda e: e.get("event") == "refusing a connection: not in --allow-from", after=mark)
    assert refused["peer"] == OUTSIDE
    assert scrape(node.metrics_port())[REFUSED] == 1

    async def listed():
        client = await connect_from(LISTED, node)
        await client.close()

    run(listed())


def test_discovery_answers_a_listed_source_only(node):
    """A probe from outside the list gets no reply; one from a listed address, sent after it, does."""
    with udp_from(OUTSIDE) as outside, udp_from(LISTED) as listed:
        outside.sendto(encode_probe(cluster_hash(KEY)), ("127.0.0.1", node.discovery_port))
        assert probe_answered(listed, node)
        assert pending(outside) == []


def test_discovery_answers_one_source_a_few_times_per_second(node):
    """20 probes in a burst from one source get REPLIES_PER_SOURCE replies (twice that if the burst
    straddles two windows); another source is answered meanwhile."""
    with udp_from(ALSO_LISTED) as flooding, udp_from(LISTED) as listed:
        start = time.monotonic()
        for _ in range(20):
            flooding.sendto(encode_probe(cluster_hash(KEY)), ("127.0.0.1", node.discovery_port))
        burst = time.monotonic() - start
        assert probe_answered(listed, node)
        replies = pending(flooding)
    assert burst < 0.5
    assert REPLIES_PER_SOURCE <= len(replies) <= 2 * REPLIES_PER_SOURCE
    assert all(decode_announcement(reply).port == node.port for reply in replies)


def test_a_file_bigger_than_the_disk_has_room_for_is_refused_before_a_byte_is_written(node, checkpoint):
    """The first chunk announces a config.json of the disk's free space (more than its room, which
    keeps a margin): WorkerError, and no file in the cache."""
    disk = os.statvfs(node.home)
    free = disk.f_bavail * disk.f_frsize

    async def main():
        client = await connect_from(LISTED, node)
        try:
            await client.send(LayerAssignment(LAYERS, model_hash(checkpoint)))
            ack = await client.receive()
            assert isinstance(ack, LayerAssignmentAck) and ack.needs_data
            data = b"{}"
            await client.send(ModelDataChunk("config.json", 0, free, data, False, zlib.crc32(data)))
            return await client.receive()
        finally:
            await client.close()

    refusal = run(main())
    assert isinstance(refusal, WorkerError) and "would take the push past the limit" in refusal.message
    assert {path.name for path in node.files()} == {OWNER}  # only cakemp's record that the directory is its own


# --------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def served(node, checkpoint):
    """The listed master's full push: WorkerReady, then the node serves."""

    async def main():
        client = await connect_from(LISTED, node)
        try:
            return await client.assign_layers(LAYERS, model_hash(checkpoint),
                                              model_chunks(checkpoint, LAYERS, Revision.V2, 16 << 10))
        finally:
            await client.close()

    assert run(main()) is True
    node.wait_for(lambda e: e.get("event") == "listening")
    return node


def test_the_listed_master_is_served_and_a_peer_outside_the_list_is_still_refused(served, checkpoint):
    """Hidden states through layers 1-2 from 127.0.0.2 match HF's; 127.0.0.1 is closed on accept, counted again."""
    before = scrape(served.metrics_port())[REFUSED]
    x = torch.randn(1, 5, HIDDEN)

    async def main():
        client = await connect_from(LISTED, served)
        try:
            await client.hello()
            return from_raw(await client.batch(to_raw(x), [(f"model.layers.{i}", 0, i) for i in LAYER_INDICES]))
        finally:
            await client.close()

    assert_close(run(main()), HFLayers(checkpoint, LAYER_INDICES, torch.float32)(x, 0))
    assert run(closed_unanswered(OUTSIDE, served)) < 5
    assert scrape(served.metrics_port())[REFUSED] == before + 1


def test_the_key_reaches_neither_the_device_process_nor_nvidia_smi(served, smi_records):
    """The front took the key's variable out of its environment once read: the device process's
    environment and each nvidia-smi run's lack it. (The front's own /proc/<pid>/environ, the
    environment it was started with, still shows it: the kernel's copy, readable by its user alone.)"""
    device = Path(f"/proc/{served.device_pid(0)}/environ").read_bytes()
    assert b"PATH=" in device and b"CAKE_CLUSTER_KEY" not in device and KEY.encode() not in device
    runs = [path.read_text() for path in smi_records.iterdir()]
    assert runs and all("PATH=" in env and "CAKE_CLUSTER_KEY" not in env and KEY not in env for env in runs)
    assert KEY.encode() in Path(f"/proc/{served.process.pid}/environ").read_bytes()


def test_a_cpu_device_without_a_budget_gets_half_the_memory_available(served):
    """No --kv-budget-mib: the CPU device's KV budget, as /metrics reports it, is half the memory
    that was available at start; at most half the machine's."""
    budget = scrape(served.metrics_port())["cakemp_kv_cache_budget_bytes", (("device", "cpu:0"),)]
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < budget <= total / 2
