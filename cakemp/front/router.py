"""Which device runs which part of a request's layer run, and how a long prompt is cut (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cakemp.ipc import Op, Stage
from cakemp.wire import LayerOp


@dataclass(frozen=True)
class Route:
    """Where a request runs: its stages in order, each the maximal stretch of consecutive ops on one
    device (`Op.layer` indexing that device's layers), for the process generation it expects."""

    stages: tuple[Stage, ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(stage.device for stage in self.stages)

    def shifted(self, start: int) -> tuple[Stage, ...]:
        """The stages for a chunk whose first token is `start` tokens into the request."""
        if not start:
            return self.stages
        return tuple(replace(stage, ops=tuple(replace(op, index_pos=op.index_pos + start) for op in stage.ops))
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


def chunk_bounds(tokens: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """[start, end) token ranges of at most `chunk` tokens covering `tokens`, as even as they can be.

    A prompt that fits one chunk is not cut; one that does not is cut into the fewest chunks
    of at most `chunk` tokens, of equal size within one token, whatever the route's stages.

    Why, across S devices that each take about as long on a chunk as the others (the layers
    split evenly): chunk i taking t_i on every stage, the last answer comes after
    sum(t_i) + (S - 1) * max(t_i), in whatever order and sizes the chunks come (a proportionate
    flow shop: the stages after the first wait, in all, for the longest chunk once each, wherever
    it lies). So grading the sizes (small first and last chunks, large ones between) does not
    shorten it: only a smaller longest chunk does, and a smaller chunk costs more per token (each
    reads all its layers' weights once); the fewest chunks of at most `chunk` make the least
    sum for that longest chunk. One stage has no pipeline, and the fewest chunks cost the least
    there too. `--prefill-chunk` sets the trade for a machine: docs/benchmarks.md, "Graded
    prefill chunks", has the measurements.
    """
    count = max(1, -(-tokens // chunk))
    base, extra = divmod(tokens, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)
