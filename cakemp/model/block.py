"""One attention decoder layer run on T new tokens over a KV buffer.

Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3, OLMo 2, EXAONE 4 (where each family puts its
norms is in layout.py); Qwen3-MoE (its MLP a SparseMoe on sparse layers); Qwen3.5's
full-attention layers (q/k norm, partial rotary, a sigmoid output gate, (1 + w) norms).
Qwen3.5's linear-attention layers are LinearAttentionBlock (linear_block.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from cakemp.checkpoint.config import ModelConfig
from cakemp.model.linear import linear
from cakemp.model.mlp import GatedMlp
from cakemp.model.moe import SparseMoe
from cakemp.model.rotary import rotate

# Weight slots that are RMSNorm weights, of either block kind: a (1 + w) family
# (`layout.norm_plus_one`: Gemma 3, Qwen3.5) stores them as w, and Checkpoint.load adds the 1.
NORMS = frozenset({"input_norm", "attn_out_norm", "post_norm", "mlp_out_norm", "q_norm", "k_norm"})
# Weight slots, of either block kind, that are only ever multiplied through `linear` (so may be packed).
MATRICES = frozenset({"w_qkv", "w_o", "w_gate_up", "w_down", "w_in", "w_out", "shared_gate_up", "shared_down"})


class Pages(Protocol):
    """Where one layer's step keeps its K/V rows and what each row attends over: the requests of
    a step, their rows of x one after another, each at its own positions of its own KV slot
    (compute/paged_step.LayerPages)."""

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, H_kv, N, D], every row's keys and values, into the requests' slots."""

    def attend(self, q: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
        """q: [1, H_q, N, D] -> [1, H_q, N, D], each row over its own request's keys to its position."""


class DecoderBlock:
    """The weights of one layer and its forward pass; the KV buffers are lent by the caller.

    q/k/v and gate/up are stored fused (one [out, H] matrix each) so a step does one GEMM
    where HF does three and two: fewer passes over the activation and fewer kernel launches
    (bench/blocks.py measures the gain).
    """

    recurrent = False  # its session state is KV rows, which a rewind can cut back

    def __init__(self, config: ModelConfig, index: int, weights: dict[str, torch.Tensor]):
        """weights: the tensors named by `weight_groups(config, index, ...)`, on the device, in the compute
        dtype (matrices of an FP8 checkpoint may be `fp8.Fp8Weight`s, multiplied by `linear`)."""
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = config.layer_windows[index]
        self.scale = config.attention_scale
        self.qk_norm = config.qk_norm
        self.output_gate = config.attention_output_gate
        # Each norm [H] or None where the family's layout has none (layout.py).
        self.input_norm = weights.get("input_norm")
        self.attn_out_norm = weights.get("attn_out_norm")
        self.post_norm = weights.get("post_norm")  # before the MLP
        self.mlp_out_norm = weights.get("mlp_out_norm")
        self.w_qkv = weights["w_qkv"]  # [(H_q (x2 with an output gate) + 2 H_kv) * D, H]
        self.b_qkv = weights.get("b_qkv")  # [(H_q + 2 H_kv) * D] or None
        self.w_o = weights["w_o"]  # [H, H_q * D]
        self.b_o = weights.get("b_o")  # [H] or None
        self.q_norm = weights.get("q_norm")  # [D] per head, [H_q * D] over the projection, or None
        self.k_norm = weights.get("k_norm")  # [D] per head, [H_kv * D] over the projection, or None
        self.mlp = feed_forward(config, index, weights)

    @staticmethod
    def weight_groups(config: ModelConfig, index: int, stored: Callable[[str], bool]) -> dict[str, list[str]]:
        """Each weight of the block and the checkpoint tensors (relative to `model.layers.N.`)
        stacked along dim 0 to make it; `stored(name)` says whether the layer holds `name`."""
        layout = config.layout
        groups = {slot: [name] for slot, name in layout.norms}
        groups |= {
            "w_qkv": list(layout.qkv),
            "w_o": ["self_attn.o_proj.weight"],
            **feed_forward_groups(config, index, stored),
        }
        if config.qkv_bias:
            groups["b_qkv"] = [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if config.o_bias:
            groups["b_o"] = ["self_attn.o_proj.bias"]
        if config.qk_norm:
            groups["q_norm"] = ["self_attn.q_norm.weight"]
            groups["k_norm"] = ["self_attn.k_norm.weight"]
        return groups

    @staticmethod
    def weight_shapes(config: ModelConfig, index: int, stored: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
        """The shape each weight of `weight_groups` must have for this config."""
        H, D = config.hidden_size, config.head_dim
        q_rows = config.num_attention_heads * D * (2 if config.attention_output_gate else 1)
        qkv = q_rows + 2 * config.num_key_value_heads * D
        whole = config.qk_norm == "projection"
        return {
            "input_norm": (H,),
            "attn_out_norm": (H,),
            "post_norm": (H,),
            "mlp_out_norm": (H,),
            "w_qkv": (qkv, H),
            "b_qkv": (qkv,),
            "w_o": (H, config.num_attention_heads * D),
            "b_o": (H,),
            "q_norm": (config.num_attention_heads * D if whole else D,),
            "k_norm": (config.num_key_value_heads * D if whole else D,),
            **feed_forward_shapes(config, stored),
        }

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, pages: Pages) -> torch.Tensor:
        """x: [1, N, H], the tokens of a step's requests one after another -> [1, N, H].

        Every projection and the MLP run once over all N tokens (one pass over each weight,
        whatever the number of requests); `pages` keeps each request's new K/V rows and gives
        each row its attention over its own request's keys.
        cos, sin: [N, R], each token's rotation (R < D: partial), or None for a layer without one.
        """
        attended = self._attention(self._norm(x, self.input_norm), cos, sin, pages)
        x = x + self._norm(attended, self.attn_out_norm)
        return x + self._norm(self.mlp(self._norm(x, self.post_norm)), self.mlp_out_norm)

    def _norm(self, x, weight):
        return x if weight is None else rms_norm(x, weight, self.eps)

    def _attention(self, h, cos, sin, pages):
        B, N, _ = h.shape
        D, n_kv = self.head_dim, self.kv_heads
        q_width = self.heads * D * (2 if self.output_gate else 1)
        qkv = linear(h, self.w_qkv, self.b_qkv)  # [1, N, q_width + 2 H_kv D]
        # split_with_sizes is the op itself; Tensor.split wraps it in ~2 µs of Python per call.
        q, k, v = qkv.split_with_sizes([q_width, n_kv * D, n_kv * D], dim=-1)
        if self.output_gate:
            # Qwen3.5: each head's rows are [q | gate].
            q, gate = q.view(B, N, self.heads, 2 * D).chunk(2, dim=-1)  # [1, N, H_q, D] each
        if self.qk_norm == "projection":  # OLMo 2: over all heads at once, before the split
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = q.reshape(B, N, self.heads, D)
        k = k.view(B, N, n_kv, D)
        if self.qk_norm == "head":
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        if cos is None:
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, H_q, N, D], [1, H_kv, N, D]
        else:
            # q and k rotated as one tensor, [1, H_q + H_kv, N, D]: one pass of rotate's ops, not two.
            # Untouched by norms or a gate, they are one view of qkv's first rows; else one copy.
            plain = self.qk_norm is None and not self.output_gate
            qk = qkv[..., :(self.heads + n_kv) * D].view(B, N, -1, D) if plain else torch.cat([q, k], dim=2)
            q, k = rotate(qk.transpose(1, 2), cos, sin).split_with_sizes([self.heads, n_kv], dim=1)
        v = v.view(B, N, n_kv, D).transpose(1, 2)  # [1, H_kv, N, D]

        # A sliding window only narrows what is read: the cache keeps every position of every
        # layer, local (Gemma 3, EXAONE 4, Mistral, Phi-3) or global (as Cake's full-attention
        # layers do), so a window layer costs the same memory as a full one; its reads stop at
        # the window. SDPA's kernels (CPU flash, CUDA flash / memory-efficient; math only unless
        # allow_fp16_bf16_reduction_math_sdp is switched on) keep the softmax max, sum and P@V
        # accumulator in f32 for f16/bf16 inputs; tests/model/test_block.py checks it.
        pages.write(k, v)
        out = pages.attend(q, self.window, self.scale)  # [1, H_q, N, D]
        out = out.transpose(1, 2).reshape(B, N, self.heads * D)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(B, N, self.heads * D))
        return linear(out, self.w_o, self.b_o)


