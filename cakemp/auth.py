"""Cake's cluster-key handshake: mutual HMAC-SHA256 challenge-response (docs/protocol.md, Handshake).

It runs on the raw TCP stream right after connect, before any frame, and only when a cluster
key is configured. The master speaks first:

    M → W  nonce_m (32 random bytes)
    W → M  HMAC(key, nonce_m) ‖ nonce_w              (64 bytes)
    M → W  HMAC(key, nonce_w)                        (32 bytes)

There is no "OK" byte: the master's next bytes are its first frame. The key is the cluster
key's UTF-8 bytes used directly as the HMAC key. Cake has no timeout here, so a peer without
a key (it sends a frame and waits) or one that stalls would hold the connection forever;
both sides here give up after `timeout` seconds. Closing the connection after a failure is
the caller's job.

Both MACs are the same function of a nonce, with no direction bound in, so a worker that MACs
any nonce_m is an oracle for its own challenge: a peer without the key opens two connections,
sends connection 1's nonce_w as connection 2's nonce_m, and answers connection 1 with the MAC
connection 2 returned. So every challenge this process sends is remembered for a few minutes
(`RecentChallenges`, process-wide, one set per role), and a peer's nonce found among its own
role's challenges is refused before anything is MACed; a cakemp master checks its workers the
same way. The sets are per role because a process running both (a test, a local demo)
legitimately sends its own master's nonce to its own worker. That stops reflection against
one process; another node of the cluster can still serve as the oracle, which only a protocol
change (a direction bound into the MAC) can stop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cakemp.errors import AuthError

NONCE_SIZE = 32
HMAC_SIZE = 32
# How long a challenge stays remembered, and how many are: far past the handshake timeout,
# and more than the connections a node holds at once (--max-connections is 4096); a full set
# is about 3.6 MiB. Checking and remembering costs a few microseconds per handshake.
CHALLENGE_LIFETIME_S = 300.0
MAX_CHALLENGES = 1 << 14


class RecentChallenges:
    """The challenges (nonces) this process sent in the last `lifetime` seconds, at most `capacity`
    of them; a challenge whose handshake is still running is never forgotten.

    A handshake takes its challenge from `challenge()` and asks `in` of the peer's nonce. Thread-safe:
    masters in several threads (each with its own event loop) share the process's set.
    """

    def __init__(self, lifetime: float = CHALLENGE_LIFETIME_S, capacity: int = MAX_CHALLENGES,
                 clock: Callable[[], float] = time.monotonic):
        self._lifetime, self._capacity, self._clock = lifetime, capacity, clock
        self._issued: OrderedDict[bytes, float] = OrderedDict()  # nonce -> when it was sent, oldest first
        self._open: set[bytes] = set()  # challenges whose handshake has not ended
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._issued.keys() | self._open)

    def __contains__(self, nonce: bytes) -> bool:
        with self._lock:
            return nonce in self._open or nonce in self._issued

    @contextmanager
    def challenge(self) -> Iterator[bytes]:
        """A fresh random challenge, remembered; it stays open until the `with` block ends.

        Raises AuthError when `capacity` handshakes are open at once."""
        nonce = secrets.token_bytes(NONCE_SIZE)
        with self._lock:
            if len(self._open) >= self._capacity:
                raise AuthError(f"{self._capacity} cluster-key handshakes are in progress; refusing another")
            now = self._clock()
            while self._issued and (len(self._issued) >= self._capacity
                                    or now - next(iter(self._issued.values())) >= self._lifetime):
                self._issued.popitem(last=False)
            self._issued[nonce] = now
            self._open.add(nonce)
        try:
            yield nonce
        finally:
            with self._lock:
                self._open.discard(nonce)


# The challenges this process sends as a worker (nonce_w) and as a master (nonce_m).
WORKER_CHALLENGES = RecentChallenges()
MASTER_CHALLENGES = RecentChallenges()


def _mac(key: str, nonce: bytes) -> bytes:
    return hmac.new(key.encode("utf-8"), nonce, hashlib.sha256).digest()


async def _bounded(exchange, timeout: float, peer: str) -> None:
    """Run one side of the exchange under `timeout`, mapping every failure to AuthError."""
    try:
        await asyncio.wait_for(exchange, timeout)
    except TimeoutError:
        raise AuthError(f"{peer} did not complete the cluster-key handshake within {timeout:g} s") from None
    except asyncio.IncompleteReadError:
        raise AuthError(f"{peer} closed the connection during the cluster-key handshake") from None
    except OSError as exc:
        raise AuthError(f"connection to the {peer} failed during the cluster-key handshake: {exc}") from None


async def authenticate_master(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str, timeout: float = 10.0,
    nonce_received: Callable[[], None] = lambda: None,
) -> None:
    """Worker side: prove our key to the master that connected, and check its proof; `nonce_received`
    is called once the master's first bytes (its nonce) are in, as its handshake is under way.

    Raises AuthError when the master's HMAC is wrong, the stream ends, or `timeout` passes.
    """

    async def exchange() -> None:
        nonce_m = await reader.readexactly(NONCE_SIZE)
        nonce_received()
        if nonce_m in WORKER_CHALLENGES:
            raise AuthError("master authentication failed: its nonce is a challenge this node sent (a reflection)")
        with WORKER_CHALLENGES.challenge() as nonce_w:
            writer.write(_mac(key, nonce_m) + nonce_w)
            await writer.drain()
            proof = await reader.readexactly(HMAC_SIZE)
            if not hmac.compare_digest(proof, _mac(key, nonce_w)):
                raise AuthError("master authentication failed: invalid HMAC")

    await _bounded(exchange(), timeout, "master")


async def authenticate_worker(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str, timeout: float = 10.0
) -> None:
    """Master side: challenge the worker we connected to, then answer its challenge.

    Raises AuthError when the worker's HMAC is wrong, the stream ends, or `timeout` passes.
    """

    async def exchange() -> None:
        with MASTER_CHALLENGES.challenge() as nonce_m:
            writer.write(nonce_m)
            await writer.drain()
            reply = await reader.readexactly(HMAC_SIZE + NONCE_SIZE)
        if not hmac.compare_digest(reply[:HMAC_SIZE], _mac(key, nonce_m)):
            raise AuthError("worker authentication failed: invalid HMAC")
        nonce_w = reply[HMAC_SIZE:]
        if nonce_w in MASTER_CHALLENGES:
            raise AuthError("worker authentication failed: its challenge is a nonce this master sent (a reflection)")
        writer.write(_mac(key, nonce_w))
        await writer.drain()

    await _bounded(exchange(), timeout, "worker")
