"""Cake's topology file and where this worker's layers go (pure functions, no I/O but `load`).

The file is a YAML map from worker name to node (spec §8). This worker serves the layers of its
own entry, expanded as Cake expands them, split into contiguous runs across its devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import yaml

from cakemp.errors import ConfigError

# Cake's `(?m)^(.+[^\d])(\d+)-(\d+)$`: "model.layers.0-15" -> base "model.layers.", 0, 15.
_RANGE = re.compile(r"(.+[^0-9])([0-9]+)-([0-9]+)")
_NUMBERED = re.compile(r"(.+[^0-9])([0-9]+)")  # "model.layers.7" -> "model.layers.", 7


@dataclass(frozen=True)
class Node:
    """One worker's entry; only `layers` matters to a worker, `host` is what the master dials."""

    host: str
    layers: tuple[str, ...]
    description: str | None = None
    vram_bytes: int = 0
    tflops: float = 0.0
    backend: str = ""
    hostname: str = ""
    os: str = ""


@dataclass(frozen=True)
class Topology:
    """Worker names to nodes, in file order (the fallback entry is the first)."""

    nodes: tuple[tuple[str, Node], ...]

    @classmethod
    def load(cls, path: str | Path, expand: bool = True) -> Topology:
        """`expand`: expand layer ranges (text models; image components are names, taken as written)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read topology {path}: {e.strerror}") from None
        return cls.parse(text, source=str(path), expand=expand)

    @classmethod
    def parse(cls, text: str, source: str = "topology", expand: bool = True) -> Topology:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must map worker names to nodes")
        return cls(tuple((str(name), _node(str(name), entry, source, expand)) for name, entry in data.items()))

    def worker(self, name: str) -> tuple[str, Node]:
        """The entry for `name`; with one entry only, that one whatever its name (Cake's fallback,
        the caller warns). An unknown name among several entries is a ConfigError: Cake would serve
        the first entry's layers, so every machine given a wrong name would serve the same ones."""
        nodes = dict(self.nodes)
        if name in nodes:
            return name, nodes[name]
        if not self.nodes:
            raise ConfigError(f"could not find topology for {name} and topology file is empty")
        if len(self.nodes) > 1:
            names = ", ".join(n for n, _ in self.nodes)
            raise ConfigError(f"worker name {name!r} is not in the topology (its entries: {names})")
        return self.nodes[0]


def _node(name: str, entry: object, source: str, expand: bool = True) -> Node:
    if not isinstance(entry, dict):
        raise ConfigError(f"{source}: node {name!r} must be a mapping")
    if "host" not in entry or "layers" not in entry:
        raise ConfigError(f"{source}: node {name!r} needs both 'host' and 'layers'")
    layers = entry["layers"] or []
    if not isinstance(layers, list):
        raise ConfigError(f"{source}: node {name!r}: 'layers' must be a list")
    try:
        return Node(
            host=str(entry["host"]),
            layers=(expand_layers if expand else tuple)([str(layer) for layer in layers]),
            description=None if entry.get("description") is None else str(entry["description"]),
            vram_bytes=int(entry.get("vram_bytes", 0)),
            tflops=float(entry.get("tflops", 0.0)),
            backend=str(entry.get("backend", "")),
            hostname=str(entry.get("hostname", "")),
            os=str(entry.get("os", "")),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: node {name!r}: {e}") from None


def expand_layers(entries: Sequence[str]) -> tuple[str, ...]:
    """Expand `base<a>-<b>` entries into base<a> … base<b> inclusive; others stay as written."""
    layers: list[str] = []
    for entry in entries:
        match = _RANGE.fullmatch(entry)
        if match is None:
            layers.append(entry)
            continue
        base, first, last = match.group(1), int(match.group(2)), int(match.group(3))
        if last < first:
            raise ConfigError(f"invalid layer range {entry!r}: {last} < {first}")
        layers.extend(f"{base}{i}" for i in range(first, last + 1))
    return tuple(layers)


def collapse_layers(layers: Sequence[str]) -> tuple[str, ...]:
    """The inverse of `expand_layers`: consecutive base<i>, base<i+1>, … as one `base<a>-<b>` entry."""
    entries: list[str] = []
    run: tuple[str, int, int] | None = None  # (base, first, last) of the run being collected

    def close() -> None:
        if run is not None:
            base, first, last = run
            entries.append(f"{base}{first}" if first == last else f"{base}{first}-{last}")

    for layer in layers:
        match = _NUMBERED.fullmatch(layer)
        if match is None or match.group(2) != str(int(match.group(2))):  # "layers.07" is kept as written
            close()
            run = None
            entries.append(layer)
            continue
        base, index = match.group(1), int(match.group(2))
        if run is not None and run[0] == base and run[2] + 1 == index:
            run = (base, run[1], index)
            continue
        close()
        run = (base, index, index)
    close()
    return tuple(entries)


def device_of(position: int, num_layers: int, num_devices: int) -> int:
    """Device of the layer at `position` of `num_layers`: i·D//n, as the seed splits them."""
    return position * num_devices // num_layers


def place_layers(layers: Sequence[str], num_devices: int) -> tuple[tuple[str, ...], ...]:
    """Split `layers` into `num_devices` contiguous runs; with more devices than layers some are empty."""
    runs: list[list[str]] = [[] for _ in range(num_devices)]
    for i, layer in enumerate(layers):
        runs[device_of(i, len(layers), num_devices)].append(layer)
    return tuple(tuple(run) for run in runs)
