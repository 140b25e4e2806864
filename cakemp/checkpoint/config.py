"""What a worker needs to know about a checkpoint, read once from its config.json.

These families share one decoder block and differ only in switches, one `Family` row each in
FAMILIES (norm placement: layout.py):

| family  | architectures[0]    | q/k/v bias | q/k norm          | sliding window        | rotary per layer        |
|---------|---------------------|------------|-------------------|-----------------------|-------------------------|
| llama   | LlamaForCausalLM    | attention_bias (o too) | no    | never                 | rope_theta (+ llama3)   |
| qwen2   | Qwen2ForCausalLM    | always (not o) | no            | per layer_types       | rope_theta              |
| qwen3   | Qwen3ForCausalLM    | attention_bias (o too) | per head | per layer_types    | rope_theta              |
| mistral | MistralForCausalLM  | no         | no                | every layer           | rope_theta              |
| gemma3  | Gemma3ForCausalLM   | attention_bias (o too) | per head, (1 + w) | sliding layers | global: rope_theta (+ linear); local: rope_local_base_freq |
| phi3    | Phi3ForCausalLM     | no         | no                | every layer           | partial, longrope       |
| olmo2   | Olmo2ForCausalLM    | attention_bias (o too) | whole projection | never      | rope_theta              |
| exaone4 | Exaone4ForCausalLM  | no         | per head          | sliding layers        | sliding layers only (all when no window) |
| qwen3_moe | Qwen3MoeForCausalLM | attention_bias (o too) | per head | per layer_types  | rope_theta              |
| vibevoice | VibeVoiceForConditionalGeneration | always (not o) | no | never             | rope_theta              |
| vibevoice_streaming | VibeVoiceStreamingForConditionalGenerationInference | always (not o) | no | never | rope_theta |

Falcon 3 checkpoints declare LlamaForCausalLM (own rope_theta, explicit head_dim) and are Llama
here. Phi-4 and Phi-4-mini checkpoints declare Phi3ForCausalLM.

Qwen3.5 (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`) is a
hybrid: its text model sits in `text_config` beside a vision tower's config, its layers
under `model.language_model.layers`, and each layer is either Gated DeltaNet (linear
attention, `cakemp/model/deltanet.py`) or gated full attention (partial rotary, (1 + w)
norms); see `_parse_hybrid`. MoE families (Qwen3-MoE, Qwen3.5-MoE) carry a `MoeConfig`
(`cakemp/model/moe.py`).

VibeVoice (`--model-type audio-model`, `Family.model_type`) is Qwen2 blocks read from config.json's
`decoder_config` as Cake's worker reads it (`_DECODER_KEYS`), under `model.language_model.layers`
(1.5B) or, for the Realtime 0.5B, that and `model.tts_language_model.layers`: two stacks, each
numbering its layers and the master's block_idx from 0 (`ModelConfig.stacks`, `kv_slot`).

Anything else is a CheckpointError: Cake silently runs unknown architectures as Llama and
computes garbage; a worker should refuse instead.

Both config.json dialects are read: transformers < 5 writes `rope_theta` and `rope_scaling`
at the top level (what published checkpoints carry), transformers 5 writes `rope_parameters`.

A config.json may come from a peer (a zero-config push), so every number the model code
divides by, indexes with or allocates from is checked here, and anything else that goes wrong
is a CheckpointError too: counts and sizes are whole numbers within generous bounds (the MAX_
constants), head counts divide as attention needs, a rotary dimension is even and within a
head, per-layer lists name every layer, and every float is finite (most positive).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cakemp.checkpoint import quantization
from cakemp.checkpoint.files import CONFIG, container_of, layer_prefix, split_layer, stored_names
from cakemp.checkpoint.gguf import GgufFile
from cakemp.checkpoint.gguf_model import hf_config
from cakemp.checkpoint.layout import GEMMA3, PHI3, POST_NORM, PRE_NORM, QWEN3_5, BlockLayout
from cakemp.checkpoint.stored import Quantization
from cakemp.checkpoint.values import as_list, mapping, real, shown, whole
from cakemp.errors import CheckpointError


@dataclass(frozen=True)
class Family:
    """One text family's switches: what reading its config.json (and embedding its tokens) does
    differently from Llama's defaults. A family that reuses existing switches is one row of FAMILIES."""

    name: str  # ModelConfig.family
    architecture: str  # config.json's architectures[0]
    layout: BlockLayout = PRE_NORM  # where the block's norms sit and what its weights are called
    # Qwen3.5: the text model's keys inside `text_config`, Gated DeltaNet layers among the attending ones.
    hybrid: bool = False
    attention_bias: bool = False  # config.json's attention_bias biases q, k, v and o
    qkv_bias: bool = False  # q, k and v always biased, o never (Qwen2)
    qk_norm: str | None = None  # "head" (q_norm/k_norm [D] per head) or "projection" ([H_q * D], all heads)
    activation_key: str = "hidden_act"  # the key naming the MLP gate's activation
    activation: str = "silu"  # the activation when that key is absent
    tied: bool = False  # tie_word_embeddings when config.json leaves it out
    query_pre_attn_scalar: bool = False  # scores scaled by query_pre_attn_scalar ** -0.5 (default 256)
    embed_scale: bool = False  # the embeddings multiplied by sqrt(hidden_size)
    longrope_aliases: bool = False  # rope types "su" and "yarn" mean longrope (older Phi-3 configs)
    # Which layers a sliding window applies to: "never", "every" layer, "enabled" (use_sliding_window,
    # then layer_types or max_window_layers mark the sliding ones) or "typed" (the layer types below).
    windows: str = "enabled"
    default_window: int | None = None  # sliding_window when config.json leaves it out
    # Layer types (sliding or full attention) from layer_types, else sliding_window_pattern, else
    # every global_every-th layer global; None: the family has no layer types.
    global_every: int | None = None
    all_global_unwindowed: bool = False  # sliding_window: null makes every layer global
    # Which rotary a layer gets: "uniform" (the main one everywhere), "local_base" (sliding layers
    # their own unscaled base, rope_local_base_freq; the main one keyed by layer type in transformers
    # 5) or "sliding_only" (with a window configured, global layers rotate nothing).
    rotary: str = "uniform"
    # None, "routed" (router and experts; dense layers by mlp_only_layers and decoder_sparse_step;
    # norm_topk_prob) or "shared_expert" (every layer sparse, always renormalised, a shared expert).
    moe: str | None = None
    # The --model-type a node serving the family runs with (Cake's worker modes): "text-model", or
    # "audio-model" for VibeVoice's language models.
    model_type: str = "text-model"
    # VibeVoice: config.json's key holding the decoder's own config (`decoder_config`), read as Cake
    # reads it (_DECODER_KEYS); None: the decoder's keys are config.json's own.
    decoder_key: str | None = None
    # With decoder_key: each stack of decoder layers as (its layer prefix, the config.json key of its
    # layer count; None: the decoder's num_hidden_layers less the other stacks'), in the order their
    # layers are numbered (ModelConfig.stacks).
    stacks: tuple[tuple[str, str | None], ...] = ()


