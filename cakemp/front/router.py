"""Which device runs which part of a request's layer run (pure, no I/O); how a long prompt is cut is
`cakemp.ipc.spec.chunk_bounds`, which both the front and the devices cut by."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cakemp.ipc import Op, Stage
from cakemp.ipc.spec import chunk_bounds as chunk_bounds  # cut by the front and the devices alike
from cakemp.wire import LayerOp


@dataclass(frozen=True)
class Route:
    """Where a request runs: its stages in order, each the maximal stretch of consecutive ops on one
    device (`Op.layer` indexing that device's layers), for the process generation it expects."""

    stages: tuple[Stage, ...]
    devices: tuple[int, ...] = field(init=False, compare=False)  # each stage's, in order (asked several times a request)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(stage.device for stage in self.stages))

    def shifted(self, start: int) -> tuple[Stage, ...]:
        """The stages for a chunk whose first token is `start` tokens into the request."""
        if not start:
            return self.stages
        return tuple(stage._replace(ops=tuple(op._replace(index_pos=op.index_pos + start) for op in stage.ops))
                     for stage in self.stages)


class Router:
    """Layer names to (device, index there), translated once per request: the only place names are read."""

    def __init__(self, placement: Sequence[Sequence[str]]):
        # placement[d] = the layers device d serves, in order.
        self._where = {layer: (device, i) for device, layers in enumerate(placement) for i, layer in enumerate(layers)}

    def plan(self, ops: Sequence[LayerOp], generation: Callable[[int], int]) -> Route:
        """The route that runs `ops` in order, through each device in turn, expecting each device's
        `generation(device)`. Every layer must be served here: admission has checked it."""
        stages: list[tuple[int, list[Op]]] = []
        for op in ops:
            device, index = self._where[op.layer]
            if not stages or stages[-1][0] != device:
                stages.append((device, []))
            stages[-1][1].append(Op(index, op.index_pos, op.block_idx))
        return Route(tuple(Stage(device, generation(device), tuple(run)) for device, run in stages))
