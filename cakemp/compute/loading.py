"""What loading a device's layers reads, checked before and after: each layer's block class and
weight groups (`LoadPlan`), which kept-quantized kernels this device multiplies by (`kept_kernels`),
and the read itself, from any WeightSource (model/weights/source.py). BlockRunner.load
(runner.py) builds its blocks from what this returns.

With experts offloaded (`LoadPlan.of(..., offload_experts=True)`), a MoE layer's routed experts
are left out of the read, and of the bytes the fit check counts, which counts the expert cache's
capacity instead; `expert_stores` gives those layers their experts, read on demand
(model/weights/experts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cakemp.checkpoint import resident
from cakemp.checkpoint.config import ModelConfig
from cakemp.compute import memory
from cakemp.errors import CheckpointError, ConfigError
from cakemp.model import attention
from cakemp.model.block import MATRICES, NORMS, DecoderBlock
from cakemp.model.linear_block import LinearAttentionBlock
from cakemp.model.moe import STACKED, SparseMoe
from cakemp.model.weights import expert_transfer, fp8, int4, int8, kept, rtn
from cakemp.model.weights.experts import ExpertCache, ExpertRead, ExpertStore, OffloadedExperts
from cakemp.model.weights.source import WeightSource

Block = DecoderBlock | LinearAttentionBlock


def block_type(config: ModelConfig, index: int) -> type[Block]:
    """The class of layer `index`: Qwen3.5's linear-attention layers, or an attention layer."""
    return LinearAttentionBlock if index in config.linear_layers else DecoderBlock



