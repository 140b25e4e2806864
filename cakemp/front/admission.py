"""What the front checks of a request before any of it reaches a device (pure: no I/O, no torch):
the `Admission` protocol, and `LayerAdmission`, which implements it for a text model's layers
(component_admission.py's for an image model's components).

A device refuses most bad requests too, but only after the bytes crossed ipc and the request
was owed to the front; some it cannot refuse cleanly at all (a shape of 256 dimensions, a
shape whose element count wraps, half a million ops that keep it busy past the watchdog). So
the front admits only what a Cake master can legitimately send, from what it knows without
torch: the served layers, and the model's hidden size and context length from config.json.

An activation is [1, T, hidden] with 1 <= T <= the context limit, of a dtype a hidden state
can have, its byte count exactly T * hidden * itemsize; a layer run names served layers, each
layer and each KV slot (block_idx) at most once, so it is never longer than the layers served
(an empty run is allowed, as Cake allows it: the activation comes back as it came, no device
involved).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import split_layer
from cakemp.errors import BadOps, BadTensor, ContextLimitExceeded, UnknownLayer
from cakemp.wire import MAX_PAYLOAD, DType, LayerOps, RawTensor

# The wire dtypes a hidden state can have; any of them is served whatever --dtype computes in.
ACTIVATION_DTYPES = frozenset({DType.F16, DType.BF16, DType.F32})
# Room in a frame for everything but the activation bytes: tags, counts, the shape, a layer run
# (or a re-setup's LayerAssignment) with names of at most _MAX_NAME bytes.
_FRAME_OVERHEAD = 64 * 1024
_MAX_NAME = 256
# How much of a peer's text an error repeats back.
_SHOWN_CHARS = 64
_ITEMSIZE = {int(dtype): dtype.itemsize for dtype in ACTIVATION_DTYPES}  # by tag: no enum call per request
_RUNS_KEPT = 64  # valid layer runs kept (a node's masters send a few)


class Admission(Protocol):
    """The one judge of whether a peer's request fits what this node's devices serve."""

    def decode_limits(self) -> dict[str, int]:
        """The bounds `wire.decode_payload` checks before it builds a frame's items."""

    def max_payload(self) -> int:
        """The largest frame payload a master can need (a bigger frame is refused before it is read)."""

    def check_batch(self) -> None:
        """Raise the BadOps that refuses a Batch message (rather than SingleOp) here, if any."""

    def check(self, x: RawTensor, ops: LayerOps) -> None:
        """Raise the BadRequest that refuses running `ops` over `x`, if any."""


