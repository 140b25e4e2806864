"""Peers that hold on to a live keyed node: masters that stop reading their replies, connects that
never authenticate, a process out of file descriptors; and the reason every close is logged with.

One node serves the module, with a cluster key, a buffer budget of four full-context frames,
short frame timeouts and a low descriptor limit (ulimit -n). Each test checks its hostile
peers' own outcome (closed, and logged why), that a master holding the key is still served,
and that a bystander session decodes exactly as HF's layers; the last stops the node.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import resource
import signal
import socket
import struct
import time

import pytest
import torch

from cakemp.auth import authenticate_worker
from cakemp.errors import CakempError
from cakemp.front.admission import LayerAdmission
from cakemp.master.client import WorkerClient
from cakemp.sources import GRACE_S, PER_SOURCE
from cakemp.wire import (
    HEADER_SIZE,
    MAGIC,
    Batch,
    DType,
    Hello,
    RawTensor,
    Revision,
    WorkerInfo,
    WorkerReady,
    decode_payload,
    encode_frame,
    read_header,
)
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.distance import Distance
from tests.support.flood import ConnectFlood
from tests.support.master import CakeMaster
from tests.support.node import RunningNode, open_fds, rss, scrape, write_topology
from tests.support.tolerance import assert_close

KEY = "slow peers secret"
HIDDEN = 64
LAYERS = [0, 1]
CONTEXT = 8192  # a full-context f32 frame is 2 MiB
BUDGET = 8 << 20  # three of them (each is a little over 2 MiB)
MAX_PAYLOAD = LayerAdmission(frozenset(f"model.layers.{i}" for i in LAYERS), HIDDEN, CONTEXT, frozenset(LAYERS)).max_payload()
FRAME_TIMEOUT_S = 3
MAX_CONNECTIONS = 16
NOFILE = 256  # the node's ulimit -n: fewer descriptors than the idle connects below
HANDSHAKE_PLACES = 64
# Echoed as it is (no layer to run): a full-size reply that costs no device time.
ECHO = Batch(RawTensor(bytes(CONTEXT * HIDDEN * 4), DType.F32, (1, CONTEXT, HIDDEN)), ())


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", num_hidden_layers=2,
                           max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-1"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu", "--dtype", "f32", "--max-context", str(CONTEXT),
                          "--metrics-address", "127.0.0.1:0", "--frame-timeout", str(FRAME_TIMEOUT_S),
                          "--max-connections", str(MAX_CONNECTIONS), "--max-buffered-mib", str(BUDGET >> 20),
                          "--restart-attempts", "20", env={"CAKE_CLUSTER_KEY": KEY}, nofile=NOFILE)
    yield running
    running.kill()


@pytest.fixture(scope="module")
def hf(checkpoint):
    """A fresh HF reference of the node's layers per call."""
    return HFLayers(checkpoint, LAYERS, torch.float32).fresh


def metric(node: RunningNode, name: str) -> float:
    return scrape(node.metrics_port()).get((name, ()), 0.0)


def sessions_events(node: RunningNode, session: str, after: int) -> list[dict]:
    return [e for e in node.events(after) if e.get("session") == session]