def _sparse(config: ModelConfig, index: int) -> bool:
    return config.moe is not None and config.moe.sparse_layers[index]


def feed_forward(config: ModelConfig, index: int, weights: dict[str, torch.Tensor]) -> GatedMlp | SparseMoe:
    """Layer `index`'s MLP: a SparseMoe on a MoE family's sparse layers, else the dense GatedMlp."""
    if _sparse(config, index):
        return SparseMoe(config, weights)
    return GatedMlp(weights["w_gate_up"], weights["w_down"], config.activation)


def feed_forward_groups(config: ModelConfig, index: int, stored: Callable[[str], bool]) -> dict[str, list[str]]:
    """The MLP's groups: the experts', or gate/up as the family's layout stores them (Phi: fused)."""
    if _sparse(config, index):
        return SparseMoe.weight_groups(config, stored)
    return {"w_gate_up": list(config.layout.gate_up), "w_down": ["mlp.down_proj.weight"]}


def feed_forward_shapes(config: ModelConfig, stored: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
    H, I = config.hidden_size, config.intermediate_size
    shapes = {"w_gate_up": (2 * I, H), "w_down": (H, I)}
    if config.moe is not None:
        shapes.update(SparseMoe.weight_shapes(config, stored))
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim (torch's rms_norm computes in f32 for f16/bf16 inputs).

    An f32 weight on f16/bf16 x (a folded (1 + w): Gemma 3, Qwen3.5) scales in f32 and rounds
    once at the end, as transformers' (1 + w) norms do.
    """
    if weight.dtype != x.dtype:
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)
