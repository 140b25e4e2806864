"""Cake's cluster-key handshake over real loopback TCP, both sides, good and bad peers, and its reflection guard."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import pytest

from cakemp.auth import RecentChallenges, authenticate_master, authenticate_worker
from cakemp.errors import AuthError, ProtocolError
from cakemp.wire import Hello, Revision, WorkerInfo, decode_payload, encode_frame, read_header

INFO = WorkerInfo("0.1.0", "F16", "linux", "x86_64", "cpu", 0, 0)
SHORT = 0.3  # seconds: the handshake timeout in the stall tests


async def read_frame(reader: asyncio.StreamReader):
    header = await reader.readexactly(8)
    return decode_payload(await reader.readexactly(read_header(header)), Revision.V2)


async def send_frame(writer: asyncio.StreamWriter, msg) -> None:
    writer.writelines(encode_frame(msg, Revision.V2))
    await writer.drain()


async def start_worker(key: str | None, timeout: float = 5.0):
    """A worker that authenticates the master when it has a key, then answers one Hello.
    Returns (server, port, outcome); outcome resolves to "served" or the error it hit."""
    outcome = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        try:
            if key is not None:
                await authenticate_master(reader, writer, key, timeout)
            assert await read_frame(reader) == Hello()  # a keyless worker reads the nonce as a header
            await send_frame(writer, INFO)
            outcome.set_result("served")
        except (AuthError, ProtocolError) as exc:
            outcome.set_result(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], outcome


async def run_master(port: int, key: str | None, timeout: float = 5.0):
    """A master that authenticates when it has a key, then says Hello; returns the reply or the error."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if key is not None:
            await authenticate_worker(reader, writer, key, timeout)
        await send_frame(writer, Hello())
        return await read_frame(reader)
    except (AuthError, ProtocolError, asyncio.IncompleteReadError) as exc:
        return exc
    finally:
        writer.close()


def outcome_of(talk, key: str = "k", timeout: float = 5.0):
    """The worker's outcome (see start_worker) when the master's side of the connection does `talk(reader, writer)`."""

    async def main():
        server, port, outcome = await start_worker(key, timeout)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await talk(reader, writer)
            result = await asyncio.wait_for(outcome, 5)
            writer.close()
            return result

    return asyncio.run(main())


def pair(worker_key, master_key, worker_timeout=5.0):
    """Run one master against one worker; returns (master result, worker outcome)."""

    async def main():
        server, port, outcome = await start_worker(worker_key, worker_timeout)
        async with server:
            result = await run_master(port, master_key)
            return result, await asyncio.wait_for(outcome, 5)

    return asyncio.run(main())


def test_same_key_authenticates_both_ways_and_frames_follow():
    """With the same key both sides pass and the Hello/WorkerInfo exchange follows on the same stream."""
    assert pair("s3cret", "s3cret") == (INFO, "served")


def test_different_keys_fail_on_both_sides():
    """With different keys the master rejects the worker's HMAC and the worker sees the master hang up."""
    result, outcome = pair("worker-key", "master-key")
    assert isinstance(result, AuthError) and "worker authentication failed: invalid HMAC" in str(result)
    assert isinstance(outcome, AuthError) and "master closed the connection" in str(outcome)


def test_worker_rejects_a_master_with_a_wrong_proof():
    """A master that answers the worker's challenge with a wrong HMAC is rejected by the worker."""

    async def wrong_proof(reader, writer):
        writer.write(bytes(32))
        await reader.readexactly(64)
        writer.write(b"\x01" * 32)
        await writer.drain()

    outcome = outcome_of(wrong_proof)
    assert isinstance(outcome, AuthError) and "master authentication failed: invalid HMAC" in str(outcome)


def test_worker_answers_the_handshake_check_value():
    """The worker's first 32 bytes are HMAC-SHA256("mysecret", 00..1f), docs/protocol.md, Handshake."""

    async def main():
        server, port, _ = await start_worker("mysecret")
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(bytes(range(32)))
            reply = await reader.readexactly(64)
            writer.close()
            return reply

    reply = asyncio.run(main())
    assert reply[:32].hex() == "8250d19d8b424884cd648b8edb810b63075f6168ff3c2e3127153c4313d10652"
    assert reply[:32] == hmac.new(b"mysecret", bytes(range(32)), hashlib.sha256).digest()


def test_keyed_worker_times_out_a_master_without_a_key():
    """A keyless master's Hello (12 bytes) never fills the 32-byte nonce, so the worker gives up at its timeout."""

    async def hello(reader, writer):
        await send_frame(writer, Hello())

    outcome = outcome_of(hello, timeout=SHORT)
    assert isinstance(outcome, AuthError) and f"within {SHORT:g} s" in str(outcome)


def test_keyed_master_fails_against_a_worker_without_a_key():
    """A keyless worker reads the master's nonce as a frame header, rejects its magic and hangs up; the master gets AuthError."""
    result, outcome = pair(None, "k")
    assert isinstance(outcome, ProtocolError) and "invalid magic" in str(outcome)
    assert isinstance(result, AuthError) and "worker closed the connection" in str(result)


