"""Where a family's decoder block puts its RMSNorms, and what its checkpoint calls its weights.

Every family served here runs the same two residual steps,

    x = x + out_norm_a(attention(in_norm_a(x)))
    x = x + out_norm_m(mlp(in_norm_m(x)))

with some of the four norms absent:

| family                    | before attention  | after attention          | before MLP                 | after MLP                  |
|---------------------------|-------------------|--------------------------|----------------------------|----------------------------|
| Llama, Qwen, Mistral, Phi | input_layernorm   | -                        | post_attention_layernorm   | -                          |
| Gemma 3                   | input_layernorm   | post_attention_layernorm | pre_feedforward_layernorm  | post_feedforward_layernorm |
| OLMo 2, EXAONE 4          | -                 | post_attention_layernorm | -                          | post_feedforward_layernorm |

The "after" norms apply to the branch's output before the residual add (HF's Gemma3, Olmo2
and Exaone4 decoder layers), so the residual stream itself is never normalised there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockLayout:
    # Block weight slot -> checkpoint tensor (relative to `model.layers.N.`) for each norm present;
    # slots: input_norm (before attention), attn_out_norm, post_norm (before the MLP), mlp_out_norm.
    norms: tuple[tuple[str, str], ...]
    # Checkpoint tensors stacked into the fused q/k/v and gate/up weights, in that order.
    qkv: tuple[str, ...]
    gate_up: tuple[str, ...]
    # Gemma 3 and Qwen3.5 store every RMSNorm weight as w for a (1 + w) scale; Checkpoint.load
    # adds the 1 in f32.
    norm_plus_one: bool = False


# A Gated DeltaNet layer's depthwise convolution: [C, 1, K] in HF checkpoints, [C, K, 1] in MLX's.
LINEAR_CONV = "linear_attn.conv1d.weight"
SEPARATE_QKV = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
SEPARATE_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")

PRE_NORM = BlockLayout(
    norms=(("input_norm", "input_layernorm.weight"), ("post_norm", "post_attention_layernorm.weight")),
    qkv=SEPARATE_QKV,
    gate_up=SEPARATE_GATE_UP,
)
# Phi-3 / Phi-4 checkpoints store q/k/v and gate/up already fused, in the order the block wants.
PHI3 = BlockLayout(norms=PRE_NORM.norms, qkv=("self_attn.qkv_proj.weight",), gate_up=("mlp.gate_up_proj.weight",))
GEMMA3 = BlockLayout(
    norms=(
        ("input_norm", "input_layernorm.weight"),
        ("attn_out_norm", "post_attention_layernorm.weight"),
        ("post_norm", "pre_feedforward_layernorm.weight"),
        ("mlp_out_norm", "post_feedforward_layernorm.weight"),
    ),
    qkv=SEPARATE_QKV,
    gate_up=SEPARATE_GATE_UP,
    norm_plus_one=True,
)
# Qwen3.5 (dense and MoE): pre-norm, (1 + w) norms (its linear-attention layers' too).
QWEN3_5 = BlockLayout(norms=PRE_NORM.norms, qkv=SEPARATE_QKV, gate_up=SEPARATE_GATE_UP, norm_plus_one=True)
POST_NORM = BlockLayout(
    norms=(("attn_out_norm", "post_attention_layernorm.weight"), ("mlp_out_norm", "post_feedforward_layernorm.weight")),
    qkv=SEPARATE_QKV,
    gate_up=SEPARATE_GATE_UP,
)
