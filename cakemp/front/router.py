"""Which device runs which part of a request's layer run, and how a long prompt is cut (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cakemp.errors import UnknownLayer
from cakemp.ipc import Op
from cakemp.wire import LayerOp


@dataclass(frozen=True)
class Leg:
    """A maximal stretch of consecutive ops on one device; `Op.layer` indexes that device's layers."""

    device: int
    ops: tuple[Op, ...]


class Router:
    def __init__(self, placement: Sequence[Sequence[str]]):
        # placement[d] = the layers device d serves, in order.
        self._where = {layer: (device, i) for device, layers in enumerate(placement) for i, layer in enumerate(layers)}

    def plan(self, ops: Sequence[LayerOp]) -> tuple[Leg, ...]:
        """The legs that run `ops` in order; a run spanning devices passes through each in turn."""
        legs: list[tuple[int, list[Op]]] = []
        for op in ops:
            where = self._where.get(op.layer)
            if where is None:
                raise UnknownLayer(f"could not find layer {op.layer}")
            device, index = where
            if not legs or legs[-1][0] != device:
                legs.append((device, []))
            legs[-1][1].append(Op(index, op.index_pos, op.block_idx))
        return tuple(Leg(device, tuple(leg_ops)) for device, leg_ops in legs)


def chunk_bounds(tokens: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """[start, end) token ranges of at most `chunk` tokens covering `tokens`, as even as they can be.

    A prompt that fits one chunk is not cut; one that does not is cut into the fewest chunks
    of at most `chunk` tokens, of equal size within one token (so the pipeline's stages stay
    balanced, and no tiny last chunk wastes a hop).
    """
    count = max(1, -(-tokens // chunk))
    base, extra = divmod(tokens, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)