# VibeVoice's stacks: the 1.5B's one language model; the Realtime 0.5B's base language model and, on
# top of it, its TTS language model (tts_backbone_num_hidden_layers of the decoder's layers).
_LANGUAGE_MODEL = ("model.language_model.layers", None)
_TTS_LANGUAGE_MODEL = ("model.tts_language_model.layers", "tts_backbone_num_hidden_layers")

FAMILIES = {family.name: family for family in (
    Family("llama", "LlamaForCausalLM", attention_bias=True, windows="never"),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", attention_bias=True, qk_norm="head"),
    Family("mistral", "MistralForCausalLM", windows="every"),
    Family("gemma3", "Gemma3ForCausalLM", GEMMA3, attention_bias=True, qk_norm="head",
           activation_key="hidden_activation", activation="gelu_pytorch_tanh", tied=True, query_pre_attn_scalar=True,
           embed_scale=True, windows="typed", default_window=4096, global_every=6, rotary="local_base"),
    Family("phi3", "Phi3ForCausalLM", PHI3, windows="every", longrope_aliases=True),
    Family("olmo2", "Olmo2ForCausalLM", POST_NORM, attention_bias=True, qk_norm="projection", windows="never"),
    Family("exaone4", "Exaone4ForCausalLM", POST_NORM, qk_norm="head", windows="typed", default_window=4096,
           global_every=4, all_global_unwindowed=True, rotary="sliding_only"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", attention_bias=True, qk_norm="head", moe="routed"),
    Family("qwen3_5", "Qwen3_5ForConditionalGeneration", QWEN3_5, hybrid=True, qk_norm="head"),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", QWEN3_5, hybrid=True, qk_norm="head",
           moe="shared_expert"),
    Family("vibevoice", "VibeVoiceForConditionalGeneration", qkv_bias=True, windows="never", model_type="audio-model",
           decoder_key="decoder_config", stacks=(_LANGUAGE_MODEL,)),
    Family("vibevoice_streaming", "VibeVoiceStreamingForConditionalGenerationInference", qkv_bias=True,
           windows="never", model_type="audio-model", decoder_key="decoder_config",
           stacks=(_LANGUAGE_MODEL, _TTS_LANGUAGE_MODEL)),
)}
# What Cake's worker reads of a VibeVoice decoder_config (models/vibevoice/config.rs): the sizes,
# the norm epsilon and rope_theta; q/k/v bias is forced, head_dim is hidden_size / heads, and no
# sliding window, rope scaling or activation other than SiLU applies, whatever the config says.
_DECODER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                 "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                 "tie_word_embeddings")
# The MLP activations served, by their transformers name (Gemma calls the key hidden_activation).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# Bounds far past any published model's, so that no count can make the model code allocate
# without limit (a tuple per layer, a name per expert) before a weight's shape is checked.
MAX_WIDTH = 1 << 20  # hidden and intermediate sizes
MAX_HEADS = 1 << 12  # attention heads, linear-attention heads
MAX_HEAD_DIM = 1 << 12
MAX_LAYERS = 1 << 14
MAX_POSITIONS = 1 << 30  # context lengths, sliding windows
MAX_EXPERTS = 1 << 12
MAX_CONV_KERNEL = 1 << 10