@dataclass(frozen=True)
class LayerAdmission:
    """The Admission of a text model's layers: what this node's devices serve, and the judge of a request to them."""

    layers: frozenset[str]  # every layer this node serves
    hidden_size: int
    max_context: int  # positions per session
    # The KV slots a request may name: the served layers' numbers, which is what Cake's masters send
    # as block_idx. So one session holds at most one slot per served layer (not one per layer of the model).
    blocks: frozenset[int]
    # A model of several stacks (VibeVoice-Realtime): per served layer, (its stack's first slot, its
    # stack's layer count), its block_idx counted from 0 within its stack (ModelConfig.kv_slot). Empty
    # for a model of one stack, whose slots are the block_idx themselves.
    stacks: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # The layer runs found valid, by their ops' layers and block_idx: a master sends one run step after step,
    # which is then checked op by op once. At most _RUNS_KEPT: a peer sending ever new runs pays the full check.
    _runs: set[tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def for_model(cls, model: ModelConfig, layers: Sequence[str], max_context: int | None) -> LayerAdmission:
        of_prefix = {prefix: (first, count) for prefix, first, count in model.stacks}
        # A name of no stack (the device refuses to load it) gets none of its slots.
        stacks = {layer: of_prefix.get((split_layer(layer) or ("", 0))[0], (0, 0)) for layer in layers
                  } if len(of_prefix) > 1 else {}
        return cls(frozenset(layers), model.hidden_size, max_context or model.max_position_embeddings,
                   frozenset(model.layer_index(layer) for layer in layers), stacks)

    def decode_limits(self) -> dict[str, int]:
        """The bounds `wire.decode_payload` checks before it builds a frame's items: a layer run
        names at most the layers served (each runs once), so a frame of half a million ops is
        refused at its count, not after half a million objects."""
        return {"ops": len(self.layers)}

    def max_payload(self) -> int:
        """The largest frame payload a master can need: the longest f32 activation and a layer run
        naming every served layer (a bigger frame is refused before it is read)."""
        ops = len(self.layers) * (4 + _MAX_NAME + 16)  # name length, name, index_pos, block_idx
        activation = self.max_context * self.hidden_size * DType.F32.itemsize
        return min(MAX_PAYLOAD, activation + ops + _FRAME_OVERHEAD)

    def check_batch(self) -> None:
        """A text master sends Batch and SingleOp alike: never refused."""

    def check(self, x: RawTensor, ops: LayerOps) -> None:
        """Raise the BadRequest that refuses running `ops` over `x`, if any. A layer run (its ops' layers
        and KV slots) that passed once passes again: only its positions are checked then, and on a
        failure every op is, for the error to name the first that fails."""
        self._check_tensor(x)
        tokens = x.shape[1]
        run = (ops.layers, ops.blocks) if len(ops) <= len(self.layers) else None
        if run in self._runs and (not ops or max(ops.positions) + tokens <= self.max_context):
            return
        self._check_ops(ops, tokens)
        if len(self._runs) < _RUNS_KEPT:
            self._runs.add(run)

    def _check_tensor(self, x: RawTensor) -> None:
        if x.dtype not in ACTIVATION_DTYPES:
            raise BadTensor(f"unsupported dtype {DType.describe(x.dtype)}: activations must be F16, BF16 or F32")
        # Each dim is checked on its own before anything is multiplied: no product can wrap.
        shape = x.shape
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != self.hidden_size:
            raise BadTensor(f"activation has shape {_shape_text(shape)}, expected [1, T, {self.hidden_size}] "
                            f"with T >= 1")
        if shape[1] > self.max_context:
            raise ContextLimitExceeded(f"{shape[1]} positions in one request pass the context limit of "
                                       f"{self.max_context} positions")
        expected = shape[1] * self.hidden_size * _ITEMSIZE[x.dtype]
        if memoryview(x.data).nbytes != expected:
            raise BadTensor(f"activation data is {memoryview(x.data).nbytes} bytes, shape {list(shape)} of "
                            f"{DType(x.dtype).name} needs {expected}")

    def _check_ops(self, ops: LayerOps, tokens: int) -> None:
        if len(ops) > len(self.layers):
            raise BadOps(f"the request has {len(ops)} ops; this worker serves {len(self.layers)} layers, "
                         "each runs at most once per request")
        layers, blocks = set(), set()
        for layer, index_pos, block_idx in ops:
            if layer not in self.layers:
                raise UnknownLayer(f"could not find layer {shown(layer)}")
            if layer in layers:
                raise BadOps(f"layer {layer} appears twice in one request")
            first, count = self.stacks.get(layer, (0, None))
            slot = first + block_idx
            if slot not in self.blocks or not (count is None or 0 <= block_idx < count):
                numbers = frozenset(s - first for s in self.blocks if s >= first and (count is None or s < first + count))
                raise BadOps(f"block_idx {block_idx} of layer {layer} is not a KV slot of this worker: a master "
                             f"names the served layers' own numbers ({_numbers_text(numbers)})")
            if slot in blocks:
                raise BadOps(f"block_idx {block_idx} (a KV slot) appears twice in one request")
            if index_pos + tokens > self.max_context:
                raise ContextLimitExceeded(
                    f"positions {index_pos}..{index_pos + tokens - 1} of layer {layer} pass the context limit "
                    f"of {self.max_context} positions")
            layers.add(layer)
            blocks.add(slot)


def shown(text: str) -> str:
    """A peer's text as an error may repeat it: printable, and at most _SHOWN_CHARS of it."""
    clipped = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + f"… ({len(text)} chars)"
    return clipped if clipped.isprintable() else repr(clipped)


def _numbers_text(numbers: frozenset[int]) -> str:
    """Sorted numbers with consecutive runs collapsed: "0-3, 7"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and runs[-1][1] + 1 == n:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _shape_text(shape: tuple[int, ...]) -> str:
    if len(shape) <= 4:
        return str(list(shape))
    return f"of {len(shape)} dimensions"
