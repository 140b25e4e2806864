"""The master's half of discovery: probe for a cluster's workers and collect their replies.

As Cake's master (docs/protocol.md, Discovery): every second a `CAKE{"cluster_hash":…}` probe goes to each
target (a broadcast address such as 255.255.255.255, or a worker's own address), and replies
are collected until `timeout` passes or `min_workers` addresses have answered. A worker is reached at
the reply's source address and its advertised port. Datagrams that do not decode, or name another
cluster, are dropped.

Nothing in a reply is authenticated (the probe carries the cluster hash for anyone to answer, and
UDP source addresses can be forged), so replies are only candidates: the master gives layers to
those that prove the key over TCP at their address (master/cluster.py). An address is one worker
whatever the replies naming it say; where they differ, each is kept (`claims`) and the least
figures any of them claim are believed: a forged reply can lower a worker's weight, never raise it
above the worker's own. Unlike Cake, replies are not deduplicated by name here (a forged reply
could take a real worker's name): that happens among the proven ones. At most MAX_ADDRESSES
addresses and MAX_CLAIMS different replies per address are kept, so a flood of replies costs at
most that many connections to prove.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from cakemp.errors import ProtocolError
from cakemp.wire.discovery import DISCOVERY_PORT, Announcement, cluster_hash, decode_announcement, encode_probe

_PROBE_INTERVAL_S = 1.0
MAX_ADDRESSES = 64
MAX_CLAIMS = 8


@dataclass(frozen=True)
class DiscoveredWorker:
    """An address that answered: where to reach it, and every different reply naming it, first heard first."""

    host: str
    claims: tuple[Announcement, ...]  # all with this host's port

    @property
    def name(self) -> str:
        return self.claims[0].worker_name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.claims[0].port}"

    @property
    def tflops(self) -> float:
        """The least TFLOPS any reply claims for this address (all its devices together)."""
        return min(sum(gpu.tflops for gpu in claim.gpus) for claim in self.claims)


class _Collector(asyncio.DatagramProtocol):
    def __init__(self, hash_: str, wanted: int):
        self.hash, self.wanted = hash_, wanted
        self.claims: dict[tuple[str, int], list[Announcement]] = {}  # (host, port) -> its different replies
        self.enough = asyncio.Event()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            announcement = decode_announcement(data)
        except ProtocolError:
            return
        if announcement.cluster_hash != self.hash:
            return
        address = (addr[0], announcement.port)
        if address not in self.claims and len(self.claims) >= MAX_ADDRESSES:
            return
        claims = self.claims.setdefault(address, [])
        if announcement not in claims and len(claims) < MAX_CLAIMS:
            claims.append(announcement)
        if self.wanted and len(self.claims) >= self.wanted:
            self.enough.set()

    def workers(self) -> list[DiscoveredWorker]:
        return [DiscoveredWorker(host, tuple(claims)) for (host, _), claims in self.claims.items()]


async def discover(cluster_key: str, targets: Sequence[str] = ("255.255.255.255",), *, port: int = DISCOVERY_PORT,
                   timeout: float = 10.0, min_workers: int = 0) -> list[DiscoveredWorker]:
    """The addresses answering for `cluster_key`'s cluster at `targets` (host names or IPv4
    addresses, broadcast or unicast) on UDP `port`, in the order they answered; unproven."""
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
    return collector.workers()
