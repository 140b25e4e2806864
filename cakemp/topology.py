"""Cake's topology file and where this worker's layers go (pure functions, no I/O but `load`).

The file is a YAML map from worker name to node (docs/protocol.md, Topology files). This worker serves the layers of its
own entry, expanded as Cake expands them, split into contiguous runs across its devices.

Cake's default strategy (docs/protocol.md, Layer assignment; Cake's `sharding/default.rs`) is
here too, for both sides that assign layers: `default_assignment` splits a model's layers among workers in proportion to
their TFLOPS, the master's own counted in the total, fastest first, in contiguous runs from layer
0, each capped by what its memory holds; the master keeps the rest. A zero-config master weighs
discovered workers by it; a topology whose nodes all list no layers is completed by it
(`Topology.assigned`), as Cake (HEAD) completes it on every process, master and workers alike.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

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

    @property
    def needs_assignment(self) -> bool:
        """Cake's `needs_auto_sharding`: there are nodes, and none lists a layer."""
        return bool(self.nodes) and all(not node.layers for _, node in self.nodes)

    @property
    def weighs_memory(self) -> bool:
        """Whether a node gives its memory (`vram_bytes`), so that the assignment needs a layer's size."""
        return any(node.vram_bytes > 0 for _, node in self.nodes)

    def assigned(self, num_layers: int, prefix: str, master_tflops: float, layer_bytes: int) -> Topology:
        """The topology with its nodes given layers by Cake's default strategy, as Cake's topology
        mode gives them: nodes taken in name order (then fastest first), each weighed by `capacity`,
        no cap on the master. `layer_bytes`: one layer's size (0: unknown, no cap)."""
        names = sorted(name for name, _ in self.nodes)
        nodes = dict(self.nodes)
        capacities = [capacity(name, nodes[name], layer_bytes) for name in names]
        runs = default_assignment(capacities, num_layers, master_tflops)
        given = {names[i]: layer_names(prefix, run) for i, run in runs}
        return Topology(tuple((name, replace(node, layers=given.get(name, ()))) for name, node in self.nodes))

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
    """Device of the layer at `position` of `num_layers`: i·D//n, as Cake's multi-GPU worker splits them."""
    return position * num_devices // num_layers


def place_layers(layers: Sequence[str], num_devices: int) -> tuple[tuple[str, ...], ...]:
    """Split `layers` into `num_devices` contiguous runs; with more devices than layers some are empty."""
    runs: list[list[str]] = [[] for _ in range(num_devices)]
    for i, layer in enumerate(layers):
        runs[device_of(i, len(layers), num_devices)].append(layer)
    return tuple(tuple(run) for run in runs)


# Cake's topology nodes: a node giving its memory may fill this share of it (`NamedNode`).
_NODE_USABLE_MEMORY = 0.85
# Cake's TFLOPS guess for a node that gives its memory but no TFLOPS, per GiB by its name's maker
# (`estimate_tflops_for_gpus`), and the figure for any other device.
_TFLOPS_PER_GIB = ((("nvidia", "geforce", "rtx", "gtx", "tesla"), 3.0), (("apple", "silicon"), 0.4))
_OTHER_DEVICE_TFLOPS = 2.0


@dataclass(frozen=True)
class Capacity:
    """What Cake's default strategy weighs a worker by: its TFLOPS, and how many layers its memory
    holds (None: no limit known)."""

    name: str
    tflops: float
    max_layers: int | None = None


def capacity(name: str, node: Node, layer_bytes: int) -> Capacity:
    """A topology node weighed as Cake's topology mode weighs it: its `tflops`, or without them a
    guess from its memory and its description's maker (0 without memory either); at most 85 % of
    its `vram_bytes` in layers of `layer_bytes` (no cap without either)."""
    if not math.isfinite(node.tflops):
        raise ConfigError(f"topology node {name!r}: tflops must be a finite number, not {node.tflops}")
    tflops = node.tflops if node.tflops > 0 else _guessed_tflops(node)
    if node.vram_bytes > 0 and layer_bytes > 0:
        return Capacity(name, tflops, int(node.vram_bytes * _NODE_USABLE_MEMORY) // layer_bytes)
    return Capacity(name, tflops)


def _guessed_tflops(node: Node) -> float:
    """Cake's guess for a node without TFLOPS: by GiB of memory, as its name (description, else
    backend, else "GPU (<hostname>)") names the maker."""
    if node.vram_bytes <= 0:
        return 0.0
    name = (node.description if node.description is not None else node.backend or f"GPU ({node.hostname})").lower()
    for makers, per_gib in _TFLOPS_PER_GIB:
        if any(maker in name for maker in makers):
            return node.vram_bytes / (1 << 30) * per_gib
    return _OTHER_DEVICE_TFLOPS


def default_assignment(workers: Sequence[Capacity], num_layers: int,
                       master_tflops: float) -> list[tuple[int, range]]:
    """Cake's default strategy: (index into `workers`, its run of layer numbers) for each worker
    given layers, in the order they were given (fastest first; a stable sort, so ties keep
    `workers`' order). The workers get round(their TFLOPS / all TFLOPS x `num_layers`) layers
    together, the master's TFLOPS counted in the total; each in turn its share of what is left
    (at least one), capped by its `max_layers`; the last what is left. With no TFLOPS anywhere,
    half the layers split evenly, uncapped (Cake's fallback). The master keeps the rest."""
    if not workers or num_layers == 0:
        return []
    workers_tflops = sum(w.tflops for w in workers)
    if workers_tflops + master_tflops <= 0:
        share = num_layers // 2 // len(workers)
        counts = [share] * (len(workers) - 1) + [num_layers // 2 - share * (len(workers) - 1)]
        return _runs(list(range(len(workers))), counts)
    order = sorted(range(len(workers)), key=lambda i: workers[i].tflops, reverse=True)
    remaining = min(_rust_round(workers_tflops / (workers_tflops + master_tflops) * num_layers), num_layers)
    remaining_tflops = workers_tflops
    counts = []
    for position, i in enumerate(order):
        worker = workers[i]
        if position == len(order) - 1:
            count = remaining
        else:
            count = min(max(_rust_round(_ratio(worker.tflops, remaining_tflops) * remaining), 1), remaining)
        if worker.max_layers is not None:
            count = min(count, worker.max_layers)
        counts.append(count)
        remaining -= count
        remaining_tflops -= worker.tflops
    return _runs(order, counts)


def _runs(order: Sequence[int], counts: Sequence[int]) -> list[tuple[int, range]]:
    """Contiguous runs from layer 0, one per worker of `order` with a count above 0."""
    runs, offset = [], 0
    for i, count in zip(order, counts):
        if count > 0:
            runs.append((i, range(offset, offset + count)))
        offset += count
    return runs


def layer_names(prefix: str, numbers: Sequence[int]) -> tuple[str, ...]:
    """"model.layers", [3, 4] -> ("model.layers.3", "model.layers.4")."""
    return tuple(f"{prefix}.{i}" for i in numbers)


def _ratio(a: float, b: float) -> float:
    """a / b as f64 division gives it: 0/0 is NaN, a positive over 0 infinite."""
    if b != 0:
        return a / b
    return math.nan if a == 0 else math.copysign(math.inf, a)


def _rust_round(x: float) -> int:
    """Rust's `x.round() as usize`: halves away from zero; NaN and negatives 0, infinity saturating."""
    if math.isnan(x) or x <= 0:
        return 0
    if math.isinf(x):
        return sys.maxsize
    whole = math.floor(x)
    return whole + 1 if x - whole >= 0.5 else whole
