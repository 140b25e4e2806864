"""The compute of one device: its loaded layers and its sessions' KV caches.

A plain class (no process, no socket) so tests and benchmarks call it directly; the device
process wraps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from cakemp.compute import memory
from cakemp.compute.kv_cache import KVCache
from cakemp.errors import BadTensor, CheckpointError, PositionGap, UnknownLayer
from cakemp.model import attention, fp8
from cakemp.model.block import DecoderBlock, plus_one
from cakemp.model.checkpoint import Checkpoint
from cakemp.model.config import ModelConfig
from cakemp.model.rotary import Rotary


class BlockRunner:
    def __init__(
        self,
        config: ModelConfig,
        blocks: dict[str, DecoderBlock],
        device: torch.device,
        dtype: torch.dtype,
        kv_budget_bytes: int | None = None,
        max_context: int | None = None,
    ):
        self.config = config
        self.blocks = blocks
        self.layers = tuple(blocks)
        self.device = device
        self.dtype = dtype
        # Each layer's rotary (None: the layer has none); layers sharing one share its tables.
        rotaries = {rope: Rotary(rope, device) for rope in set(config.layer_ropes) if rope is not None}
        self.rotaries = {
            layer: rotaries.get(config.layer_ropes[config.layer_index(layer)]) for layer in self.layers
        }
        self.cache = KVCache(
            config.num_key_value_heads,
            config.head_dim,
            dtype,
            device,
            max_context=max_context or config.max_position_embeddings,
            budget_bytes=kv_budget_bytes,
        )

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        layers: Sequence[str],
        device: torch.device | str,
        dtype: torch.dtype,
        kv_budget_bytes: int | None = None,
        max_context: int | None = None,
        on_layer: Callable[[int], None] | None = None,
    ) -> BlockRunner:
        """Load `layers` (e.g. "model.layers.3") of the checkpoint in `model_dir` onto `device`.

        `on_layer(n)` is called once `n` of them are on the device (the device process reports
        it, so that a load of minutes shows progress).
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # so x.device compares equal
        config = ModelConfig.from_dir(model_dir)
        checkpoint = Checkpoint(model_dir, config)
        groups = DecoderBlock.weight_groups(config)
        for layer in layers:
            if config.layer_index(layer) is None:
                raise CheckpointError(
                    f"layer {layer!r} is not one of {config.layer_name(0)}..{config.layer_name(config.num_hidden_layers - 1)}"
                )
        wanted = [{(layer, key): [f"{layer}.{name}" for name in members] for key, members in groups.items()}
                  for layer in layers]
        keep_fp8 = config.fp8_block is not None and fp8.scaled_mm_works(device, dtype)
        needed = sum(checkpoint.nbytes(layer_groups, dtype, keep_fp8) for layer_groups in wanted)
        free = None
        if device.type == "cuda":
            attention.use_fused_kernels()
            free = torch.cuda.mem_get_info(device)[0]
            memory.check_fits(needed, free, str(device))
        weights = {}
        # One layer at a time, so progress can be reported; opening a shard again per layer
        # costs only its header (the file is memory-mapped).
        try:
            for loaded, layer_groups in enumerate(wanted, 1):
                weights.update(checkpoint.load(layer_groups, device, dtype, keep_fp8))
                if on_layer is not None:
                    on_layer(loaded)
        except torch.OutOfMemoryError:
            if free is None:
                raise
            # Past the estimate (another process took memory meanwhile, say): as much a configuration error.
            raise memory.too_big(needed, free, str(device), "ran out of memory while loading") from None
        shapes = DecoderBlock.weight_shapes(config)
        for (layer, key), tensor in weights.items():
            if tuple(tensor.shape) != shapes[key]:
                raise CheckpointError(
                    f"{layer}: {' + '.join(groups[key])} give shape {tuple(tensor.shape)}, "
                    f"config.json implies {shapes[key]}"
                )
            if config.layout.norm_plus_one and key in DecoderBlock.NORMS:
                weights[layer, key] = plus_one(tensor)
        blocks = {
            layer: DecoderBlock(
                config, config.layer_windows[config.layer_index(layer)], {key: weights[layer, key] for key in groups}
            )
            for layer in layers
        }
        if device.type == "cuda" and kv_budget_bytes is None:
            kv_budget_bytes = memory.default_kv_budget(*torch.cuda.mem_get_info(device), str(device))
        return cls(config, blocks, device, dtype, kv_budget_bytes, max_context)

    def forward(self, session: int, x: torch.Tensor, ops: Sequence[tuple[str, int, int]]) -> torch.Tensor:
        """Run ops = [(layer_name, index_pos, block_idx), ...] in order on x: [1, T, H].

        index_pos is the absolute position of x's first token; block_idx picks the KV slot.
        A request at index_pos p keeps the first p cached positions of each slot and replaces
        the rest, so a master that restarts a prompt at 0 without Goodbye gets a fresh context
        rather than Cake's silently appended one; a p beyond what is cached is refused.
        """
        self._check_input(x)
        T = x.shape[1]
        ends = {}
        for layer, index_pos, block_idx in ops:
            if layer not in self.blocks:
                raise UnknownLayer(f"layer {layer!r} is not served here (this device has {', '.join(self.layers)})")
            if not 0 <= block_idx < self.config.num_hidden_layers:
                raise UnknownLayer(f"block_idx {block_idx} is outside 0..{self.config.num_hidden_layers - 1}")
            cached = self.cache.length(session, block_idx)
            if index_pos < 0 or index_pos > cached:
                raise PositionGap(
                    f"index_pos {index_pos} for block {block_idx} does not follow the {cached} positions cached in this session"
                )
            ends[block_idx] = max(ends.get(block_idx, 0), index_pos + T)
        slots = self.cache.reserve(session, ends)
        previous = {block_idx: slot.length for block_idx, slot in slots.items()}
        rotations = {(None, index_pos): (None, None) for _, index_pos, _ in ops}
        try:
            with torch.inference_mode():
                for layer, index_pos, block_idx in ops:
                    rotary = self.rotaries[layer]
                    if (rotary, index_pos) not in rotations:
                        rotations[rotary, index_pos] = rotary.cos_sin(index_pos, T, self.dtype)
                    cos, sin = rotations[rotary, index_pos]
                    slot = slots[block_idx]
                    x = self.blocks[layer].forward(x, cos, sin, slot.k, slot.v, index_pos)
                    slot.length = index_pos + T
        except BaseException:
            # Rows past a slot's previous length are unused; rows a rewind overwrote are lost,
            # so a failed request leaves each slot at its old length or at index_pos if less.
            for (_, index_pos, block_idx) in ops:
                slots[block_idx].length = min(previous[block_idx], index_pos)
            raise
        return x

    def _check_input(self, x: torch.Tensor) -> None:
        hidden = self.config.hidden_size
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] < 1 or x.shape[2] != hidden:
            raise BadTensor(f"activation has shape {tuple(x.shape)}, expected [1, T, {hidden}] with T >= 1")
        if x.dtype != self.dtype or x.device != self.device:
            raise BadTensor(f"activation is {x.dtype} on {x.device}, this device computes {self.dtype} on {self.device}")

    def clear_session(self, session: int) -> None:
        """Goodbye: forget the session's positions and free its buffers (unknown session: no-op)."""
        self.cache.clear(session)

    def end_session(self, session: int) -> None:
        """The connection closed: free everything the session holds."""
        self.cache.clear(session)

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def session_count(self) -> int:
        return self.cache.session_count()
