"""Which device runs which part of a request's layer run (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

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