@dataclass(frozen=True)
class LoadPlan:
    """What loading some layers reads: each layer's block class, its weight groups (key -> the
    checkpoint names stored for it) and the shape config.json implies for each group."""

    config: ModelConfig
    layers: tuple[str, ...]
    kinds: dict[str, type[Block]]
    groups: dict[str, dict[str, list[str]]]
    shapes: dict[str, dict[str, tuple[int, ...]]]
    offloaded: dict[str, ExpertRead]  # the layers whose routed experts are read on demand, and where each lies

    @classmethod
    def of(cls, config: ModelConfig, checkpoint: WeightSource, layers: Sequence[str],
           offload_experts: bool = False) -> LoadPlan:
        """`offload_experts`: leave MoE layers' routed experts out of the read, to be read on demand."""
        kinds, groups, shapes, offloaded = {}, {}, {}, {}
        for layer in layers:
            index = config.layer_index(layer)
            if index is None:
                raise CheckpointError(f"layer {layer!r} is not one of "
                                      f"{config.layer_name(0)}..{config.layer_name(config.num_hidden_layers - 1)}")
            kinds[layer] = kind = block_type(config, index)

            def stored(name: str, layer: str = layer) -> bool:
                return checkpoint.has(f"{layer}.{name}")

            groups[layer] = kind.weight_groups(config, index, stored)
            shapes[layer] = kind.weight_shapes(config, index, stored)
            if offload_experts and STACKED & groups[layer].keys():
                groups[layer] = {key: names for key, names in groups[layer].items() if key not in STACKED}
                offloaded[layer] = SparseMoe.expert_reads(config, stored)
        return cls(config, tuple(layers), kinds, groups, shapes, offloaded)

    def read(self, checkpoint: WeightSource, device: torch.device, dtype: torch.dtype,
             on_layer: Callable[[int], None] | None, kernels: frozenset[str] = frozenset(),
             quantize: Rounding | None = None, reserved: int = 0) -> dict[tuple[str, str], torch.Tensor]:
        """(layer, key) -> its tensor on `device`, one layer at a time (`on_layer(n)` after n),
        after checking on a GPU that they fit beside `reserved` bytes (an expert cache's) (counting
        what stays int4, int8 or FP8 as such); each checked against the shape config.json implies.
        With `quantize` (--quantize), each layer's plain matrices are rounded into kept int8 or int4
        weights as soon as that layer is read (model/weights/rtn.py), so no more than one layer is
        ever held unquantized."""
        self._check_quantized_shapes(checkpoint)
        wanted = [self._wanted(layer) for layer in self.layers]
        needed = self.nbytes(checkpoint, dtype, kernels) + reserved
        free = None
        if device.type == "cuda":
            attention.use_fused_kernels()
            free = torch.cuda.mem_get_info(device)[0]
            memory.check_fits(needed, free, str(device))
        # A (1 + w) family's norms get their 1 added at load, in f32 (Reader.load), unless stored with it.
        plus_one = frozenset((layer, key) for layer in self.layers for key in self.groups[layer]
                             if checkpoint.norms_need_one and key in NORMS)
        weights = {}
        # Opening a shard again per layer costs only its header (the file is memory-mapped).
        try:
            for loaded, (kept, plain) in enumerate(wanted, 1):
                read = checkpoint.load(kept, device, dtype, plus_one=plus_one & kept.keys(), kernels=kernels)
                weights.update(read if quantize is None else _rounded(read, quantize))
                weights.update(checkpoint.load(plain, device, dtype))
                if on_layer is not None:
                    on_layer(loaded)
        except torch.OutOfMemoryError:
            if free is None:
                raise
            # Past the estimate (another process took memory meanwhile, say): as much a configuration error.
            raise memory.too_big(needed, free, str(device), "ran out of memory while loading") from None
        for (layer, key), tensor in weights.items():
            if tuple(tensor.shape) != self.shapes[layer][key]:
                raise CheckpointError(
                    f"{layer}: {' + '.join(self.groups[layer][key])} give shape {tuple(tensor.shape)}, "
                    f"config.json implies {self.shapes[layer][key]}"
                )
        return weights

    def expert_stores(self, checkpoint: WeightSource, device: torch.device, dtype: torch.dtype,
                      kernels: frozenset[str], cache: ExpertCache) -> dict[str, ExpertStore]:
        """Each offloaded layer's experts, read on demand through the checkpoint's files, mapped once
        for them all and kept so, into `cache` (quantized ones kept so where one of `kernels` takes them),
        each reaching `device` the one way it is moved there (model/weights/expert_transfer.py)."""
        if not self.offloaded:
            return {}
        moe, H = self.config.moe, self.config.hidden_size
        reads = {layer: _named(layer, read) for layer, read in self.offloaded.items()}
        every = {(layer, j, key): names for layer, read in reads.items() for j in range(moe.experts)
                 for key, names in read(j)[0].items()}
        mapped = checkpoint.mapped(every)
        shapes = ((2 * moe.intermediate_size, H), (H, moe.intermediate_size))
        moved = expert_transfer.transfer(device)
        return {layer: OffloadedExperts(layer, moe.experts, read, shapes, mapped, cache, moved, dtype, kernels)
                for layer, read in reads.items()}

    def _check_quantized_shapes(self, checkpoint: WeightSource) -> None:
        """Each group holding a GPTQ, MLX or FP8 weight checked, from the shards' headers, to make the shape
        config.json implies, before any is read: dequantized first, a matrix past it would cost 8 times
        its stored bytes (4-bit codes in f32; FP8's e4m3 and its scales, 12 times) before the check after
        loading saw it."""
        for layer in self.layers:
            groups = {key: [f"{layer}.{name}" for name in members] for key, members in self.groups[layer].items()}
            for key, shapes in checkpoint.dequantized_shapes(groups).items():
                if len({shape[1:] for shape in shapes}) > 1 or \
                        (sum(shape[0] for shape in shapes), *shapes[0][1:]) != self.shapes[layer][key]:
                    read = " + ".join(f"{name} {shape}" for name, shape in zip(groups[key], shapes))
                    raise CheckpointError(f"{layer}: {read} (dequantized) cannot make the shape config.json "
                                          f"implies, {self.shapes[layer][key]}")

    def nbytes(self, checkpoint: WeightSource, dtype: torch.dtype, kernels: frozenset[str] = frozenset()) -> int:
        """The bytes the layers take once loaded (quantized formats counted as what they are loaded as)."""
        return sum(checkpoint.nbytes(kept, dtype, kernels) + checkpoint.nbytes(plain, dtype)
                   for kept, plain in map(self._wanted, self.layers))

    def _wanted(self, layer: str) -> tuple[dict, dict]:
        """The layer's groups that may stay quantized, and those that must be plain tensors (stacked
        experts, viewed as [E, rows, cols]): (layer, key) -> checkpoint names, each."""
        named = {(layer, key): [f"{layer}.{name}" for name in members] for key, members in self.groups[layer].items()}
        return ({k: v for k, v in named.items() if k[1] not in STACKED},
                {k: v for k, v in named.items() if k[1] in STACKED})