# transformers' defaults for keys a config.json may leave out.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6


@dataclass(frozen=True)
class Llama3RopeScaling:
    """`rope_type: llama3` frequency rescaling (Llama 3.1+, EXAONE 4)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """`rope_type: linear`: every frequency divided by `factor` (Gemma 3 4B+ global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRopeScaling:
    """`rope_type: longrope` (Phi-3/Phi-4, "su" in older configs): frequency i divided by
    short_factor[i], or by long_factor[i] once a request reaches past the original context;
    cos and sin multiplied by attention_factor at every position."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling | LongRopeScaling


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its base, how many leading dims of a head it rotates, its scaling."""

    theta: float
    dim: int
    scaling: RopeScaling | None = None


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
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    # None, "head" (q_norm/k_norm [D] per head) or "projection" (OLMo 2: [H_q * D] over all heads).
    qk_norm: str | None
    # Per layer: attend to at most this many latest positions (the query's own included), or None.
    layer_windows: tuple[int | None, ...]
    # Per layer: the rotary embedding its q and k get, or None for a layer without one (EXAONE 4's
    # global layers).
    layer_ropes: tuple[Rope | None, ...]
    # Scores are q.k * attention_scale: 1/sqrt(head_dim), Gemma 3 1/sqrt(query_pre_attn_scalar).
    attention_scale: float
    activation: str  # "silu" or "gelu_tanh", the MLP gate's
    layout: BlockLayout
    tie_word_embeddings: bool
    # How the checkpoint's weights are quantized (checkpoint/quantization.py); None: plain.
    quantization: Quantization | None
    layer_prefix: str = "model.layers"
    # q_proj gives [q | gate] per head and the attention output is multiplied by sigmoid(gate) (Qwen3.5).
    attention_output_gate: bool = False
    # Indices of the linear-attention (Gated DeltaNet) layers, and their shape; every other layer attends.
    linear_layers: frozenset[int] = frozenset()
    linear_attention: LinearAttentionConfig | None = None
    moe: MoeConfig | None = None
    # The decoder stacks after the first (whose layers are under layer_prefix), each (its prefix, its
    # layer count), their layers numbered on after the first's (VibeVoice-Realtime's TTS language model
    # after its base one); num_hidden_layers counts every stack's.
    extra_stacks: tuple[tuple[str, int], ...] = ()
    # The --dtype Cake's worker computes this model in whatever it was told; None: as told
    # (VibeVoice: bf16 where decoder_config's torch_dtype is bfloat16).
    declared_dtype: str | None = None

    @classmethod
    def from_gguf(cls, gguf: GgufFile) -> ModelConfig:
        """The config of a parsed GGUF file, from its metadata."""
        return cls.from_dict(hf_config(gguf), source=str(gguf.path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """The config of the checkpoint `--model` names: a directory's config.json, or a GGUF file's metadata."""
        if (read := container_of(model_dir).hf_config) is not None:
            return cls.from_dict(read(Path(model_dir)), source=str(Path(model_dir)))
        path = Path(model_dir) / CONFIG
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist") from None
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{path} is not readable JSON: {exc}") from None
        config = cls.from_dict(raw, source=str(path))
        if config.extra_stacks:  # each stack's prefix is the family's: none is detected from the tensors
            return config
        # The layers' prefix as the tensors are named (mlx-lm's conversions differ from the family's).
        return replace(config, layer_prefix=layer_prefix(stored_names(Path(model_dir)), config.layer_prefix))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """The config `d` (a parsed config.json) describes; CheckpointError, whatever is wrong with it."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: not a JSON object but {type(d).__name__}")
        architectures = d.get("architectures")
        architecture = architectures[0] if isinstance(architectures, list) and architectures else architectures
        family = next((f for f in FAMILIES.values() if f.architecture == architecture), None)
        if family is None:
            supported = ", ".join(f.architecture for f in FAMILIES.values())
            raise CheckpointError(
                f"{source}: architecture {shown(architecture)} is not supported by cakemp (supported: {supported})"
            )
        try:
            parse = cls._parse_hybrid if family.hybrid else cls._parse_decoder if family.decoder_key else cls._parse
            config = parse(d, family)
            _check_shapes(config)
            return config
        except KeyError as exc:
            raise CheckpointError(f"{source}: {architecture} config lacks {shown(exc.args[0])}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: bad {architecture} config: {exc}") from None
        except Exception as exc:  # whatever else a hostile config.json provokes: still the file's fault
            raise CheckpointError(f"{source}: bad {architecture} config: {type(exc).__name__}: {exc}") from None

    @classmethod
    def _parse(cls, d: dict[str, Any], family: Family) -> ModelConfig:
        hidden = whole("hidden_size", d["hidden_size"], 1, MAX_WIDTH)
        heads = whole("num_attention_heads", d["num_attention_heads"], 1, MAX_HEADS)
        kv_heads = whole("num_key_value_heads", d.get("num_key_value_heads") or heads, 1, heads)
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads are not a multiple of {kv_heads} key/value heads")
        layers = whole("num_hidden_layers", d["num_hidden_layers"], 1, MAX_LAYERS)
        head_dim = whole("head_dim", d.get("head_dim") or hidden // heads, 1, MAX_HEAD_DIM)
        rope = mapping("rope_parameters", d.get("rope_parameters") or mapping("rope_scaling", d.get("rope_scaling")))
        if family.rotary == "local_base":
            rope = _global_rope_by_type(d)
        rope_theta = real("rope_theta", rope.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA)))
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        activation = d.get(family.activation_key) or family.activation
        if activation not in ACTIVATIONS:
            raise ValueError(f"{family.activation_key} {shown(activation)} is not supported (only {', '.join(ACTIVATIONS)})")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
        attention_bias = family.attention_bias and bool(d.get("attention_bias", False))
        partial = real("partial_rotary_factor", rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * partial)
        main_rope = Rope(rope_theta, rotary_dim, _rope_scaling(rope, d, family, rotary_dim))
        types = _layer_types(d, family, layers)
        windows = _layer_windows(d, family, layers, types)
        return cls(
            family=family.name,
            architecture=family.architecture,
            hidden_size=hidden,
            intermediate_size=whole("intermediate_size", d["intermediate_size"], 0, MAX_WIDTH),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=real("rms_norm_eps", d.get("rms_norm_eps", _DEFAULT_RMS_EPS), zero=True),
            rope_theta=rope_theta,
            rope_scaling=main_rope.scaling,
            max_position_embeddings=whole("max_position_embeddings", d["max_position_embeddings"], 1, MAX_POSITIONS),
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=family.qk_norm,
            layer_windows=windows,
            layer_ropes=_layer_ropes(d, family, main_rope, types, windows),
            attention_scale=real("query_pre_attn_scalar", d.get("query_pre_attn_scalar", 256) if family.query_pre_attn_scalar
                                  else head_dim) ** -0.5,
            activation=ACTIVATIONS[activation],
            layout=family.layout,
            # Gemma 3's hub configs leave the key out and mean True (transformers' default for it).
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family.tied)),
            quantization=_quantization(d),
            moe=_moe(d, family, layers),
        )

    @classmethod
    def _parse_hybrid(cls, d: dict[str, Any], family: Family) -> ModelConfig:
        """Qwen3.5 / Qwen3.5-MoE: the text model's keys from `text_config` (a quantization_config
        may sit at either level); rope settings from `rope_parameters` or the classic keys."""
        text = dict(mapping("text_config", d["text_config"]))
        text.setdefault("quantization_config", d.get("quantization_config"))
        text.setdefault("quantization", d.get("quantization"))  # MLX's own key
        text.setdefault("intermediate_size", 0)  # Qwen3.5-MoE has no dense MLP
        rope = mapping("rope_parameters", text.get("rope_parameters") or mapping("rope_scaling", text.get("rope_scaling")))
        # mrope_section only matters for image/video positions; text positions are equal on its axes.
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"rope type {shown(kind)} is not supported for {family.architecture} (only default)")
        text["rope_parameters"] = {
            "rope_theta": rope.get("rope_theta", text.get("rope_theta", _DEFAULT_ROPE_THETA)),
            "partial_rotary_factor": rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
        }
        if "tie_word_embeddings" in d:  # the outer config's word wins, as transformers reads it
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        base = cls._parse({**text, "use_sliding_window": False}, family)
        layers = base.num_hidden_layers
        interval = whole("full_attention_interval", text.get("full_attention_interval", 4), 1, MAX_LAYERS)
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
        ]
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must name linear_attention or full_attention for each of {layers} layers")
        linear = LinearAttentionConfig(
            key_heads=whole("linear_num_key_heads", text["linear_num_key_heads"], 1, MAX_HEADS),
            key_head_dim=whole("linear_key_head_dim", text["linear_key_head_dim"], 1, MAX_HEAD_DIM),
            value_heads=whole("linear_num_value_heads", text["linear_num_value_heads"], 1, MAX_HEADS),
            value_head_dim=whole("linear_value_head_dim", text["linear_value_head_dim"], 1, MAX_HEAD_DIM),
            conv_kernel=whole("linear_conv_kernel_dim", text.get("linear_conv_kernel_dim", 4), 1, MAX_CONV_KERNEL),
        )
        if linear.value_heads % linear.key_heads:
            raise ValueError(f"{linear.value_heads} linear value heads are not a multiple of {linear.key_heads} key heads")
        return replace(
            base,
            layer_prefix="model.language_model.layers",
            attention_output_gate=True,
            # Linear-attention layers rotate nothing.
            layer_ropes=tuple(None if t == "linear_attention" else rope for t, rope in zip(types, base.layer_ropes)),
            linear_layers=frozenset(i for i, t in enumerate(types) if t == "linear_attention"),
            linear_attention=linear,
        )

    @classmethod
    def _parse_decoder(cls, d: dict[str, Any], family: Family) -> ModelConfig:
        """VibeVoice: the Qwen2 decoder in `family.decoder_key`, read as Cake's worker reads it
        (_DECODER_KEYS; rms_norm_eps and rope_theta required, as there), its layers split into the
        family's stacks. Cake computes in bf16 where the decoder's torch_dtype says bfloat16."""
        decoder = mapping(family.decoder_key, d[family.decoder_key])
        if missing := [key for key in ("rms_norm_eps", "rope_theta") if key not in decoder]:
            raise KeyError(f"{family.decoder_key}.{missing[0]}")
        base = cls._parse({key: decoder[key] for key in _DECODER_KEYS if key in decoder}
                          | {"quantization_config": d.get("quantization_config")}, family)
        layers = base.num_hidden_layers
        extra = tuple((prefix, whole(key, d[key], 1, layers - 1)) for prefix, key in family.stacks[1:])
        if sum(count for _, count in extra) >= layers:
            raise ValueError(f"the stacks after the first take {sum(count for _, count in extra)} of the decoder's "
                             f"{layers} layers, leaving the first none")
        return replace(base, layer_prefix=family.stacks[0][0], extra_stacks=extra,
                       declared_dtype="bf16" if decoder.get("torch_dtype") == "bfloat16" else None)

    @property
    def stacks(self) -> tuple[tuple[str, int, int], ...]:
        """Each decoder stack as (its layer prefix, the number of its first layer here, its layer
        count): one for every family but VibeVoice-Realtime's, whose two stacks each number their
        layers from 0 in their names ("model.tts_language_model.layers.0") and on after the first's here."""
        first_count = self.num_hidden_layers - sum(count for _, count in self.extra_stacks)
        stacks, first = [], 0
        for prefix, count in ((self.layer_prefix, first_count), *self.extra_stacks):
            stacks.append((prefix, first, count))
            first += count
        return tuple(stacks)

    @property
    def model_type(self) -> str:
        """The --model-type a node serving this model runs with: "text-model", or VibeVoice's "audio-model"."""
        return FAMILIES[self.family].model_type

    def layer_name(self, index: int) -> str:
        """7 -> "model.layers.7": the name of this model's layer number `index` (stacks counted in order)."""
        for prefix, first, count in self.stacks[:-1]:
            if index < first + count:
                return f"{prefix}.{index - first}"
        prefix, first, _ = self.stacks[-1]
        return f"{prefix}.{index - first}"

    def layer_index(self, name: str) -> int | None:
        """`model.layers.7` -> 7 (a later stack's layers numbered on after the earlier stacks');
        None when the name is not one of this model's layers."""
        split = split_layer(name)
        if split is None:
            return None
        return next((first + split[1] for prefix, first, count in self.stacks
                     if split[0] == prefix and split[1] < count), None)

    def kv_slot(self, name: str, block_idx: int) -> int:
        """The KV slot a master's `block_idx` for layer `name` means: `block_idx` itself, counted on
        after the earlier stacks' slots for a later stack's layer, so that two stacks whose masters
        both number their blocks from 0 keep their caches apart."""
        split = split_layer(name)
        return block_idx + next((first for prefix, first, _ in self.stacks if split and split[0] == prefix), 0)


def _rope_scaling(rope: dict[str, Any], d: dict[str, Any], family: Family, rotary_dim: int) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if family.longrope_aliases and kind in ("su", "yarn"):
        kind = "longrope"  # older Phi-3 names for it, mapped as transformers maps them
    if kind == "default":
        return None
    if kind == "llama3":
        scaling = Llama3RopeScaling(
            factor=real("rope factor", rope["factor"]),
            low_freq_factor=real("low_freq_factor", rope["low_freq_factor"]),
            high_freq_factor=real("high_freq_factor", rope["high_freq_factor"]),
            original_max_position_embeddings=whole("original_max_position_embeddings",
                                                    rope["original_max_position_embeddings"], 1, MAX_POSITIONS),
        )
        if scaling.low_freq_factor >= scaling.high_freq_factor:  # the ramp divides by their difference
            raise ValueError(f"low_freq_factor {scaling.low_freq_factor} is not below high_freq_factor "
                             f"{scaling.high_freq_factor}")
        return scaling
    if kind == "linear":
        return LinearRopeScaling(real("rope factor", rope["factor"]))
    if kind == "longrope":
        return _longrope(rope, d, rotary_dim)
    raise ValueError(f"rope type {shown(kind)} is not supported (only default, llama3, linear and longrope)")


def _longrope(rope: dict[str, Any], d: dict[str, Any], rotary_dim: int) -> LongRopeScaling:
    """Phi-3 configs keep original_max_position_embeddings at the top level; without `factor` the
    context ratio sets the attention factor, as transformers does."""
    # At least 2: the attention factor divides by its logarithm.
    original = whole("original_max_position_embeddings",
                      rope.get("original_max_position_embeddings") or d["original_max_position_embeddings"], 2, MAX_POSITIONS)
    short, long = (tuple(real(key, f) for f in as_list(key, rope[key])) for key in ("short_factor", "long_factor"))
    if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
        raise ValueError(f"longrope short/long factors need {rotary_dim // 2} entries, got {len(short)} and {len(long)}")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        factor = real("rope factor", rope.get("factor") or int(d["max_position_embeddings"]) / original)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(short, long, original, real("attention_factor", attention_factor))


def _layer_types(d: dict[str, Any], family: Family, layers: int) -> tuple[str, ...] | None:
    """Gemma 3 / EXAONE 4: "sliding_attention" or "full_attention" per layer, from `layer_types`
    or, in configs without it, `sliding_window_pattern` (every pattern-th layer global; EXAONE
    may spell it as a string of L and G, whose last layer is always global). None otherwise."""
    if family.global_every is None:
        return None
    if family.all_global_unwindowed and d.get("sliding_window", family.default_window) is None:
        return ("full_attention",) * layers
    if d.get("layer_types"):
        types = tuple(as_list("layer_types", d["layer_types"]))
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must name sliding_attention or full_attention for each of {layers} layers")
        return types
    pattern = d.get("sliding_window_pattern", family.global_every)
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise ValueError(f"sliding_window_pattern {shown(pattern)} is not a string of L and G")
        global_ = [pattern[i % len(pattern)] == "G" or i == layers - 1 for i in range(layers)]
    else:
        every = whole("sliding_window_pattern", pattern, 1, MAX_LAYERS)
        global_ = [(i + 1) % every == 0 for i in range(layers)]
    return tuple("full_attention" if g else "sliding_attention" for g in global_)


def _layer_windows(
    d: dict[str, Any], family: Family, layers: int, types: tuple[str, ...] | None
) -> tuple[int | None, ...]:
    window = d.get("sliding_window", family.default_window)
    if family.windows == "never" or window is None:
        return (None,) * layers
    window = whole("sliding_window", window, 1, MAX_POSITIONS)
    if family.windows == "every":
        return (window,) * layers
    if family.windows == "enabled":
        # Qwen2/3: the window applies only when enabled, to the layers marked sliding.
        if not d.get("use_sliding_window", False):
            return (None,) * layers
        types = d.get("layer_types") or [
            "sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention" for i in range(layers)
        ]
    return tuple(window if t == "sliding_attention" else None for t in as_list("layer_types", types))


def _global_rope_by_type(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's global rotary: transformers 5 keys it by layer type, hub configs keep rope_theta
    (default 1e6) and rope_scaling (linear on 4B+) at the top level."""
    by_type = mapping("rope_parameters", d.get("rope_parameters")).get("full_attention")
    if by_type is not None:
        return mapping("rope_parameters.full_attention", by_type)
    return {"rope_theta": d.get("rope_theta", 1_000_000.0), **mapping("rope_scaling", d.get("rope_scaling"))}


def _layer_ropes(
    d: dict[str, Any], family: Family, main: Rope, types: tuple[str, ...] | None, windows: tuple[int | None, ...]
) -> tuple[Rope | None, ...]:
    if family.rotary == "local_base":
        # Local layers rotate with their own base (rope_local_base_freq, default 1e4), unscaled.
        by_type = mapping("rope_parameters.sliding_attention",
                           mapping("rope_parameters", d.get("rope_parameters")).get("sliding_attention"))
        local = Rope(real("rope_local_base_freq", by_type.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
                     main.dim)
        return tuple(local if t == "sliding_attention" else main for t in types)
    if family.rotary == "sliding_only" and any(w is not None for w in windows):
        # With a sliding window configured, EXAONE 4's global layers use no rotary at all.
        return tuple(main if t == "sliding_attention" else None for t in types)
    return (main,) * len(windows)


def _moe(d: dict[str, Any], family: Family, layers: int) -> MoeConfig | None:
    if family.moe is None:
        return None
    # Hub configs name the count num_experts; transformers 5 writes num_local_experts.
    experts = whole("num_experts", d.get("num_experts") or d["num_local_experts"], 1, MAX_EXPERTS)
    top_k = whole("num_experts_per_tok", d["num_experts_per_tok"], 1, experts)
    intermediate = whole("moe_intermediate_size", d["moe_intermediate_size"], 1, MAX_WIDTH)
    if family.moe == "shared_expert":
        shared = whole("shared_expert_intermediate_size", d["shared_expert_intermediate_size"], 0, MAX_WIDTH)
        return MoeConfig(experts, top_k, intermediate, True, shared, (True,) * layers)
    dense = set(as_list("mlp_only_layers", d.get("mlp_only_layers") or []))
    step = whole("decoder_sparse_step", d.get("decoder_sparse_step", 1), 1, MAX_LAYERS)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return MoeConfig(experts, top_k, intermediate, bool(d.get("norm_topk_prob", False)), sparse_layers=sparse)


def _quantization(d: dict[str, Any]) -> Quantization | None:
    """What quantization the config declares, at its top level or (Qwen3.5) in its text_config."""
    if d.get("quantization") is None and not d.get("quantization_config"):
        d = mapping("text_config", d.get("text_config"))
    return quantization.parse(d)


def _check_shapes(c: ModelConfig) -> None:
    """What the model code relies on across fields: a per-layer entry for every layer, rotary
    dimensions it can pair up within a head, an intermediate size for every dense MLP."""
    layers = c.num_hidden_layers
    for name, per_layer in (("layer_types", c.layer_windows), ("layer_types", c.layer_ropes)):
        if len(per_layer) != layers:
            raise ValueError(f"{name} names {len(per_layer)} layers, the model has {layers}")
    for rope in {rope for rope in c.layer_ropes if rope is not None}:
        if rope.dim < 2 or rope.dim % 2 or rope.dim > c.head_dim:
            raise ValueError(f"the rotary dimension {rope.dim} (head_dim {c.head_dim} x partial_rotary_factor) "
                             "is not an even number in 2..head_dim")
        real("rope_theta", rope.theta)
    if (c.moe is None or not all(c.moe.sparse_layers)) and c.intermediate_size < 1:
        raise ValueError(f"intermediate_size {c.intermediate_size}: a dense MLP layer needs one of at least 1")
