"""The zero-config node's UDP discovery responder, and what it advertises (docs/protocol.md, Discovery).

A probe carrying this cluster's hash is answered, unicast to its sender, with a reply built
once at start (the name, the TCP port the setup listener really bound, the devices). Every
other datagram, malformed or for another cluster, is dropped with a debug line; a receive
error never ends the responder (it ends Cake's). It keeps answering while the node serves,
so that a restarted master can run setup again.

A reply is several times the probe's size and goes wherever the probe's source address says,
which UDP lets anyone forge: so a source outside --allow-from gets none, and no source gets more
than a few per second (`ReplyLimit`), which a master, probing once, never reaches.

The devices are described by cakemp/gpus.py, from nvidia-smi (the front never imports torch).
"""

from __future__ import annotations

import asyncio
import platform
import socket
import time
from collections.abc import Callable, Sequence

from cakemp import gpus, log
from cakemp.allow_list import AllowList
from cakemp.errors import ConfigError, ProtocolError
from cakemp.wire.discovery import Announcement, decode_probe, encode_announcement

REPLIES_PER_SOURCE = 4  # per source address and window
REPLY_WINDOW_S = 1.0
MAX_SOURCES = 1024  # sources answered per window: the table, and the replies sent, stay bounded


class ReplyLimit:
    """At most `per_source` replies to each source address per window of `window_s` seconds, and
    replies to at most `max_sources` addresses per window."""

    def __init__(self, per_source: int = REPLIES_PER_SOURCE, window_s: float = REPLY_WINDOW_S,
                 max_sources: int = MAX_SOURCES, clock: Callable[[], float] = time.monotonic):
        self._per_source, self._window_s, self._max_sources, self._clock = per_source, window_s, max_sources, clock
        self._window_end = float("-inf")
        self._replies: dict[str, int] = {}  # source address -> replies in this window

    def allows(self, source: str) -> bool:
        """Whether `source` may be answered now (counted as answered if so)."""
        now = self._clock()
        if now >= self._window_end:
            self._window_end, self._replies = now + self._window_s, {}
        replies = self._replies.get(source, 0)
        if replies >= self._per_source or (not replies and len(self._replies) >= self._max_sources):
            return False
        self._replies[source] = replies + 1
        return True


class DiscoveryResponder(asyncio.DatagramProtocol):
    """Answers probes for `announcement.cluster_hash` with the announcement, from the sources
    `allow_from` admits (None: any), as often as `limit` lets each."""

    def __init__(self, announcement: Announcement, allow_from: AllowList | None = None,
                 limit: ReplyLimit | None = None):
        self._reply = encode_announcement(announcement)
        self._hash = announcement.cluster_hash
        self._allow_from = allow_from
        self._limit = limit or ReplyLimit()
        self._transport: asyncio.DatagramTransport | None = None
        self._log = log.get_logger()

    @classmethod
    async def start(cls, announcement: Announcement, host: str, port: int,
                    allow_from: AllowList | None = None) -> tuple[asyncio.DatagramTransport, int]:
        """Listen on host:port/udp (broadcasts included); returns the transport and the bound port."""
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: cls(announcement, allow_from), local_addr=(host, port), family=socket.AF_INET,
                allow_broadcast=True)
        except OSError as e:
            raise ConfigError(f"cannot listen for discovery on {host}:{port}/udp: {e.strerror}") from None
        return transport, transport.get_extra_info("sockname")[1]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._allow_from is not None and not self._allow_from.allows(addr[0]):
            self._log.debug("discovery: datagram from outside --allow-from", peer=f"{addr[0]}:{addr[1]}")
            return
        try:
            wanted = decode_probe(data)
        except ProtocolError as e:
            self._log.debug("discovery: datagram ignored", peer=f"{addr[0]}:{addr[1]}", error=str(e))
            return
        if wanted != self._hash:
            self._log.debug("discovery: probe for another cluster", peer=f"{addr[0]}:{addr[1]}")
            return
        if not self._limit.allows(addr[0]):
            self._log.debug("discovery: probe over the rate limit", peer=f"{addr[0]}:{addr[1]}")
            return
        self._transport.sendto(self._reply, addr)
        self._log.info("discovery: answered a master", peer=f"{addr[0]}:{addr[1]}")

    def error_received(self, exc: Exception) -> None:
        # An ICMP error for an earlier reply (the master has gone): nothing to do, keep answering.
        self._log.debug("discovery: socket error", error=str(exc))


def announcement_for(cluster_hash: str, name: str, port: int, devices: Sequence[str | None]) -> Announcement:
    """What this node advertises: its name, the bound TCP `port`, the devices it will use (`--gpus`)."""
    described = gpus.describe(devices)
    return Announcement(
        cluster_hash=cluster_hash, worker_name=name, port=port, gpus=described,
        backend="CPU" if all(device.is_cpu for device in described) else "CUDA", hostname=socket.gethostname(),
        os=platform.system().lower(),
    )