def test_worker_times_out_a_stalled_master():
    """A master that connects and sends nothing is dropped by the worker after the handshake timeout."""

    async def nothing(reader, writer):
        pass

    outcome = outcome_of(nothing, timeout=SHORT)
    assert isinstance(outcome, AuthError) and "master did not complete the cluster-key handshake" in str(outcome)


def test_master_times_out_a_stalled_worker():
    """A worker that accepts and never answers the nonce makes the master give up after its timeout."""

    async def main():
        held = []

        async def silent(reader, writer):
            held.append(writer)  # keep the connection open, say nothing

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            try:
                await authenticate_worker(reader, writer, "k", timeout=SHORT)
            except AuthError as exc:
                return exc
            finally:
                writer.close()
                for w in held:
                    w.close()

    error = asyncio.run(main())
    assert isinstance(error, AuthError) and "worker did not complete the cluster-key handshake within" in str(error)


# --------------------------------------------------------------------------- reflection


async def handshake_reply(port: int, nonce_m: bytes):
    """Open a connection, send `nonce_m` as a master's nonce; returns (reader, writer, the worker's 64-byte reply or
    b"" when it closed instead)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(nonce_m)
    await writer.drain()
    try:
        return reader, writer, await reader.readexactly(64)
    except asyncio.IncompleteReadError as exc:
        return reader, writer, exc.partial


def test_a_worker_refuses_its_own_challenge_as_a_master_nonce():
    """A keyless peer that sends connection 1's challenge as connection 2's nonce gets no MAC on
    connection 2 (AuthError naming the reflection, connection closed), so it cannot answer connection 1."""

    async def main():
        outcomes = []

        async def handle(reader, writer):
            try:
                await authenticate_master(reader, writer, "k", 5.0)
                outcomes.append("served")
            except AuthError as exc:
                outcomes.append(exc)
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            _, first, reply = await handshake_reply(port, bytes(32))
            _, second, reflected = await handshake_reply(port, reply[32:])
            second.close()
            first.write(reflected[:32].ljust(32, b"\0"))  # the best the attacker has
            await first.drain()
            while len(outcomes) < 2:
                await asyncio.sleep(0.01)
            first.close()
            return reflected, outcomes

    reflected, outcomes = asyncio.run(main())
    assert reflected == b""
    assert all(isinstance(o, AuthError) for o in outcomes)
    assert any("reflection" in str(o) for o in outcomes) and any("invalid HMAC" in str(o) for o in outcomes)


def test_a_master_refuses_a_worker_that_answers_with_the_masters_own_challenge():
    """A worker whose challenge is the nonce the master just sent gets no MAC of it: AuthError naming the reflection."""

    async def main():
        async def echo_challenge(reader, writer):
            nonce_m = await reader.readexactly(32)
            writer.write(hmac.new(b"k", nonce_m, hashlib.sha256).digest() + nonce_m)
            await writer.drain()
            await reader.read()  # a MAC would arrive here; the master hangs up instead
            writer.close()

        server = await asyncio.start_server(echo_challenge, "127.0.0.1", 0)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            try:
                await authenticate_worker(reader, writer, "k", 5.0)
            except AuthError as exc:
                return exc
            finally:
                writer.close()

    error = asyncio.run(main())
    assert isinstance(error, AuthError) and "reflection" in str(error)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_challenges_are_remembered_for_their_lifetime_then_forgotten():
    """A challenge is found until `lifetime` has passed since it was sent, and is forgotten at the next one after."""
    clock = Clock()
    challenges = RecentChallenges(lifetime=60.0, capacity=100, clock=clock)
    with challenges.challenge() as old:
        pass
    clock.now = 59.0
    with challenges.challenge() as newer:
        pass
    assert old in challenges and newer in challenges and bytes(32) not in challenges
    clock.now = 60.0
    with challenges.challenge():
        pass
    assert old not in challenges and newer in challenges and len(challenges) == 2


def test_at_most_capacity_challenges_are_kept_but_an_open_one_is_never_forgotten():
    """Past `capacity`, the oldest closed challenges go first; a challenge whose handshake runs
    stays found whatever came after it, and `capacity` open handshakes refuse another."""
    challenges = RecentChallenges(lifetime=60.0, capacity=4, clock=Clock())
    with challenges.challenge() as open_one:
        closed = []
        for _ in range(10):
            with challenges.challenge() as nonce:
                closed.append(nonce)
        assert len(challenges) <= 5 and open_one in challenges
        assert [n in challenges for n in closed] == [False] * 6 + [True] * 4
        with challenges.challenge(), challenges.challenge(), challenges.challenge():
            with pytest.raises(AuthError, match="in progress"):
                with challenges.challenge():
                    pass
    assert len(challenges) <= 4
