"""Which device runs which part of a request's layer run (pure, no I/O); how a long prompt is cut is
`cakemp.ipc.spec.chunk_bounds`, which both the front and the devices cut by."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from cakemp.ipc import Stage
from cakemp.ipc.spec import chunk_bounds as chunk_bounds  # cut by the front and the devices alike
from cakemp.wire import LayerOps


class Route(NamedTuple):
    """Where a request runs: its stages in order, each the maximal stretch of consecutive ops on one
    device (`Op.layer` indexing that device's layers), for the process generation it expects."""

    stages: tuple[Stage, ...]
    devices: tuple[int, ...]  # each stage's, in order (asked several times a request)

    @classmethod
    def through(cls, stages: tuple[Stage, ...]) -> Route:
        return cls(stages, tuple(stage.device for stage in stages))

    def shifted(self, start: int) -> tuple[Stage, ...]:
        """The stages for a chunk whose first token is `start` tokens into the request."""
        if not start:
            return self.stages
        return tuple(stage._replace(positions=tuple(map(start.__add__, stage.positions))) for stage in self.stages)


class Router:
    """Layer names to (device, index there), translated once per layer run: the only place names are read."""

    def __init__(self, placement: Sequence[Sequence[str]]):
        # placement[d] = the layers device d serves, in order.
        self._where = {layer: (device, i) for device, layers in enumerate(placement) for i, layer in enumerate(layers)}
        # Each layer run's stages, by its layer names: (device, its ops' slice of the run, their indices
        # there), and the devices in order. A master sends one run step after step, so its names are
        # read once; at most _RUNS_KEPT runs are kept.
        self._runs: dict[tuple[str, ...], tuple[tuple[tuple[int, slice, tuple[int, ...]], ...], tuple[int, ...]]] = {}

    def plan(self, ops: LayerOps, generation: Callable[[int], int]) -> Route:
        """The route that runs `ops` in order, through each device in turn, expecting each device's
        `generation(device)`. Every layer must be served here: admission has checked it."""
        names, positions, blocks = ops.columns
        run = self._runs.get(names)
        if run is None:
            run = self._stages(names)
            if len(self._runs) < _RUNS_KEPT:
                self._runs[names] = run
        stages, devices = run
        return Route(tuple([Stage(device, generation(device), indices, positions[at], blocks[at])
                            for device, at, indices in stages]), devices)

    def _stages(self, names: tuple[str, ...]) -> tuple[tuple[tuple[int, slice, tuple[int, ...]], ...], tuple[int, ...]]:
        """The stages of a run of layers `names`, each a maximal stretch of them on one device; their devices."""
        stages: list[tuple[int, int, list[int]]] = []  # (device, first op, indices)
        for k, name in enumerate(names):
            device, index = self._where[name]
            if not stages or stages[-1][0] != device:
                stages.append((device, k, []))
            stages[-1][2].append(index)
        return (tuple((device, slice(first, first + len(indices)), tuple(indices)) for device, first, indices in stages),
                tuple(device for device, _, _ in stages))


_RUNS_KEPT = 64  # layer runs a Router keeps the stages of (a node's masters send a few)
