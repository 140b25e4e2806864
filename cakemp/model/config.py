"""What a worker needs to know about a checkpoint, read once from its config.json.

Four families share one decoder block and differ only in a few switches:

| family  | architectures[0]    | q/k/v bias | per-head q/k norm | sliding window        |
|---------|---------------------|------------|-------------------|-----------------------|
| llama   | LlamaForCausalLM    | attention_bias (o too) | no    | never                 |
| qwen2   | Qwen2ForCausalLM    | always (not o) | no            | per layer_types       |
| qwen3   | Qwen3ForCausalLM    | attention_bias (o too) | yes   | per layer_types       |
| mistral | MistralForCausalLM  | no         | no                | every layer           |
| qwen3_moe | Qwen3MoeForCausalLM | attention_bias (o too) | yes | per layer_types       |

Qwen3.5 (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`) is a
hybrid: its text model sits in `text_config` beside a vision tower's config, its layers
under `model.language_model.layers`, and each layer is either Gated DeltaNet (linear
attention, `cakemp/model/deltanet.py`) or gated full attention; see `_hybrid_fields`.
MoE families (Qwen3-MoE, Qwen3.5-MoE) carry a `MoeConfig` (`cakemp/model/moe.py`).

Anything else is a CheckpointError: Cake silently runs unknown architectures as Llama and
computes garbage; a worker should refuse instead.

Both config.json dialects are read: transformers < 5 writes `rope_theta` and `rope_scaling`
at the top level (what published checkpoints carry), transformers 5 writes `rope_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cakemp.errors import CheckpointError

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
# Families whose config.json wraps the text model's keys in `text_config`.
_WRAPPED = ("qwen3_5", "qwen3_5_moe")

# transformers' defaults for keys a config.json may leave out.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """`rope_type: llama3` frequency rescaling (Llama 3.1+); other rope types are refused."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet (Qwen3.5's linear-attention layers): head counts and sizes, conv kernel."""

    key_heads: int
    key_head_dim: int
    value_heads: int  # a multiple of key_heads: each key head serves value_heads // key_heads value heads
    value_head_dim: int
    conv_kernel: int  # the causal depthwise convolution's width K; K - 1 inputs are kept per session

    @property
    def conv_channels(self) -> int:
        """q, k and v go through the convolution together: 2 * H_k * D_k + H_v * D_v channels."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: a router over `experts`, `top_k` of them per token, optionally a shared expert."""

    experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights divided by their sum (norm_topk_prob; Qwen3.5 always)
    shared_intermediate_size: int = 0  # 0: no shared expert
    # Per layer: sparse (True) or the family's dense MLP (Qwen3-MoE's mlp_only_layers, decoder_sparse_step).
    sparse_layers: tuple[bool, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    family: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    # Per layer: attend to at most this many latest positions (the query's own included), or None.
    layer_windows: tuple[int | None, ...]
    # FP8 checkpoints: (rows, cols) of one weight_scale_inv block; None when not quantized.
    fp8_block: tuple[int, int] | None
    layer_prefix: str = "model.layers"
    # Rotary covers the first int(head_dim * partial_rotary_factor) dims of each head; the rest pass through.
    partial_rotary_factor: float = 1.0
    # Norm weights stored as w - 1 (the norm multiplies by 1 + w); folded at load, see Checkpoint.load.
    norm_plus_one: bool = False
    # q_proj gives [q | gate] per head and the attention output is multiplied by sigmoid(gate) (Qwen3.5).
    attention_output_gate: bool = False
    # Indices of the linear-attention (Gated DeltaNet) layers, and their shape; every other layer attends.
    linear_layers: frozenset[int] = frozenset()
    linear_attention: LinearAttentionConfig | None = None
    moe: MoeConfig | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is not readable JSON: {exc}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architectures = d.get("architectures") or []
        architecture = architectures[0] if architectures else None
        family = FAMILIES.get(architecture)
        if family is None:
            supported = ", ".join(FAMILIES)
            raise CheckpointError(
                f"{source}: architecture {architecture!r} is not supported by cakemp (supported: {supported})"
            )
        try:
            if family in _WRAPPED:
                return cls._parse_hybrid(d, family, architecture)
            return cls._parse(d, family, architecture)
        except KeyError as exc:
            raise CheckpointError(f"{source}: {architecture} config lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: bad {architecture} config: {exc}") from None

    @classmethod
    def _parse(cls, d: dict[str, Any], family: str, architecture: str) -> ModelConfig:
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads are not a multiple of {kv_heads} key/value heads")
        layers = int(d["num_hidden_layers"])
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA)))
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        attention_bias = family in ("llama", "qwen3", "qwen3_moe") and bool(d.get("attention_bias", False))
        return cls(
            family=family,
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", _DEFAULT_RMS_EPS)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(rope),
            max_position_embeddings=int(d["max_position_embeddings"]),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            layer_windows=_layer_windows(d, family, layers),
            fp8_block=_fp8_block(d),
            moe=_moe(d, family, layers),
        )

    @classmethod
    def _parse_hybrid(cls, d: dict[str, Any], family: str, architecture: str) -> ModelConfig:
        """Qwen3.5 / Qwen3.5-MoE: the text model's keys from `text_config` (a quantization_config
        may sit at either level); rope settings from `rope_parameters` or the classic keys."""
        text = dict(d["text_config"])
        text.setdefault("quantization_config", d.get("quantization_config"))
        text.setdefault("intermediate_size", 0)  # Qwen3.5-MoE has no dense MLP
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        # mrope_section only matters for image/video positions; text positions are equal on its axes.
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"rope type {kind!r} is not supported for {architecture} (only default)")
        text["rope_parameters"] = {"rope_theta": float(rope.get("rope_theta", text.get("rope_theta", _DEFAULT_ROPE_THETA)))}
        base = cls._parse({**text, "use_sliding_window": False}, family, architecture)
        factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        layers = base.num_hidden_layers
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else "linear_attention"
            for i in range(layers)
        ]
        if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must name linear_attention or full_attention for each of {layers} layers")
        linear = LinearAttentionConfig(
            key_heads=int(text["linear_num_key_heads"]),
            key_head_dim=int(text["linear_key_head_dim"]),
            value_heads=int(text["linear_num_value_heads"]),
            value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        )
        if linear.value_heads % linear.key_heads:
            raise ValueError(f"{linear.value_heads} linear value heads are not a multiple of {linear.key_heads} key heads")
        return replace(
            base,
            layer_prefix="model.language_model.layers",
            partial_rotary_factor=factor,
            norm_plus_one=True,
            attention_output_gate=True,
            qk_norm=True,
            qkv_bias=False,
            o_bias=False,
            linear_layers=frozenset(i for i, t in enumerate(types) if t == "linear_attention"),
            linear_attention=linear,
        )

    def layer_name(self, index: int) -> str:
        return f"{self.layer_prefix}.{index}"

    def layer_index(self, name: str) -> int | None:
        """`model.layers.7` -> 7; None when the name is not one of this model's layers."""
        head, _, tail = name.rpartition(".")
        if head != self.layer_prefix or not tail.isdigit() or int(tail) >= self.num_hidden_layers:
            return None
        return int(tail)


