"""Hostile and broken clients against a live node: each gets its WorkerError or its close, alone.

Every case checks the same four things: the hostile request's own outcome, that the node keeps
serving, that no device process was restarted (the restart metric stays 0), and that a
bystander session prefilled before it decodes exactly as HF's layers after it. One node serves
the module; the last test stops it with SIGHUP.
"""

from __future__ import annotations

import asyncio
import re
import signal
import struct
import subprocess
import time

import pytest
import torch

from cakemp import log
from cakemp.errors import RemoteWorkerError
from cakemp.master.client import WorkerClient
from cakemp.wire import (
    HEADER_SIZE,
    MAGIC,
    Batch,
    DType,
    Hello,
    LayerOp,
    RawTensor,
    Revision,
    WorkerInfo,
    decode_payload,
    encode_frame,
    read_header,
)
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import CakeMaster, from_raw, to_raw
from tests.support.node import RunningNode, rss, scrape, write_topology

HIDDEN = 64
LAYERS = [0, 1, 2, 3]  # 0-1 on cpu:0, 2-3 on cpu:1
OPS = [(f"model.layers.{i}", 0, i) for i in LAYERS]
MAX_CONTEXT = 64
MAX_CONNECTIONS = 12
# Long enough that no legitimate frame comes near the frame timeout on a loaded machine; the idle
# timeout well above it, since a bystander session sits idle through a frame-timeout attack. The
# tests that need them to pass wait for the node's own log line.
FRAME_TIMEOUT_S = 3
IDLE_TIMEOUT_S = 10
F32_ATOL = 1e-4
REFUSED_AT_MAX = ("cakemp_refused_connections_total", (("reason", "max-connections"),))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """8 layers, of which the node serves 0-3: the KV slots of the other four are not its to give."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def node(checkpoint, runtime, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--max-context",
                          str(MAX_CONTEXT), "--metrics-address", "127.0.0.1:0", "--frame-timeout",
                          str(FRAME_TIMEOUT_S), "--session-idle-timeout", str(IDLE_TIMEOUT_S),
                          "--max-connections", str(MAX_CONNECTIONS), env={"RUNTIME_DIRECTORY": str(runtime)})
    yield running
    running.kill()


@pytest.fixture(scope="module")
def hf(checkpoint):
    """A fresh HF reference of layers 0-3 per call (the model is loaded once: building it is most of a test's time)."""
    return HFLayers(checkpoint, LAYERS, torch.float32).fresh


def restarts(node: RunningNode) -> float:
    return sum(v for (name, _), v in scrape(node.metrics_port()).items() if name == "cakemp_device_restarts_total")


async def survives(node: RunningNode, ref: HFLayers, attack) -> object:
    """Run `attack()` between a bystander's prefill and its decode step; the bystander's results must
    match HF's layers (`ref`, fresh) and no device may restart. Returns what `attack` returned."""
    bystander = await CakeMaster.connect(node.port, LAYERS)
    x = torch.randn(1, 5, HIDDEN)
    torch.testing.assert_close(await bystander.forward(x, 0), ref(x, 0), atol=F32_ATOL, rtol=0)
    outcome = await attack()
    x = torch.randn(1, 1, HIDDEN)
    torch.testing.assert_close(await bystander.forward(x, 5), ref(x, 5), atol=F32_ATOL, rtol=0)
    await bystander.close()
    assert await asyncio.to_thread(restarts, node) == 0
    assert node.process.poll() is None
    return outcome


async def refused(node: RunningNode, x: RawTensor, ops) -> str:
    """The WorkerError text answering Batch(x, ops); the same connection then serves a good request."""
    async with await WorkerClient.connect("127.0.0.1", node.port) as client:
        await client.hello()
        with pytest.raises(RemoteWorkerError) as error:
            await client.batch(x, ops)
        y = await client.batch(to_raw(torch.randn(1, 1, HIDDEN)), OPS)
        assert (y.dtype, y.shape) == (DType.F32, (1, 1, HIDDEN))
    return str(error.value).split("reported error: ", 1)[1]


async def closed(node: RunningNode, data: bytes, hello: bool = True) -> bytes:
    """What the node answers to raw `data` (after Hello) before it closes the connection (a reset,
    which a close with unread bytes sends, counts as a close with no answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    if hello:
        writer.writelines(encode_frame(Hello(), Revision.V2))
        header = await reader.readexactly(HEADER_SIZE)
        assert isinstance(decode_payload(await reader.readexactly(read_header(header)), Revision.V2), WorkerInfo)
    writer.write(data)
    try:
        answer = await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        answer = b""
    writer.close()
    return answer


GOOD = to_raw(torch.randn(1, 2, HIDDEN))


@pytest.mark.parametrize("x, ops, words", [
    # 255 ones then 64, 256 bytes of f32: once an unhandled exception in the front and a hung device.
    (RawTensor(bytes(HIDDEN * 4), DType.F32, (1,) * 255 + (HIDDEN,)), OPS, "of 256 dimensions"),
    # The product wraps past 2^64 to 0 and matched the empty data: once a 1.4 KB C++ backtrace.
    (RawTensor(b"", DType.F32, (2**64 - 1, 0)), OPS, r"shape \[18446744073709551615, 0\], expected \[1, T, 64\]"),
    (RawTensor(bytes(8 * HIDDEN), DType.F32, (2, 1, HIDDEN)), OPS, r"\[2, 1, 64\]"),
    (RawTensor(bytes(4 * 32), DType.F32, (1, 1, 32)), OPS, r"\[1, 1, 32\], expected \[1, T, 64\]"),
    (RawTensor(bytes(2 * HIDDEN), DType.U8, (1, 2, HIDDEN)), OPS, "unsupported dtype U8"),
    (RawTensor(bytes(2 * HIDDEN), DType.F8E4M3, (1, 2, HIDDEN)), OPS, "unsupported dtype F8E4M3"),
    (to_raw(torch.randn(1, MAX_CONTEXT + 1, HIDDEN)), OPS, "65 positions in one request pass the context limit"),
    (GOOD, [("model.layers.0", MAX_CONTEXT - 1, 0)], "positions 63..64 of layer model.layers.0 pass"),
    (GOOD, [("model.layers.0", 2**64 - 1, 0)], "pass the context limit of 64 positions"),
    # The bystander's own layer run, which the front has admitted (and keeps), at a position past the limit.
    (GOOD, [(layer, MAX_CONTEXT - 1, block) for layer, _, block in OPS], "positions 63..64 of layer model.layers.0"),
    (GOOD, OPS * 250, "has 1000 ops; this worker serves 4 layers"),
    (GOOD, OPS[:2] + OPS[:1], "layer model.layers.0 appears twice"),
    (GOOD, [("model.layers.0", 0, 3), ("model.layers.1", 0, 3)], "block_idx 3 .* appears twice"),
    (GOOD, [("model.layers.0", 0, 2**64 - 1)], "block_idx 18446744073709551615 of layer model.layers.0 is not a KV slot"),
    # A layer of the model this node does not serve, as a KV slot: once admitted, so one session could
    # hold a slot for each of the model's 8 layers on a node serving 4 (security review M5).
    (GOOD, [("model.layers.0", 0, 5)], r"block_idx 5 of layer model.layers.0 is not a KV slot .*\(0-3\)"),
    (GOOD, [("model.layers.4", 0, 4)], "^could not find layer model.layers.4$"),
    (GOOD, [("\x1b[2J" + "é" * 1000, 0, 0)], r"could not find layer '\\x1b\[2Jé+… \(1004 chars\)'"),
    # A sound frame whose bytes do not match its shape: the decoder's BadTensor, answered.
    (RawTensor(bytes(3), DType.F32, (1, 1, HIDDEN)), OPS, "data is 3 bytes"),
])
def test_a_request_no_device_could_serve_is_refused_by_the_front(node, hf, x, ops, words):
    """Hostile shapes, dtypes, positions and layer runs get a short WorkerError naming the limit, with
    no traceback or path in it; nothing reaches a device, the connection stays usable."""
    message = run(survives(node, hf(), lambda: refused(node, x, ops)))
    assert re.search(words, message), message
    assert len(message) < 300 and "Traceback" not in message and not re.search(r"/\w+/|0x[0-9a-f]{6,}", message)


def test_half_a_million_ops_close_the_connection_before_it_is_read(node, hf):
    """A Batch of 500,000 valid ops (17 MB) is bigger than any frame this model can need: the node
    closes the connection after the header, without reading or running any of it."""
    frame = b"".join(bytes(b) for b in encode_frame(Batch(GOOD, (LayerOp("model.layers.0", 0, 0),) * 500_000),
                                                    Revision.V2))
    mark = node.mark()
    assert run(survives(node, hf(), lambda: closed(node, frame))) == b""
    node.wait_for(lambda e: e.get("event") == "closing connection" and "payload length" in e.get("error", ""),
                  after=mark)


def test_a_run_shaped_like_a_bystanders_is_read_as_its_master_wrote_it(node, hf):
    """Four ops whose names are as long as the bystander's (layers 4-7 for its 0-3), sent once the front has
    read the bystander's run (and keeps its layout, to read the next of four ops at once): refused by their
    own names, never read as the bystander's run."""
    ops = [(f"model.layers.{i + 4}", 0, i) for i in LAYERS]
    assert run(survives(node, hf(), lambda: refused(node, GOOD, ops))) == "could not find layer model.layers.4"


def test_a_run_whose_length_field_disagrees_with_the_learnt_layout_closes_only_its_connection(node, hf):
    """The bystander's own run with its first name's length one short: read as it says (the fields after
    it shifted, past the payload's end), so the connection is closed as truncated; the bystander's run,
    read through the layout it left, decodes on."""
    frame = bytearray(b"".join(bytes(b) for b in encode_frame(Batch(GOOD, tuple(LayerOp(*op) for op in OPS)),
                                                               Revision.V2)))
    at = frame.index(b"model.layers.0") - 4
    frame[at:at + 4] = (len("model.layers.0") - 1).to_bytes(4, "big")
    mark = node.mark()
    assert run(survives(node, hf(), lambda: closed(node, bytes(frame)))) == b""
    node.wait_for(lambda e: e.get("event") == "closing connection" and "truncated payload" in e.get("error", ""),
                  after=mark)


@pytest.mark.parametrize("data, words", [
    (b"GET / HTTP/1.1\r\n\r\n", "invalid magic"),
    (struct.pack(">II", MAGIC, 2**32 - 1), "payload length 4294967295 > maximum"),
    (struct.pack(">II", MAGIC, 4) + (99).to_bytes(4, "big"), "unknown message tag 99"),
    (struct.pack(">II", MAGIC, 12) + (3).to_bytes(4, "big") + (2**32 - 1).to_bytes(4, "big") + bytes(4),
     "truncated payload"),
])
def test_bytes_that_are_not_cake_protocol_close_only_their_connection(node, hf, data, words):
    """Bad magic, a hostile length, an unknown tag, a truncated tensor: closed unanswered, logged as the peer's fault."""
    mark = node.mark()
    assert run(survives(node, hf(), lambda: closed(node, data))) == b""
    event = node.wait_for(lambda e: e.get("event") == "closing connection" and words in e.get("error", ""),
                          after=mark)
    assert event["fault"] == "peer" and event["level"] == "warning"


def test_requests_written_ahead_of_their_replies_are_answered_in_turn(node, hf):
    """A master that writes Hello, forty 48-token prompts (480 KiB: more than a connection holds ahead
    of a reply, and than a read brings) and a decode step in one go, then reads: each is answered in
    order, as if it had waited for each reply, and each result is HF's (a prompt at position 0 starts
    afresh)."""
    prompts = [torch.randn(1, 48, HIDDEN) for _ in range(40)]
    step = torch.randn(1, 1, HIDDEN)

    async def ahead():
        reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
        frames = [Hello()] + [Batch(to_raw(x), tuple(LayerOp(name, at, block) for name, _, block in OPS))
                              for x, at in [(x, 0) for x in prompts] + [(step, 48)]]
        writer.write(b"".join(bytes(b) for frame in frames for b in encode_frame(frame, Revision.V2)))
        replies = []
        for _ in frames:
            header = await reader.readexactly(HEADER_SIZE)
            replies.append(decode_payload(await reader.readexactly(read_header(header)), Revision.V2))
        writer.close()
        return replies

    info, *answers = run(survives(node, hf(), ahead))
    assert isinstance(info, WorkerInfo)
    for x, answer in zip(prompts, answers[:-1], strict=True):
        ref = hf()
        torch.testing.assert_close(from_raw(answer.tensor), ref(x, 0), atol=F32_ATOL, rtol=0)
    torch.testing.assert_close(from_raw(answers[-1].tensor), ref(step, 48), atol=F32_ATOL, rtol=0)


def test_a_frame_that_stops_halfway_is_closed_after_the_frame_timeout(node, hf):
    """A header and half a payload, then silence: the node closes the connection once the frame
    deadline passes, and frees its share of the buffer budget."""
    frame = b"".join(bytes(b) for b in encode_frame(Batch(GOOD, tuple(LayerOp(*op) for op in OPS)), Revision.V2))
    mark = node.mark()
    assert run(survives(node, hf(), lambda: closed(node, frame[: len(frame) // 2]))) == b""
    node.wait_for(lambda e: e.get("event") == "closing connection" and "did not arrive within" in e.get("error", ""),
                  after=mark)
    assert scrape(node.metrics_port())["cakemp_buffered_bytes", ()] == 0


def test_a_connection_that_never_says_hello_is_closed(node, hf):
    """A silent connection (or one stuck in its first frame) is closed once the frame timeout passes."""
    mark = node.mark()
    assert run(survives(node, hf(), lambda: closed(node, b"", hello=False))) == b""
    node.wait_for(lambda e: e.get("event") == "closing connection" and "of connecting" in e.get("error", ""),
                  after=mark)


def test_refusals_are_logged_by_peer_address_as_the_peers_fault(node):
    """The log names the session by its peer address, and says the peer was at fault."""

    async def main():
        mark = node.mark()
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            with pytest.raises(RemoteWorkerError):
                await client.batch(GOOD, [("model.layers.9", 0, 9)])
            host, port = client._writer.get_extra_info("sockname")[:2]
        event = await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "request refused", 30, mark)
        assert event["session"] == f"{host}:{port}" and event["fault"] == "peer"

    run(main())


def test_an_idle_session_is_freed_and_told_once(node, hf):
    """Past --session-idle-timeout a session's KV state is freed; its next request past position 0
    gets WorkerError saying so, once; a fresh prefill on the same connection then matches HF."""
    ref = hf()

    async def main():
        mark = node.mark()
        master = await CakeMaster.connect(node.port, LAYERS)
        await master.forward(torch.randn(1, 4, HIDDEN), 0)
        host, port = master.clients[0]._writer.get_extra_info("sockname")[:2]
        await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "session idle: freed its KV state"
                                and e.get("session") == f"{host}:{port}", 60, mark)
        with pytest.raises(RemoteWorkerError, match="idle for more than 10 s and its KV state was freed"):
            await master.forward(torch.randn(1, 1, HIDDEN), 4)
        with pytest.raises(RemoteWorkerError, match="does not follow the 0 positions cached"):
            await master.forward(torch.randn(1, 1, HIDDEN), 4)
        x = torch.randn(1, 3, HIDDEN)
        torch.testing.assert_close(await master.forward(x, 0), ref(x, 0), atol=F32_ATOL, rtol=0)
        await master.close()

    run(main())


def test_a_session_of_nan_activations_leaves_nothing_in_the_blocks_others_take_next(node, hf):
    """A master whose activations are NaN fills its KV blocks with NaN rows and leaves. Two sessions
    that start after it take those blocks back and decode side by side (one step where they meet:
    each decode row reads its blocks whole, masked past its length, and 0 * NaN is NaN): each equals
    HF's layers, and so does the bystander."""
    prompts = [torch.randn(1, 3, HIDDEN) for _ in range(2)]
    tokens = [torch.randn(1, 1, HIDDEN) for _ in range(2)]
    expected = []
    for x, y in zip(prompts, tokens, strict=True):
        ref = hf()
        expected.append((ref(x, 0), ref(y, 3)))

    async def attack():
        hostile = await CakeMaster.connect(node.port, LAYERS)
        await hostile.forward(torch.full((1, 12, HIDDEN), float("nan")), 0)
        await hostile.close()
        await asyncio.sleep(0.5)  # its End reaches both devices, which free its blocks
        masters = [await CakeMaster.connect(node.port, LAYERS) for _ in prompts]
        for master, x, (want, _) in zip(masters, prompts, expected, strict=True):
            torch.testing.assert_close(await master.forward(x, 0), want, atol=F32_ATOL, rtol=0)
        decoded = await asyncio.gather(*(master.forward(y, 3) for master, y in zip(masters, tokens, strict=True)))
        for got, (_, want) in zip(decoded, expected, strict=True):
            torch.testing.assert_close(got, want, atol=F32_ATOL, rtol=0)
        for master in masters:
            await master.close()

    run(survives(node, hf(), attack))


def test_a_live_session_of_nan_activations_never_reaches_a_shorter_neighbours_padding(checkpoint, hf, tmp_path):
    """On a fresh node, a master of NaN activations comes first (its blocks the pool's first) and stays
    connected. A short session (3 positions) and a long one (40) then decode side by side: a batched
    decode pads the short one's block table to the long one's, and what the padding names must be
    nothing the NaN session holds (masked, a NaN key still makes the row NaN): each equals HF's layers."""
    topology = write_topology(tmp_path / "topology.yml", ["model.layers.0-3"])
    fresh = RunningNode(checkpoint, topology, "--gpus", "cpu:1", "--dtype", "f32", "--max-context", str(MAX_CONTEXT),
                        env={"RUNTIME_DIRECTORY": str(tmp_path)})  # not the module node's: it is killed
    prompts = [torch.randn(1, T, HIDDEN) for T in (3, 40)]
    tokens = [torch.randn(1, 1, HIDDEN) for _ in prompts]
    expected = []
    for x, y in zip(prompts, tokens, strict=True):
        ref = hf()
        expected.append((ref(x, 0), ref(y, x.shape[1])))

    async def main():
        hostile = await CakeMaster.connect(fresh.port, LAYERS)
        await hostile.forward(torch.full((1, 48, HIDDEN), float("nan")), 0)
        masters = [await CakeMaster.connect(fresh.port, LAYERS) for _ in prompts]
        for master, x, (want, _) in zip(masters, prompts, expected, strict=True):
            torch.testing.assert_close(await master.forward(x, 0), want, atol=F32_ATOL, rtol=0)
        for _ in range(3):  # the two decodes meet in a step (the device gathers its sessions' requests)
            decoded = await asyncio.gather(*(master.forward(y, x.shape[1])
                                             for master, x, y in zip(masters, prompts, tokens, strict=True)))
            for got, (_, want) in zip(decoded, expected, strict=True):
                torch.testing.assert_close(got, want, atol=F32_ATOL, rtol=0)
        for master in (*masters, hostile):
            await master.close()

    try:
        run(main())
    finally:
        fresh.kill()


def test_a_long_context_beside_short_ones_pads_none_of_their_keys(tmp_path):
    """A master prefills 8,000 positions, then decodes at its last one again and again (its context never
    grows) beside eight short sessions decoding. A step attends over each group of rows' own keys
    (paged_step's spans), so the device's memory grows by none of the short rows' keys padded to the long
    one's: before, the step gathered every row's keys padded to 8,000 positions (31 ms a step where the
    eight took 1.6 ms alone, and 75 MiB of gather space kept, at these 2 layers of 2 kv heads of 64).
    Each short session decodes as HF's layers."""
    layers, hidden, long_context, short = [0, 1], 256, 8000, 16
    checkpoint = make_checkpoint(tmp_path / "ckpt", "llama", num_hidden_layers=2, hidden_size=hidden,
                                 intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=8192)
    topology = write_topology(tmp_path / "topology.yml", ["model.layers.0-1"])
    fresh = RunningNode(checkpoint, topology, "--gpus", "cpu:1", "--dtype", "f32", "--max-context", "8192",
                        env={"RUNTIME_DIRECTORY": str(tmp_path)})
    reference = HFLayers(checkpoint, layers, torch.float32)
    prompts = [torch.randn(1, short, hidden) for _ in range(8)]
    steps = [[torch.randn(1, 1, hidden) for _ in prompts] for _ in range(4)]
    expected = []
    for i, x in enumerate(prompts):  # each session's outputs in turn (`fresh` empties the one reference's cache)
        ref = reference.fresh()
        expected.append([ref(x, 0)] + [ref(step[i], short + k) for k, step in enumerate(steps)])

    async def main():
        hostile = await CakeMaster.connect(fresh.port, layers)
        for start in range(0, long_context, 2000):
            await hostile.forward(torch.randn(1, 2000, hidden), start)
        masters = [await CakeMaster.connect(fresh.port, layers) for _ in prompts]
        for master, x, want in zip(masters, prompts, expected, strict=True):
            torch.testing.assert_close(await master.forward(x, 0), want[0], atol=F32_ATOL, rtol=0)
        device = await asyncio.to_thread(fresh.device_pid, 0)
        before = rss(device)
        for k, step in enumerate(steps):  # the nine decodes meet in a step (the device gathers its sessions' requests)
            decoded = await asyncio.gather(hostile.forward(torch.randn(1, 1, hidden), long_context - 1),
                                           *(master.forward(y, short + k) for master, y in zip(masters, step, strict=True)))
            for got, want in zip(decoded[1:], expected, strict=True):
                torch.testing.assert_close(got, want[k + 1], atol=F32_ATOL, rtol=0)
        grown = rss(device) - before
        for master in (*masters, hostile):
            await master.close()
        return grown

    try:
        grown = run(main())
    finally:
        fresh.kill()
    # Each short row's keys padded to the long one's: 8 x 500 blocks x 16 KiB, K and V, at least 64 MiB.
    assert grown < 16 * 2**20, f"the device grew by {grown / 2**20:.1f} MiB"


def test_a_master_holding_the_whole_kv_budget_gives_up_a_session_to_another_masters_prompt(checkpoint, hf, tmp_path):
    """A master at 127.0.0.1 fills a device's KV budget with eight sessions; a master at 127.0.0.2
    then sends a prompt: it is computed (as HF's layers compute it), room made by giving up the first
    master's least recently used session (compute/fair_share.py), which is told so at its next request.
    No device restarts."""
    topology = write_topology(tmp_path / "topology.yml", ["model.layers.0-3"])
    fresh = RunningNode(checkpoint, topology, "--gpus", "cpu:1", "--dtype", "f32", "--max-context", "256",
                        "--kv-budget-mib", "1", "--no-prefix-reuse", "--metrics-address", "127.0.0.1:0",
                        env={"RUNTIME_DIRECTORY": str(tmp_path)})
    prompt = torch.randn(1, 64, HIDDEN)
    expected = hf()(prompt, 0)

    async def main():
        # 4 layers of 2 kv heads of 16, f32: 1 KiB a position; eight sessions of 128 fill 1 MiB.
        hoarder = [await CakeMaster.connect(fresh.port, LAYERS) for _ in range(8)]
        for master in hoarder:
            await master.forward(torch.randn(1, 128, HIDDEN), 0)
        with pytest.raises(RemoteWorkerError, match="budget is left"):  # its own next session: first come, first served
            await hoarder[0].forward(torch.randn(1, 16, HIDDEN), 128)
        newcomer = await CakeMaster.connect(fresh.port, LAYERS, source="127.0.0.2")
        torch.testing.assert_close(await newcomer.forward(prompt, 0), expected, atol=F32_ATOL, rtol=0)
        with pytest.raises(RemoteWorkerError, match="given up to make room for a session of another master"):
            await hoarder[1].forward(torch.randn(1, 1, HIDDEN), 128)
        for master in (*hoarder, newcomer):
            await master.close()

    try:
        run(main())
        assert restarts(fresh) == 0
    finally:
        fresh.kill()


def test_master_connections_have_tcp_keepalive(node):
    """The node's end of a master connection runs the keepalive timer (so a master gone without a
    FIN is found), as `ss` shows it."""

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            port = client._writer.get_extra_info("sockname")[1]
            shown = await asyncio.to_thread(
                subprocess.run, ["ss", "-tnoH", "state", "established", f"( sport = :{node.port} and dport = :{port} )"],
                capture_output=True, text=True, check=True)
        assert "timer:(keepalive," in shown.stdout, shown.stdout

    run(main())


async def hello(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A raw connection that said Hello and got WorkerInfo, or None when the node closed it instead."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.writelines(encode_frame(Hello(), Revision.V2))
        header = await reader.read(HEADER_SIZE)
    except ConnectionResetError:
        header = b""
    if not header:
        writer.close()
        return None
    assert isinstance(decode_payload(await reader.readexactly(read_header(header)), Revision.V2), WorkerInfo)
    return reader, writer


def test_connections_past_max_connections_are_closed_at_once(node):
    """With --max-connections open, one more is closed unanswered and counted; once one closes, the
    next is served."""

    def active() -> float:
        return scrape(node.metrics_port())["cakemp_connections", ()]

    async def main():
        before = scrape(node.metrics_port()).get(REFUSED_AT_MAX, 0.0)
        served = []
        # Connections of earlier tests may still be winding up: fill up to the limit, then one more.
        while (connection := await hello(node.port)) is not None:
            served.append(connection)
            assert len(served) <= MAX_CONNECTIONS
        assert scrape(node.metrics_port())[REFUSED_AT_MAX] == before + 1
        served.pop()[1].close()
        deadline = time.monotonic() + 30
        while active() >= MAX_CONNECTIONS:  # the node sees the close a moment later
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        connection = await hello(node.port)
        assert connection is not None
        for _, writer in [*served, connection]:
            writer.close()

    run(main())


def taken(node: RunningNode) -> float:
    """The connections the node has accepted and still holds (in a handshake place or as a master's),
    plus those it refused past --max-connections."""
    metrics = scrape(node.metrics_port())
    return sum(metrics.get(key, 0.0) for key in (("cakemp_handshakes", ()), ("cakemp_connections", ()), REFUSED_AT_MAX))


def test_idle_connects_without_hello_hold_no_master_slot(node, hf):
    """On a node without a cluster key, more idle connects than --max-connections (from other addresses,
    never sending a byte) hold handshake places, not master slots: a master still connects and its
    session decodes exactly, and the node counts only its connections as masters'. (Before: they were
    counted as masters until the frame timeout, and the master was refused.)"""

    async def main():
        before = await asyncio.to_thread(taken, node)
        idle = [(await asyncio.open_connection("127.0.0.1", node.port, local_addr=(f"127.0.2.{i % 4 + 1}", 0)))[1]
                for i in range(MAX_CONNECTIONS + 4)]
        while await asyncio.to_thread(taken, node) < before + len(idle):  # the node has seen every one of them
            await asyncio.sleep(0.05)
        counted = await survives(node, hf(), lambda: asyncio.to_thread(
            lambda: scrape(node.metrics_port())[("cakemp_connections", ())]))
        for writer in idle:
            writer.close()
        return counted

    assert run(main()) == len(LAYERS)  # the bystander's connections alone, one per layer


def test_refusals_naming_ever_new_layers_log_bounded_lines_and_their_counts_at_window_end(node, hf):
    """One connection sends 2,000 requests each naming a layer never named before: every one is answered,
    the log holds a burst of "request refused" lines per window (one kind: the error's class), and once the window has
    ended a line reports how many were suppressed though no later refusal came. (Before: 2,000 lines,
    each its own kind.)"""

    async def flood() -> int:
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            await client.hello()
            answered = 0
            for i in range(2000):
                with pytest.raises(RemoteWorkerError):
                    await client.batch(GOOD, [(f"evil{i:05d}x{'q' * (i % 7)}", 0, 0)])
                answered += 1
            return answered

    def counted() -> tuple[int, int]:
        """Refusal lines logged since `mark`, and the refusals they and the window-end reports say were dropped."""
        events = node.events(mark)
        lines = [e for e in events if e.get("event") == "request refused"]
        reports = [e for e in events if e.get("event") == log.SUPPRESSED and e["kind"].startswith("warning:request refused")]
        return len(lines), sum(e.get("suppressed", 0) for e in lines + reports)

    mark, started = node.mark(), time.monotonic()
    assert run(survives(node, hf(), flood)) == 2000
    windows = (time.monotonic() - started) // log.WINDOW_S + 2  # the flood's first and last windows, and any between
    deadline = time.monotonic() + 4 * log.WINDOW_S
    while sum(counted()) < 2000 and time.monotonic() < deadline:  # the last window's report comes as it ends
        time.sleep(0.2)
    lines, suppressed = counted()
    assert lines <= log.BURST * windows and lines + suppressed == 2000, (lines, suppressed)


def test_sighup_stops_the_node_as_sigterm_does(node, runtime):
    """SIGHUP (its terminal closed) drains and exits 0, leaving no ipc socket behind."""
    node.process.send_signal(signal.SIGHUP)
    assert node.process.wait(timeout=60) == 0
    assert list(runtime.iterdir()) == []
