"""One op of a layer run, as a device runs it: which of its layers, at which position, in which KV slot.

The master names layers ("model.layers.7", `wire.LayerOp`); the front's router translates each
name once into its device and the layer's index there, and from then on an op is this: the
ipc messages carry it and the runner indexes its blocks with it. Torch-free, so both sides share it.
A NamedTuple: a request makes one per layer it names, in the front's router and again in the
device's decoder, and a tuple is made in about a third of a frozen dataclass's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple


class Op(NamedTuple):
    """Run the device's layer number `layer` (its index in the device's layer list) at RoPE
    offset `index_pos` (the absolute position of the first token), in KV slot `block_idx` (as the
    master numbers it; the runner counts a later stack's on after the earlier stacks' slots:
    `ModelConfig.kv_slot`)."""

    layer: int
    index_pos: int
    block_idx: int


# An op's index_pos as a function: mapped over a request's ops without a Python loop.
index_pos_of = attrgetter("index_pos")


def shared_position(ops: Sequence[Op]) -> int | None:
    """The index_pos every op of `ops` is at; None where they differ, or there is no op. (A loop over
    the tuples: a third of the time of mapping an attribute getter over them, asked of every request.)"""
    if not ops:
        return None
    position = ops[0].index_pos
    for _, index_pos, _ in ops:
        if index_pos != position:
            return None
    return position