def _rope_scaling(rope: dict[str, Any]) -> Llama3RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not supported (only default and llama3)")
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _layer_windows(d: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    window = d.get("sliding_window")
    if family == "llama" or window is None:
        return (None,) * layers
    if family == "mistral":
        return (int(window),) * layers
    # Qwen2/3: the window applies only when enabled, to the layers marked sliding.
    if not d.get("use_sliding_window", False):
        return (None,) * layers
    types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention" for i in range(layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _moe(d: dict[str, Any], family: str, layers: int) -> MoeConfig | None:
    if family not in ("qwen3_moe", "qwen3_5_moe"):
        return None
    # Hub configs name the count num_experts; transformers 5 writes num_local_experts.
    experts = int(d.get("num_experts") or d["num_local_experts"])
    top_k = int(d["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not in 1..{experts}")
    if family == "qwen3_5_moe":
        return MoeConfig(experts, top_k, int(d["moe_intermediate_size"]), True,
                         int(d["shared_expert_intermediate_size"]), (True,) * layers)
    dense = set(d.get("mlp_only_layers") or ())
    step = int(d.get("decoder_sparse_step", 1))
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoeConfig(experts, top_k, int(d["moe_intermediate_size"]), bool(d.get("norm_topk_prob", False)),
                     sparse_layers=sparse)


def _fp8_block(d: dict[str, Any]) -> tuple[int, int] | None:
    quant = d.get("quantization_config") or (d.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise ValueError(f"quantization {quant.get('quant_method')!r} is not supported (only fp8)")
    rows, cols = quant.get("weight_block_size") or _DEFAULT_FP8_BLOCK
    return int(rows), int(cols)
