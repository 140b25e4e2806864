"""Cake's UDP discovery datagrams with no I/O: `CAKE` followed by compact JSON (docs/protocol.md, Discovery).

The master broadcasts `CAKE{"cluster_hash":"<h>"}` to port 10127; a worker of that cluster
answers with its name, TCP port and devices. The cluster hash is the lowercase hex of the
first 4 bytes of SHA-256(cluster key), so the key itself never travels. Like Cake's serde,
decoding ignores unknown keys; unlike it, a datagram that does not decode is a ProtocolError
the caller drops, never an end to the responder.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

from cakemp.errors import ProtocolError

DISCOVERY_PORT = 10127
MAGIC = b"CAKE"
MAX_DATAGRAM = 4096  # Cake's receive buffer; a longer datagram is cut there by the OS


def cluster_hash(cluster_key: str) -> str:
    """The 8 hex digits naming a cluster on the network and in the cache path."""
    return hashlib.sha256(cluster_key.encode("utf-8")).digest()[:4].hex()


@dataclass(frozen=True)
class GpuInfo:
    """One compute device as a worker advertises it; `tflops` is an estimate the master weighs layers by."""

    name: str
    vram_bytes: int
    tflops: float

    @property
    def is_cpu(self) -> bool:
        """A CPU rather than a GPU. The reply says so only by the name, "CPU (<arch>)" from Cake's
        and cakemp's workers alike; Cake's master tests that it starts with "cpu" (docs/protocol.md,
        Layer assignment)."""
        return self.name.lower().startswith("cpu")


@dataclass(frozen=True)
class Announcement:
    """A worker's reply: who it is, the TCP port its setup listener really bound, what it computes on."""

    cluster_hash: str
    worker_name: str
    port: int
    gpus: tuple[GpuInfo, ...]
    backend: str = ""
    hostname: str = ""
    os: str = ""


def encode_probe(hash_: str) -> bytes:
    """The master's datagram asking the workers of cluster `hash_` to answer."""
    return MAGIC + _compact({"cluster_hash": hash_})


def encode_announcement(announcement: Announcement) -> bytes:
    """The worker's reply datagram (Cake's field names and order)."""
    return MAGIC + _compact(asdict(announcement))


def decode_probe(datagram: bytes) -> str:
    """The cluster hash a probe asks for; ProtocolError when it is not a probe."""
    return _string(_object(datagram), "cluster_hash")


def decode_announcement(datagram: bytes) -> Announcement:
    """A worker's reply; ProtocolError when a required field is missing or of the wrong type."""
    fields = _object(datagram)
    gpus = fields.get("gpus")
    if not isinstance(gpus, list):
        raise ProtocolError("discovery reply: 'gpus' must be a list")
    port = fields.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ProtocolError(f"discovery reply: invalid port {port!r}")
    return Announcement(
        cluster_hash=_string(fields, "cluster_hash"),
        worker_name=_string(fields, "worker_name"),
        port=port,
        gpus=tuple(_gpu(gpu) for gpu in gpus),
        backend=_string(fields, "backend", ""),
        hostname=_string(fields, "hostname", ""),
        os=_string(fields, "os", ""),
    )


def _compact(value: dict) -> bytes:
    # serde_json's compact form: no spaces, non-ASCII kept as UTF-8.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _object(datagram: bytes) -> dict:
    if len(datagram) <= len(MAGIC) or not datagram.startswith(MAGIC):
        raise ProtocolError("not a Cake discovery datagram")
    try:
        value = json.loads(datagram[len(MAGIC):].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"discovery datagram is not JSON: {e}") from None
    if isinstance(value, list) and len(value) == 1:  # serde also reads a struct from a one-element array
        value = value[0]
    if not isinstance(value, dict):
        raise ProtocolError("discovery datagram must hold a JSON object")
    return value


def _string(fields: dict, key: str, default: str | None = None) -> str:
    value = fields.get(key, default)
    if not isinstance(value, str):
        raise ProtocolError(f"discovery datagram: {key!r} must be a string")
    return value


def _gpu(value: object) -> GpuInfo:
    if not isinstance(value, dict):
        raise ProtocolError("discovery reply: each gpu must be an object")
    vram, tflops = value.get("vram_bytes"), value.get("tflops", 0.0)
    if not isinstance(vram, int) or isinstance(vram, bool) or vram < 0:
        raise ProtocolError(f"discovery reply: invalid vram_bytes {vram!r}")
    # Python's JSON reads NaN and Infinity, which no worker sends and every weighing of layers breaks on.
    if not isinstance(tflops, (int, float)) or isinstance(tflops, bool) or not 0 <= tflops < math.inf:
        raise ProtocolError(f"discovery reply: invalid tflops {tflops!r}")
    return GpuInfo(_string(value, "name"), vram, float(tflops))
