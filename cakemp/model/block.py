"""One decoder layer (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3, OLMo 2, EXAONE 4) run on T new
tokens over a KV buffer; where each family puts its norms is in layout.py."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from cakemp.model import attention
from cakemp.model.config import ModelConfig
from cakemp.model.fp8 import linear
from cakemp.model.rotary import rotate


class DecoderBlock:
    """The weights of one layer and its forward pass; the KV buffers are lent by the caller.

    q/k/v and gate/up are stored fused (one [out, H] matrix each) so a step does one GEMM
    where HF does three and two: fewer passes over the activation and fewer kernel launches
    (bench/blocks.py measures the gain).
    """

    # Weight slots that are RMSNorm weights (a family with (1 + w) norms folds its +1 into all).
    NORMS = ("input_norm", "attn_out_norm", "post_norm", "mlp_out_norm", "q_norm", "k_norm")

    def __init__(self, config: ModelConfig, window: int | None, weights: dict[str, torch.Tensor]):
        """weights: the tensors named by `weight_groups(config)`, on the device, in the compute dtype
        (matrices of an FP8 checkpoint may be `fp8.Fp8Weight`s, multiplied by `linear`)."""
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = window
        self.scale = config.attention_scale
        self.qk_norm = config.qk_norm
        self.activation = F.silu if config.activation == "silu" else partial(F.gelu, approximate="tanh")
        # Each norm [H] or None where the family's layout has none (layout.py).
        self.input_norm = weights.get("input_norm")
        self.attn_out_norm = weights.get("attn_out_norm")
        self.post_norm = weights.get("post_norm")  # before the MLP
        self.mlp_out_norm = weights.get("mlp_out_norm")
        self.w_qkv = weights["w_qkv"]  # [(H_q + 2 H_kv) * D, H]
        self.b_qkv = weights.get("b_qkv")  # [(H_q + 2 H_kv) * D] or None
        self.w_o = weights["w_o"]  # [H, H_q * D]
        self.b_o = weights.get("b_o")  # [H] or None
        self.q_norm = weights.get("q_norm")  # [D] per head, [H_q * D] over the projection, or None
        self.k_norm = weights.get("k_norm")  # [D] per head, [H_kv * D] over the projection, or None
        self.w_gate_up = weights["w_gate_up"]  # [2I, H]
        self.w_down = weights["w_down"]  # [H, I]

    @staticmethod
    def weight_groups(config: ModelConfig) -> dict[str, list[str]]:
        """Each weight of the block and the checkpoint tensors (relative to `model.layers.N.`)
        stacked along dim 0 to make it."""
        layout = config.layout
        groups = {slot: [name] for slot, name in layout.norms}
        groups |= {
            "w_qkv": list(layout.qkv),
            "w_o": ["self_attn.o_proj.weight"],
            "w_gate_up": list(layout.gate_up),
            "w_down": ["mlp.down_proj.weight"],
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
    def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The shape each weight of `weight_groups` must have for this config."""
        H, D, I = config.hidden_size, config.head_dim, config.intermediate_size
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * D
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
            "w_gate_up": (2 * I, H),
            "w_down": (H, I),
        }

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """x: [B, T, H] at positions start..start+T-1 -> [B, T, H].

        cos, sin: [T, R] of this layer's rotary (R < D: partial), or None for a layer without one.
        k_cache, v_cache: [B, H_kv, capacity, D], rows [0, start) already hold this layer's
        keys/values for earlier positions; this writes rows [start, start+T).
        """
        attended = self._attention(self._norm(x, self.input_norm), cos, sin, k_cache, v_cache, start)
        x = x + self._norm(attended, self.attn_out_norm)
        return x + self._norm(self._mlp(self._norm(x, self.post_norm)), self.mlp_out_norm)

    def _norm(self, x, weight):
        return x if weight is None else rms_norm(x, weight, self.eps)

    def _attention(self, h, cos, sin, k_cache, v_cache, start):
        B, T, _ = h.shape
        D, n_kv = self.head_dim, self.kv_heads
        qkv = linear(h, self.w_qkv, self.b_qkv)  # [B, T, (H_q + 2 H_kv) * D]
        q, k, v = qkv.split([self.heads * D, n_kv * D, n_kv * D], dim=-1)
        if self.qk_norm == "projection":  # OLMo 2: over all heads at once, before the split
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = q.view(B, T, self.heads, D)
        k = k.view(B, T, n_kv, D)
        if self.qk_norm == "head":
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = q.transpose(1, 2)  # [B, H_q, T, D]
        k = k.transpose(1, 2)  # [B, H_kv, T, D]
        if cos is not None:
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache[:, :, start : start + T] = k
        v_cache[:, :, start : start + T] = v.view(B, T, n_kv, D).transpose(1, 2)

        # A sliding window only narrows what is read: the cache keeps every position of every
        # layer, local (Gemma 3, EXAONE 4, Mistral, Phi-3) or global (as Cake's full-attention
        # layers do), so a window layer costs the same memory as a full one; its reads stop at
        # the window. SDPA's kernels (CPU flash, CUDA flash / memory-efficient; math only unless
        # allow_fp16_bf16_reduction_math_sdp is switched on) keep the softmax max, sum and P@V
        # accumulator in f32 for f16/bf16 inputs; tests/model/test_block.py checks it.
        out = attention.attend(q, k_cache, v_cache, start, self.window, self.scale)  # [B, H_q, T, D]
        out = out.reshape(B, self.heads, T, D).transpose(1, 2).reshape(B, T, self.heads * D)
        return linear(out, self.w_o, self.b_o)

    def _mlp(self, h):
        gate, up = linear(h, self.w_gate_up).chunk(2, dim=-1)  # [B, T, I] each
        return linear(self.activation(gate) * up, self.w_down)


def plus_one(weight: torch.Tensor) -> torch.Tensor:
    """A (1 + w) norm's stored w -> the f32 weight rms_norm multiplies by (Gemma's checkpoints
    store the offset from 1). Kept in f32 as transformers keeps it: rounded to bf16, 1 + w
    would lose the low bits of w."""
    return weight.float() + 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim (torch's rms_norm computes in f32 for f16/bf16 inputs).

    An f32 weight on f16/bf16 x (a folded (1 + w)) scales in f32 and rounds once at the end,
    as transformers' Gemma norm does.
    """
    if weight.dtype != x.dtype:
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)