async def wait_metric(node: RunningNode, name: str, condition, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while not condition(value := await asyncio.to_thread(metric, node, name)):
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        await asyncio.sleep(0.05)
    return value


async def authenticated(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """A raw connection that proved the key (its receive buffer `rcvbuf` bytes, if given), and how the node names it."""
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so that the window it offers stays that small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    await authenticate_worker(reader, writer, KEY)
    return reader, writer, "{}:{}".format(*sock.getsockname()[:2])


async def said_hello(port: int, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    reader, writer, session = await authenticated(port, rcvbuf)
    writer.writelines(encode_frame(Hello(), Revision.V2))
    header = await reader.readexactly(HEADER_SIZE)
    assert isinstance(decode_payload(await reader.readexactly(read_header(header)), Revision.V2), WorkerInfo)
    return reader, writer, session


async def bystander(node: RunningNode, ref: HFLayers) -> CakeMaster:
    """A master session prefilled with 5 positions, checked against HF's layers."""
    master = await CakeMaster.connect(node.port, LAYERS, cluster_key=KEY)
    x = torch.randn(1, 5, HIDDEN)
    assert_close(await master.forward(x, 0), ref(x, 0))
    return master


async def decodes(master: CakeMaster, ref: HFLayers, position: int = 5) -> None:
    x = torch.randn(1, 1, HIDDEN)
    assert_close(await master.forward(x, position), ref(x, position))


# --------------------------------------------------------------------------- masters that do not read


def test_masters_that_stop_reading_their_replies_are_closed_and_the_budget_comes_back(node, hf):
    """Four masters send full-context requests and never read a reply: their unsent replies hold
    the whole buffer budget, until each is closed for not reading within the frame timeout. A
    master's Hello, which waits for the budget meanwhile, is then answered, and a bystander
    session decodes on; no frame byte stays held. (Before: the budget stayed held, and the
    Hello went unanswered, for as long as the slow sockets stayed open.)"""
    ref = hf()
    pid = node.process.pid
    slow_count = 4

    async def main():
        master = await bystander(node, ref)
        mark, before = node.mark(), rss(pid)
        slow = [await said_hello(node.port, rcvbuf=4096) for _ in range(slow_count)]
        for _, writer, _ in slow:  # six each; no reply is ever read
            writer.writelines([piece for _ in range(6) for piece in encode_frame(ECHO, Revision.V2)])
        await wait_metric(node, "cakemp_buffered_bytes", lambda held: held > BUDGET - MAX_PAYLOAD)
        peak = max([rss(pid)] + [await asyncio.sleep(0.1) or rss(pid) for _ in range(10)])
        started = time.monotonic()
        async with await WorkerClient.connect("127.0.0.1", node.port, cluster_key=KEY) as client:
            await asyncio.wait_for(client.hello(), 4 * FRAME_TIMEOUT_S)
        hello_s = time.monotonic() - started
        for _, _, session in slow:
            await asyncio.to_thread(node.wait_for, lambda e, session=session: e.get("session") == session and e.get(
                "event") == "closing connection" and "did not read its reply within 3 s" in e.get("error", ""), 30, mark)
        await wait_metric(node, "cakemp_buffered_bytes", lambda held: held == 0)
        assert await asyncio.to_thread(metric, node, "cakemp_unread_replies_total") == slow_count
        await decodes(master, ref)
        await master.close()
        for _, writer, _ in slow:
            writer.close()
        return before, peak, hello_s

    before, peak, hello_s = run(main())
    print(f"{slow_count} slow readers: front RSS {before >> 20} MiB before, peak {peak >> 20} MiB; "
          f"a master's Hello answered after {hello_s:.1f} s")


def test_a_master_is_answered_at_once_beside_six_masters_that_stopped_reading(node, hf):
    """Six masters holding the key send full-context requests and never read a reply, so their unsent
    replies hold the budget and more of their frames wait for it: a correct master's Hello and first
    Batch (small frames, from the reserve) are answered exactly before any of them is closed for not
    reading. (Before: the Hello waited behind their frames until the frame timeout closed them.)"""
    ref = hf()
    slow_count = 6

    async def main():
        unread = await asyncio.to_thread(metric, node, "cakemp_unread_replies_total")
        slow = [await said_hello(node.port, rcvbuf=4096) for _ in range(slow_count)]
        for _, writer, _ in slow:  # six each; no reply is ever read
            writer.writelines([piece for _ in range(6) for piece in encode_frame(ECHO, Revision.V2)])
        await wait_metric(node, "cakemp_buffered_bytes", lambda held: held > BUDGET - MAX_PAYLOAD)
        master = await bystander(node, ref)  # Hello on each connection, then a Batch of 5 positions
        answered_unread = await asyncio.to_thread(metric, node, "cakemp_unread_replies_total")
        await decodes(master, ref)
        await master.close()
        for _, writer, _ in slow:
            writer.close()
        await wait_metric(node, "cakemp_buffered_bytes", lambda held: held == 0)
        return answered_unread - unread

    assert run(main()) == 0


def test_a_connect_flood_from_one_address_holds_its_own_places_and_every_master_gets_in(node, hf):
    """While one address connects from four threads as fast as it can and never sends a byte, a
    master 100 ms away (a round trip) from another address connects six times, two connections each
    (the key handshake, Hello), and its session decodes exactly every time: the flood holds at most
    its address's places and displaces only its own. (Before: the flood's newer connects displaced
    the master's while its proof was on the way, and about half of them were reset.)"""

    async def main():
        outcomes, held = [], []
        with ConnectFlood(node.port, "127.0.0.3") as flood, Distance(node.port, "127.0.0.2", 0.05) as far:
            await wait_metric(node, "cakemp_handshakes", lambda places: places >= PER_SOURCE)
            for _ in range(6):
                outcomes.append(await far_master_session(far.port, hf()))
                held.append(await asyncio.to_thread(metric, node, "cakemp_handshakes"))
        # Every session was closed (the last one's close still on its way when the relay stopped):
        # none is counted as a master's any more, and the flood's connects hold no place.
        await wait_metric(node, "cakemp_connections", lambda open_: open_ == 0)
        await wait_metric(node, "cakemp_handshakes", lambda places: places == 0)
        return outcomes, held, flood.connects

    outcomes, held, connects = run(main())
    assert outcomes == ["served exactly"] * 6, outcomes
    assert max(held) <= PER_SOURCE + 1, held
    print(f"a one-address flood of {connects} connects: 6 of 6 far master sessions served exactly; places held {held}")


async def far_master_session(port: int, ref: HFLayers) -> str:
    """A master connecting through `port` (a Distance), prefilling 5 positions: "served exactly", or
    the exception it met on the way (the node reset or closed it)."""
    try:
        # The relay completes the master's TCP connect at once and makes the node's only then, so
        # the node's (its SYN dropped while the flood fills the kernel's accept backlog, resent after
        # 1 s, 3 s, 7 s: no place rule's doing) falls within the key handshake's bound: twice the
        # client's 10 s, the connect's bound and the handshake's that a master dialling the node has.
        master = await CakeMaster.connect(port, LAYERS, cluster_key=KEY, timeout=20)
    except (OSError, EOFError, CakempError) as e:
        return f"{type(e).__name__}: {e}"
    try:
        x = torch.randn(1, 5, HIDDEN)
        assert_close(await master.forward(x, 0), ref(x, 0))
    except (OSError, EOFError, CakempError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await master.close()
    return "served exactly"


def test_idle_masters_hold_none_of_their_answered_requests(node):
    """Twelve masters each send a full-context request, read its reply and then sit idle: each
    request's bytes are freed once answered, as its share of the budget is given back. (Before:
    an idle connection kept its last request alive, 2 MiB here, uncounted by the budget.)"""
    pid = node.process.pid
    count = 12

    async def main():
        before = rss(pid)
        idle = []
        for _ in range(count):
            reader, writer, _ = await said_hello(node.port)
            writer.writelines(encode_frame(ECHO, Revision.V2))
            header = await reader.readexactly(HEADER_SIZE)
            await reader.readexactly(read_header(header))
            idle.append(writer)
        await asyncio.sleep(0.5)
        after = rss(pid)
        for writer in idle:
            writer.close()
        return before, after

    before, after = run(main())
    assert after - before < count * (2 << 20) // 2, f"front RSS grew {(after - before) >> 20} MiB"
    print(f"{count} idle masters after a 2 MiB request each: front RSS {before >> 20} MiB before, {after >> 20} MiB after")


# --------------------------------------------------------------------------- every close says why


async def _half_header(port: int) -> str:
    reader, writer, session = await said_hello(port)
    writer.write(struct.pack(">I", MAGIC))
    writer.write_eof()
    await reader.read()
    writer.close()
    return session


async def _half_payload(port: int) -> str:
    reader, writer, session = await said_hello(port)
    writer.write(struct.pack(">II", MAGIC, 100) + bytes(10))
    writer.write_eof()
    await reader.read()
    writer.close()
    return session


async def _reset(port: int) -> str:
    _, writer, session = await said_hello(port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends a reset
    writer.transport.abort()
    return session


async def _wrong_key(port: int) -> str:
    """The handshake with a proof made with another key."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    session = "{}:{}".format(*writer.get_extra_info("sockname")[:2])
    writer.write(os.urandom(32))
    nonce_w = (await reader.readexactly(64))[32:]
    writer.write(hmac.new(b"another key", nonce_w, hashlib.sha256).digest())
    try:
        await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        pass
    writer.close()
    return session


async def _no_hello(port: int) -> str:
    reader, writer, session = await authenticated(port)
    assert await asyncio.wait_for(reader.read(), 3 * FRAME_TIMEOUT_S) == b""
    writer.close()
    return session


async def _out_of_place(port: int) -> str:
    reader, writer, session = await said_hello(port)
    writer.writelines(encode_frame(WorkerReady(), Revision.V2))
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    return session


ENDINGS = {
    "a master that hangs up inside a header": (_half_header, "connection lost", "inside a frame (4 of 8 bytes"),
    "a master that hangs up inside a payload": (_half_payload, "connection lost", "inside a frame (10 of 100 bytes"),
    "a master that resets the connection": (_reset, "connection lost", "ConnectionResetError"),
    "a wrong key": (_wrong_key, "authentication failed", "invalid HMAC"),
    "no Hello": (_no_hello, "closing connection", "no Hello within 3 s"),
    "a message out of place": (_out_of_place, "unexpected message, closing", ""),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_every_close_is_logged_once_with_its_reason(node, hf, ending):
    """However a connection ends, the node logs one line for it, under its peer address, saying why
    (before, a master hanging up inside a frame or resetting was logged at debug level only)."""
    how, event, words = ENDINGS[ending]
    ref = hf()

    async def main():
        master = await bystander(node, ref)
        mark = node.mark()
        session = await how(node.port)
        said = await asyncio.to_thread(node.wait_for, lambda e: e.get("session") == session and e.get("event") in (
            "connection lost", "closing connection", "authentication failed", "unexpected message, closing"), 30, mark)
        await decodes(master, ref)
        await master.close()
        return said, session, mark

    said, session, mark = run(main())
    assert said["event"] == event and words in said.get("error", ""), said
    closes = [e for e in sessions_events(node, session, mark) if e.get("event") != "session freed"]
    assert closes == [said], closes


# --------------------------------------------------------------------------- out of descriptors


def test_out_of_descriptors_the_node_pauses_accepting_and_restarts_a_device_once_it_can(node, hf):
    """With its descriptor limit lowered below what it holds, the node cannot accept a master nor
    respawn a device it lost: it says so once and pauses accepting (not a line per failed accept),
    counts the failed spawn as a failed start and backs off. Once the limit is back, the device is
    restarted, the waiting master's connection accepted, and both serve. (Before: asyncio logged
    every failed accept, and the failed spawn escaped a timer callback, leaving the device down.)"""
    ref = hf()
    pid = node.process.pid
    device = node.device_pid(0)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)

    async def main():
        await wait_metric(node, "cakemp_connections", lambda open_: open_ == 0)
        mark = node.mark()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) - 8, hard))
        try:
            waiting = asyncio.create_task(CakeMaster.connect(node.port, LAYERS, cluster_key=KEY))
            await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "cannot accept connections: paused "
                                    "until it can", 30, mark)
            os.kill(device, signal.SIGKILL)
            failed = await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "device restart failed",
                                             30, mark)
            await asyncio.sleep(2)  # paused meanwhile, retrying
            assert not waiting.done()
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        master = await asyncio.wait_for(waiting, 30)
        await asyncio.to_thread(node.wait_for, lambda e: e.get("event") == "device restarted", 30, mark)
        x = torch.randn(1, 3, HIDDEN)
        assert_close(await master.forward(x, 0), ref(x, 0))
        await master.close()
        return failed, mark

    failed, mark = run(main())
    assert "could not start its process" in failed["error"] and "Too many open files" in failed["error"], failed
    events = node.events(mark)
    assert sum(e.get("event") == "cannot accept connections: paused until it can" for e in events) == 1
    assert not [e for e in events if "Traceback" in str(e) or "out of system resource" in str(e)]
    assert node.wait_for(lambda e: e.get("event") == "accepting again", 10, mark)["paused_s"] > 2


# --------------------------------------------------------------------------- connects that never authenticate


def test_connects_that_never_authenticate_hold_a_few_places_of_their_own_and_a_master_still_gets_in(node, hf):
    """300 connects that never send a byte, from 38 addresses, more than the node has descriptors for
    and far more than --max-connections: at most 64 are in the handshake at once (past their grace
    the oldest of the busiest address make room, until then newcomers are closed), so the node's
    descriptors stay bounded, an authenticated bystander is untouched and a master holding the key
    connects and is served at once. (Before: they took the connection slots for 10 s each, and
    descriptors until accept failed.)"""
    ref = hf()
    pid = node.process.pid
    idle_count = 300

    async def main():
        master = await bystander(node, ref)
        before = open_fds(pid)
        refused = await asyncio.to_thread(scrape, node.metrics_port())
        idle = [(await asyncio.open_connection("127.0.0.1", node.port, local_addr=(f"127.0.1.{i % 38 + 1}", 0)))[1]
                for i in range(idle_count)]
        await wait_metric(node, "cakemp_handshakes", lambda places: places == HANDSHAKE_PLACES)
        at_cap = open_fds(pid)
        await asyncio.sleep(GRACE_S)  # the idle connects' grace is over: a newcomer displaces one of them
        started = time.monotonic()
        other = await asyncio.wait_for(CakeMaster.connect(node.port, LAYERS, cluster_key=KEY), 10)
        connect_s = time.monotonic() - started
        await decodes(master, ref)
        await master.close()
        x = torch.randn(1, 2, HIDDEN)
        assert_close(await other.forward(x, 0), hf()(x, 0))
        await other.close()
        after = await asyncio.to_thread(scrape, node.metrics_port())
        closed = sum(after.get(key, 0.0) - refused.get(key, 0.0) for key in (
            ("cakemp_handshakes_displaced_total", ()), ("cakemp_refused_connections_total", (("reason", "handshake-places"),))))
        for writer in idle:
            writer.close()
        return before, at_cap, connect_s, closed

    before, at_cap, connect_s, closed = run(main())
    assert at_cap <= before + HANDSHAKE_PLACES + 8, (before, at_cap)
    assert closed >= idle_count - HANDSHAKE_PLACES
    print(f"{idle_count} idle connects: front fds {before} before, {at_cap} at the cap of {HANDSHAKE_PLACES} "
          f"(ulimit -n {NOFILE}); a master connected in {connect_s * 1000:.0f} ms")


def test_sigterm_logs_why_each_open_connection_is_closed(node):
    """Stopping, the node closes each idle master connection, and says so for each."""

    async def main():
        return [await said_hello(node.port) for _ in range(2)]

    connections = run(main())
    mark = node.mark()
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(timeout=60) == 0
    for _, _, session in connections:
        said = [e for e in sessions_events(node, session, mark) if e.get("event") == "closing connection"]
        assert [e.get("error") for e in said] == ["the node is stopping"], said
