"""A worker's address as Cake writes it ("host:port", "[v6 address]:port"), and dialling it."""

from __future__ import annotations

import asyncio
import os

from cakemp.errors import ConfigError, WorkerUnreachable
from cakemp.master.client import WorkerClient
from cakemp.wire import Revision


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port"; brackets around an IPv6 host are dropped."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad worker address {address!r}: expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def dial(
    address: str, *, cluster_key: str | None = None, revision: Revision = Revision.V2, timeout: float = 10.0
) -> WorkerClient:
    """Connect (and authenticate, with a key) to the worker at `address`; no Hello is sent.

    A refused, unroutable or timed-out connect is WorkerUnreachable; a failed handshake stays AuthError.
    """
    host, port = split_address(address)
    try:
        return await WorkerClient.connect(host, port, cluster_key=cluster_key, revision=revision, timeout=timeout)
    except asyncio.TimeoutError:
        raise WorkerUnreachable(f"{address} did not accept a connection within {timeout:g} s") from None
    except OSError as exc:
        # asyncio's refused connect carries errno but a wordy strerror; getaddrinfo's errno is negative.
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        raise WorkerUnreachable(f"cannot connect to {address}: {reason}") from None
