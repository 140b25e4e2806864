"""The zero-config node's UDP discovery responder, and what it advertises (spec §7.1).

A probe carrying this cluster's hash is answered, unicast to its sender, with a reply built
once at start (the name, the TCP port the setup listener really bound, the devices). Every
other datagram, malformed or for another cluster, is dropped with a debug line; a receive
error never ends the responder (it ends Cake's). It keeps answering while the node serves,
so that a restarted master can run setup again.

Devices are found without torch: the front never imports it. GPUs come from nvidia-smi,
with Cake's TFLOPS estimate (VRAM GB × max clock GHz × 1.5); without one the node advertises
one CPU entry with the system's memory and 2 TFLOPS, as Cake does.
"""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Sequence

from cakemp import log
from cakemp.errors import ConfigError, ProtocolError
from cakemp.wire.discovery import Announcement, GpuInfo, decode_probe, encode_announcement

_CPU_TFLOPS = 2.0


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


def announcement_for(cluster_hash: str, name: str, port: int, gpus: Sequence[str | None]) -> Announcement:
    """What this node advertises: its name, the bound TCP `port`, the devices it will use (`--gpus`)."""
    devices = local_devices(gpus)
    return Announcement(
        cluster_hash=cluster_hash, worker_name=name, port=port, gpus=devices,
        backend="CPU" if devices[0].name.startswith("CPU (") else "CUDA", hostname=socket.gethostname(),
        os=platform.system().lower(),
    )


def local_devices(gpus: Sequence[str | None]) -> tuple[GpuInfo, ...]:
    """The devices among `gpus` (CUDA_VISIBLE_DEVICES ids, None for a CPU slot) as discovery
    describes them; one CPU entry when none of them is a GPU nvidia-smi lists."""
    cuda = [gpu for gpu in gpus if gpu is not None]
    found = _nvidia_gpus(cuda) if cuda else ()
    return found or (GpuInfo(f"CPU ({platform.machine()})", _system_memory(), _CPU_TFLOPS),)


def _nvidia_gpus(ids: Sequence[str]) -> tuple[GpuInfo, ...]:
    """The GPUs among nvidia-smi's list whose index or UUID is in `ids`; () when nvidia-smi is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return ()
    query = ["nvidia-smi", "--query-gpu=index,uuid,memory.total,clocks.max.graphics,name",
             "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    found = []
    for line in out.splitlines():
        keys, gpu = nvidia_smi_line(line)
        if gpu is not None and keys & set(ids):
            found.append(gpu)
    return tuple(found)


def nvidia_smi_line(line: str) -> tuple[set[str], GpuInfo | None]:
    """One line of the query: its index and UUID, and the GPU with Cake's TFLOPS estimate."""
    # The name goes last: it is the one field that may hold a comma.
    parts = [part.strip() for part in line.split(",", 4)]
    if len(parts) < 5 or not parts[2].isdigit():
        return set(), None
    index, uuid, vram_mib, clock, name = parts[0], parts[1], int(parts[2]), parts[3], parts[4]
    try:
        clock_ghz = float(clock) / 1000
    except ValueError:
        clock_ghz = 1.5  # Cake's default when the clock is not reported ("[N/A]")
    vram_gib = vram_mib / 1024
    return {index, uuid}, GpuInfo(name, vram_mib << 20, round(vram_gib * clock_ghz * 1.5, 2))


def _system_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
