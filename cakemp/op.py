"""One op of a layer run, as a device runs it: which of its layers, at which position, in which KV slot.

The master names layers ("model.layers.7", `wire.LayerOp`); the front's router translates each
name once into its device and the layer's index there, and from then on an op is this: the
ipc messages carry it and the runner indexes its blocks with it. Torch-free, so both sides share it.

A request's ops travel and are read as columns (`OpColumns`: `Ops` here, `wire.LayerOps` on the
wire), a tuple a field, not as an object an op: a request names every layer a node serves, step
after step. An `Op` is made where one op is looked at alone (a request planned op by op).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import NamedTuple, Self, TypeVar

T = TypeVar("T")


class Op(NamedTuple):
    """Run the device's layer number `layer` (its index in the device's layer list) at RoPE
    offset `index_pos` (the absolute position of the first token), in KV slot `block_idx` (as the
    master numbers it; the runner counts a later stack's on after the earlier stacks' slots:
    `ModelConfig.kv_slot`)."""

    layer: int
    index_pos: int
    block_idx: int


class OpColumns(Sequence[T]):
    """A request's layer run as columns, a tuple each: each op's layer, index_pos and block_idx.

    What is read of every request per op (the run of layers and KV slots, the one position a decode's
    ops share) is then a tuple at hand, not one built of an object per op: a master sends every layer a
    node serves in each request, step after step (80 of a 70B model's on a node of its GPUs). Else a
    sequence of ops like any other (each made, an `item`, as it is asked for), equal to one of the same ops.
    """

    __slots__ = ("layers", "positions", "blocks")
    item: type  # the op one row of the columns makes

    def __init__(self, layers: tuple, positions: tuple[int, ...], blocks: tuple[int, ...]):
        self.layers, self.positions, self.blocks = layers, positions, blocks

    @classmethod
    def of(cls, ops: Iterable[tuple]) -> Self:
        columns = tuple(zip(*ops))
        return cls(*columns) if columns else cls((), (), ())

    @property
    def columns(self) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
        return self.layers, self.positions, self.blocks

    @property
    def position(self) -> int | None:
        """The index_pos every op is at; None where they differ, or there is no op."""
        positions = self.positions
        return positions[0] if positions and positions.count(positions[0]) == len(positions) else None

    def shifted(self, start: int) -> Self:
        """The ops of a piece of the request `start` tokens in: each index_pos `start` further."""
        return type(self)(self.layers, tuple(map(start.__add__, self.positions)), self.blocks)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return type(self)(self.layers[index], self.positions[index], self.blocks[index])
        return self.item(self.layers[index], self.positions[index], self.blocks[index])

    def __iter__(self) -> Iterator[T]:
        return map(tuple.__new__, repeat(self.item), zip(self.layers, self.positions, self.blocks))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OpColumns):
            return self.columns == other.columns
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))  # as the tuple of the same ops, which it equals

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class Ops(OpColumns[Op]):
    """A device's ops of a request as columns: an ipc Stage carries them so (ipc/message.py), and the
    runner groups a step's requests by their layers and KV slots and reads a decode's one position
    from them as they are."""

    __slots__ = ()
    item = Op