def _named(layer: str, read: ExpertRead) -> ExpertRead:
    """`read` with the layer's prefix on each name (the checkpoint's full names)."""
    def named(j: int) -> tuple[dict[str, list[str]], int | None]:
        groups, index = read(j)
        return {key: [f"{layer}.{name}" for name in names] for key, names in groups.items()}, index
    return named


class Rounding(NamedTuple):
    """`--quantize`: plain matrices rounded at load into kept weights of `kernel` (int8, or int4 in groups of `group_size`)."""

    kernel: str
    group_size: int


def _rounded(weights: dict, quantize: Rounding) -> dict:
    """The plain matrices among `weights` ((layer, key) -> tensor) rounded into kept weights."""
    return {key: rtn.quantized(tensor, *quantize) if key[1] in MATRICES and isinstance(tensor, torch.Tensor)
            and tensor.dim() == 2 else tensor for key, tensor in weights.items()}


def check_quantizable(checkpoint: WeightSource, quantize: Rounding, device: torch.device, dtype: torch.dtype) -> None:
    """ConfigError (exit 78) where `--quantize` cannot apply: a checkpoint stored quantized already,
    or a device whose kernels (`usable_kernels`) do not include the one asked for."""
    if checkpoint.quantized:
        raise ConfigError(f"--quantize {quantize.kernel}: the checkpoint is quantized already; --quantize rounds "
                          "plain f32, bf16 or f16 weights only")
    if quantize.kernel not in usable_kernels(device, dtype):
        raise ConfigError(f"--quantize {quantize.kernel}: torch's {quantize.kernel} matmul is not used on {device} "
                          f"computing in {dtype} (checkpoint/resident.py)")


def kept_kernels(checkpoint: WeightSource, device: torch.device, dtype: torch.dtype) -> frozenset[str]:
    """The kernels quantized matrices may stay quantized for here (model/weights/kept.py): those the
    device kind keeps them for (checkpoint/resident.device_kernels: on a CPU "int4" in any compute
    dtype, each product's input rounded to bf16, and "int8"; on a GPU "fp8", and "int4" in bf16) where
    the kernel works on this device (int4.kernel_works, int8.kernel_works, fp8.gemm: cuBLAS's or the
    Triton kernel, whichever is picked is logged). For a checkpoint that may hold such matrices, why one
    is not used is logged once."""
    return usable_kernels(device, dtype) if checkpoint.stores_kept else frozenset()


def usable_kernels(device: torch.device, dtype: torch.dtype) -> frozenset[str]:
    """The kept kernels a device computing in `dtype` multiplies by (`kept_kernels`' answer for any checkpoint)."""
    if device.type not in ("cuda", "cpu"):
        return frozenset()
    wanted = resident.device_kernels(device.type, dtype == torch.bfloat16)
    if int4.KERNEL not in wanted:
        kept.dequantized(f"compute dtype {dtype} (torch's int4 matmul takes bf16 activations)")
    elif not int4.kernel_works(device):
        kept.dequantized(f"torch's int4 matmul does not run, or miscomputes, on {device}")
        wanted -= {int4.KERNEL}
    works = {int8.KERNEL: int8.kernel_works, fp8.KERNEL: lambda device: fp8.gemm(device, dtype) is not None}
    return frozenset(kernel for kernel in wanted if kernel not in works or works[kernel](device))
