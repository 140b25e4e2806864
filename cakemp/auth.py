"""Cake's cluster-key handshake: mutual HMAC-SHA256 challenge-response (spec §5).

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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets

from cakemp.errors import AuthError

NONCE_SIZE = 32
HMAC_SIZE = 32


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
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str, timeout: float = 10.0
) -> None:
    """Worker side: prove our key to the master that connected, and check its proof.

    Raises AuthError when the master's HMAC is wrong, the stream ends, or `timeout` passes.
    """

    async def exchange() -> None:
        nonce_m = await reader.readexactly(NONCE_SIZE)
        nonce_w = secrets.token_bytes(NONCE_SIZE)
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
        nonce_m = secrets.token_bytes(NONCE_SIZE)
        writer.write(nonce_m)
        await writer.drain()
        reply = await reader.readexactly(HMAC_SIZE + NONCE_SIZE)
        if not hmac.compare_digest(reply[:HMAC_SIZE], _mac(key, nonce_m)):
            raise AuthError("worker authentication failed: invalid HMAC")
        writer.write(_mac(key, reply[HMAC_SIZE:]))
        await writer.drain()

    await _bounded(exchange(), timeout, "worker")
