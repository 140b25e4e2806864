"""The zero-config node's UDP discovery responder, and what it advertises (spec §7.1).

A probe carrying this cluster's hash is answered, unicast to its sender, with a reply built
once at start (the name, the TCP port the setup listener really bound, the devices). Every
other datagram, malformed or for another cluster, is dropped with a debug line; a receive
error never ends the responder (it ends Cake's). It keeps answering while the node serves,
so that a restarted master can run setup again.

The devices are described by cakemp/gpus.py, from nvidia-smi (the front never imports torch).
"""

from __future__ import annotations

import asyncio
import platform
import socket
from collections.abc import Sequence

from cakemp import gpus, log
from cakemp.errors import ConfigError, ProtocolError
from cakemp.wire.discovery import Announcement, decode_probe, encode_announcement


class DiscoveryResponder(asyncio.DatagramProtocol):
    """Answers probes for `announcement.cluster_hash` with the announcement."""

    def __init__(self, announcement: Announcement):
        self._reply = encode_announcement(announcement)
        self._hash = announcement.cluster_hash
        self._transport: asyncio.DatagramTransport | None = None
        self._log = log.get_logger()

    @classmethod
    async def start(cls, announcement: Announcement, host: str, port: int) -> tuple[asyncio.DatagramTransport, int]:
        """Listen on host:port/udp (broadcasts included); returns the transport and the bound port."""
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: cls(announcement), local_addr=(host, port), family=socket.AF_INET, allow_broadcast=True)
        except OSError as e:
            raise ConfigError(f"cannot listen for discovery on {host}:{port}/udp: {e.strerror}") from None
        return transport, transport.get_extra_info("sockname")[1]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            wanted = decode_probe(data)
        except ProtocolError as e:
            self._log.debug("discovery: datagram ignored", peer=f"{addr[0]}:{addr[1]}", error=str(e))
            return
        if wanted != self._hash:
            self._log.debug("discovery: probe for another cluster", peer=f"{addr[0]}:{addr[1]}")
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
