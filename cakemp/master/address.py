"""Dialling a worker at its address as Cake writes it ("host:port", "[v6 address]:port")."""

from __future__ import annotations

import os

from cakemp.address import parse_address
from cakemp.errors import WorkerUnreachable
from cakemp.master.client import WorkerClient
from cakemp.wire import Revision


async def dial(
    address: str, *, cluster_key: str | None = None, revision: Revision = Revision.V2, timeout: float = 10.0
) -> WorkerClient:
    """Connect (and authenticate, with a key) to the worker at `address`; no Hello is sent.

    A refused, unroutable or timed-out connect is WorkerUnreachable; a failed handshake stays AuthError.
    """
    host, port = parse_address(address, "worker address", default_host=None)
    try:
        return await WorkerClient.connect(host, port, cluster_key=cluster_key, revision=revision, timeout=timeout)
    except TimeoutError:
        raise WorkerUnreachable(f"{address} did not accept a connection within {timeout:g} s") from None
    except OSError as exc:
        # asyncio's refused connect carries errno but a wordy strerror; getaddrinfo's errno is negative.
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        raise WorkerUnreachable(f"cannot connect to {address}: {reason}") from None
