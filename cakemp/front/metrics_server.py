"""The front's HTTP endpoint: /metrics, /healthz, /readyz and /layers, off unless
`--metrics-address` is given."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping

from cakemp import log
from cakemp.front.metrics import Metrics
from cakemp.prometheus import CONTENT_TYPE

REQUEST_TIMEOUT = 5.0  # seconds a client gets to send its request head
MAX_REQUEST_HEAD = 8192  # bytes; the paths served here need a few dozen


async def start_metrics_server(
    metrics: Metrics, host: str, port: int, placement: Callable[[], Mapping[str, object]] | None = None
) -> asyncio.Server:
    """Serves /metrics, /healthz, /readyz and /layers on (host, port) from the running loop.

    /healthz answers 200 whenever the loop answers at all: a blocked front answers nothing,
    which is what a liveness probe should see. /readyz is 200 only while `metrics.is_ready`.
    /layers is what `placement()` returns now, as JSON: which layers each device serves (404
    without `placement`).
    Each response closes its connection; a scraper reconnects every interval anyway.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            status, body, content_type = _respond(metrics, placement, head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            status, body, content_type = "400 Bad Request", "bad request\n", "text/plain; charset=utf-8"
        try:
            writer.write(
                (
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body.encode())}\r\nConnection: close\r\n\r\n{body}"
                ).encode()
            )
            await writer.drain()
        except ConnectionError:
            pass  # the client left; nothing to tell it
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD)
    bound_host, bound_port = server.sockets[0].getsockname()[:2]  # the real port when asked for 0
    log.get_logger().info("metrics endpoint", url=f"http://{bound_host}:{bound_port}/metrics", port=bound_port)
    return server


def _respond(
    metrics: Metrics, placement: Callable[[], Mapping[str, object]] | None, head: bytes
) -> tuple[str, str, str]:
    """(status line, body, content type) for one request head."""
    text_plain = "text/plain; charset=utf-8"
    try:
        method, target, version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return "400 Bad Request", "bad request\n", text_plain
    if not version.startswith("HTTP/1."):
        return "400 Bad Request", "bad request\n", text_plain
    if method != "GET":
        return "405 Method Not Allowed", "only GET\n", text_plain
    path = target.split("?", 1)[0]
    if path == "/metrics":
        return "200 OK", metrics.render(), CONTENT_TYPE
    if path == "/layers" and placement is not None:
        return "200 OK", json.dumps(placement()) + "\n", "application/json"
    if path == "/healthz":
        return "200 OK", "ok\n", text_plain
    if path == "/readyz":
        if metrics.is_ready:
            return "200 OK", "ready\n", text_plain
        return "503 Service Unavailable", "not ready\n", text_plain
    return "404 Not Found", "not found\n", text_plain
