"""What a worker needs to know about a checkpoint, read once from its config.json.

Four families share one decoder block and differ only in a few switches:

| family  | architectures[0]    | q/k/v bias | per-head q/k norm | sliding window        |
|---------|---------------------|------------|-------------------|-----------------------|
| llama   | LlamaForCausalLM    | attention_bias (o too) | no    | never                 |
| qwen2   | Qwen2ForCausalLM    | always (not o) | no            | per layer_types       |
| qwen3   | Qwen3ForCausalLM    | attention_bias (o too) | yes   | per layer_types       |
| mistral | MistralForCausalLM  | no         | no                | every layer           |

Anything else is a CheckpointError: Cake silently runs unknown architectures as Llama and
computes garbage; a worker should refuse instead.

Both config.json dialects are read: transformers < 5 writes `rope_theta` and `rope_scaling`
at the top level (what published checkpoints carry), transformers 5 writes `rope_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cakemp.errors import CheckpointError

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}

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
        attention_bias = family in ("llama", "qwen3") and bool(d.get("attention_bias", False))
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
            qk_norm=family == "qwen3",
            layer_windows=_layer_windows(d, family, layers),
            fp8_block=_fp8_block(d),
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


def _fp8_block(d: dict[str, Any]) -> tuple[int, int] | None:
    quant = d.get("quantization_config") or (d.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        raise ValueError(f"quantization {quant.get('quant_method')!r} is not supported (only fp8)")
    rows, cols = quant.get("weight_block_size") or _DEFAULT_FP8_BLOCK
    return int(rows), int(cols)
