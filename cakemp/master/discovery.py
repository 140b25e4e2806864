"""The master's half of discovery: probe for a cluster's workers and collect their replies.

As Cake's master (docs/protocol.md, Discovery): every second a `CAKE{"cluster_hash":…}` probe goes to each
target (a broadcast address such as 255.255.255.255, or a worker's own address), and replies
are collected until `timeout` passes or `min_workers` have answered. A worker is reached at
the reply's source address and its advertised port; replies are deduplicated by worker name
(the first wins, as in Cake). Datagrams that do not decode, or name another cluster, are
dropped.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from cakemp.errors import ProtocolError
from cakemp.wire.discovery import DISCOVERY_PORT, Announcement, cluster_hash, decode_announcement, encode_probe

_PROBE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class DiscoveredWorker:
    """A worker that answered: where to reach it, and what it announced."""

    host: str
    announcement: Announcement

    @property
    def name(self) -> str:
        return self.announcement.worker_name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.announcement.port}"

    @property
    def tflops(self) -> float:
        return sum(gpu.tflops for gpu in self.announcement.gpus)


class _Collector(asyncio.DatagramProtocol):
    def __init__(self, hash_: str, wanted: int):
        self.hash, self.wanted = hash_, wanted
        self.workers: dict[str, DiscoveredWorker] = {}
        self.enough = asyncio.Event()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            announcement = decode_announcement(data)
        except ProtocolError:
            return
        if announcement.cluster_hash != self.hash or announcement.worker_name in self.workers:
            return
        self.workers[announcement.worker_name] = DiscoveredWorker(addr[0], announcement)
        if self.wanted and len(self.workers) >= self.wanted:
            self.enough.set()


async def discover(cluster_key: str, targets: Sequence[str] = ("255.255.255.255",), *, port: int = DISCOVERY_PORT,
                   timeout: float = 10.0, min_workers: int = 0) -> list[DiscoveredWorker]:
    """The workers of `cluster_key`'s cluster answering at `targets` (host names or IPv4
    addresses, broadcast or unicast) on UDP `port`, in the order they answered."""
    loop = asyncio.get_running_loop()
    hash_ = cluster_hash(cluster_key)
    transport, collector = await loop.create_datagram_endpoint(
        lambda: _Collector(hash_, min_workers), local_addr=("0.0.0.0", 0), family=socket.AF_INET,
        allow_broadcast=True)
    probe = encode_probe(hash_)
    deadline = loop.time() + timeout
    try:
        while loop.time() < deadline and not collector.enough.is_set():
            for target in targets:
                transport.sendto(probe, (target, port))
            try:
                await asyncio.wait_for(collector.enough.wait(), min(_PROBE_INTERVAL_S, deadline - loop.time()))
            except TimeoutError:
                pass
    finally:
        transport.close()
    return list(collector.workers.values())
