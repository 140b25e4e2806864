"""Is a worker up and speaking Cake? Connect, authenticate, Hello, read its WorkerInfo; and,
from a cakemp node's metrics endpoint, which layers each of its devices serves."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request

from cakemp.address import parse_address
from cakemp.errors import ProtocolError, RemoteWorkerError, WorkerUnreachable
from cakemp.master.address import dial
from cakemp.master.client import NO_KEY_HINT
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
        hint = "" if cluster_key else NO_KEY_HINT
        raise ProtocolError(f"{address} did not answer Hello within {timeout:g} s{hint}") from None
    except RemoteWorkerError as exc:
        raise ProtocolError(f"{address} answered Hello with an error: {exc}") from None
    finally:
        await client.close()


def read_placement(metrics_address: str, *, timeout: float = 5.0) -> dict:
    """The /layers document of the cakemp node whose --metrics-address is `metrics_address`.

    Raises WorkerUnreachable (nothing answers) or ProtocolError (no /layers there, or not JSON).
    """
    host, port = parse_address(metrics_address, "--metrics-address", default_host=None)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/layers"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise ProtocolError(f"{url} answered {e.code} (is it a cakemp node's --metrics-address?)") from None
    except http.client.HTTPException as e:  # something listens there, but does not speak HTTP
        raise ProtocolError(f"{url} did not answer HTTP: {e}") from None
    except (urllib.error.URLError, OSError) as e:
        raise WorkerUnreachable(f"cannot read {url}: {getattr(e, 'reason', e)}") from None
    except ValueError:
        raise ProtocolError(f"{url} did not answer JSON") from None
