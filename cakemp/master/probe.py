"""Is a worker up and speaking Cake? Connect, authenticate, Hello, read its WorkerInfo."""

from __future__ import annotations

import asyncio

from cakemp.errors import ProtocolError, RemoteWorkerError
from cakemp.master.address import dial
from cakemp.wire import Revision, WorkerInfo


async def probe(
    address: str, *, cluster_key: str | None = None, timeout: float = 5.0, revision: Revision = Revision.V2
) -> WorkerInfo:
    """The WorkerInfo the worker at `address` answers Hello with.

    Raises WorkerUnreachable (nothing listens), AuthError (the handshake failed: another key,
    or a key on one side only) or ProtocolError (anything but WorkerInfo, or no answer in time).
    """
    client = await dial(address, cluster_key=cluster_key, revision=revision, timeout=timeout)
    try:
        return await asyncio.wait_for(client.hello(), timeout)
    except TimeoutError:
        hint = "" if cluster_key else " (does it expect a cluster key?)"
        raise ProtocolError(f"{address} did not answer Hello within {timeout:g} s{hint}") from None
    except RemoteWorkerError as exc:
        raise ProtocolError(f"{address} answered Hello with an error: {exc}") from None
    finally:
        await client.close()
