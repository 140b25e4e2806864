"""Tiny random-weight Hugging Face checkpoints, and HF's own decoder layers as the oracle.

    path = make_checkpoint(tmp_path, "qwen3", num_hidden_layers=6, shards=3)
    ref = HFLayers(path, [2, 3], torch.float32)    # HF's decoder layers 2 and 3 with a DynamicCache
    y = ref(x, index_pos)                          # x: [1, T, H]; positions continue the cache

A checkpoint is what `save_pretrained` would give for the family's *ForCausalLM (config.json
written by the installed transformers, tensors under their HF names), with every parameter
drawn at random: HF's init leaves norms at 1 and biases at 0, which would hide a missing norm
weight or bias. `shards > 1` splits the layers over that many files with a
model.safetensors.index.json; `fp8_block=(bm, bn)` stores the layers' projection matrices as
float8_e4m3fn with block-wise `weight_scale_inv`, as FP8 checkpoints do.
`make_vibevoice_checkpoint` writes a VibeVoice-shaped one (Qwen2 stacks under config.json's
`decoder_config`) with a plain Qwen2 checkpoint per stack for HFLayers.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, "LlamaForCausalLM"),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "Qwen2ForCausalLM"),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "Qwen3ForCausalLM"),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, "MistralForCausalLM"),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM"),
    "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration,
                "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration,
                    "Qwen3_5MoeForConditionalGeneration"),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, "Gemma3ForCausalLM"),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, "Phi3ForCausalLM"),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, "Olmo2ForCausalLM"),
    "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, "Exaone4ForCausalLM"),
}
# Families whose checkpoints store every RMSNorm weight (but Qwen3.5's gated norm) as w for a (1 + w) scale.
PLUS_ONE_NORMS = {"gemma3", "qwen3_5", "qwen3_5_moe"}
# Families whose hub config.json nests the text model in `text_config` beside a vision tower's.
WRAPPED = ("qwen3_5", "qwen3_5_moe")
# The text sizes those add to TINY: 2 linear key heads serving 4 value heads; gated attention
# heads of 16 (a quarter rotated); MoE with 8 experts, 2 per token.
HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

# Small enough for a test to build and run in milliseconds, big enough for GQA (4 query heads
# on 2 kv heads) and several layers.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A hub_config value meaning "the key is left out" (the family's default applies).
OMIT = "<omitted>"


def make_config(family: str, **overrides) -> transformers.PreTrainedConfig:
    config_class, _, architecture = FAMILIES[family]
    if family in WRAPPED:
        extra = {**HYBRID, **(MOE if family == "qwen3_5_moe" else {})}
        if family == "qwen3_5_moe":
            extra["shared_expert_intermediate_size"] = 48
        config = config_class(text_config={**TINY, **extra, **overrides}, vision_config=TINY_VISION)
    else:
        config = config_class(**{**TINY, **(MOE if family == "qwen3_moe" else {}), **overrides})
    config.architectures = [architecture]
    return config


def text_config(config: transformers.PreTrainedConfig) -> transformers.PreTrainedConfig:
    """The text model's config (the nested one for a wrapped family)."""
    return config.text_config if config.model_type in WRAPPED else config


def make_checkpoint(
    tmp_path: Path,
    family: str,
    *,
    shards: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    fp8_block: tuple[int, int] | None = None,
    hub_config: dict | None = None,
    **config_overrides,
) -> Path:
    """Write a random `family` checkpoint under tmp_path/<family>-<seed> and return its directory.

    dtype: the stored dtype of the (non-FP8) tensors.
    hub_config: config.json is then written as the hub's files carry it, with the classic keys
    (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern, ...) that
    transformers 5 would rewrite on save: TINY, the overrides and these keys, exactly (keys whose
    value is OMIT left out).
    """
    config_class, _, architecture = FAMILIES[family]
    if hub_config is None:
        config = make_config(family, **config_overrides)
    else:
        classic = TINY | config_overrides | hub_config
        classic = {key: value for key, value in classic.items() if value != OMIT}
        config = config_class(**classic)
        config.architectures = [architecture]
    path = Path(tmp_path) / f"{family}-{seed}"
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    if hub_config is not None:
        classic = {"architectures": [architecture], "model_type": config.model_type} | classic
        (path / "config.json").write_text(json.dumps(classic, indent=2))
    tensors = {name: t.to(dtype) for name, t in _random_weights(family, config, seed).items()}
    tensors = _as_on_the_hub(config, tensors, seed)
    if fp8_block is not None:
        tensors = _quantize_layers(tensors, fp8_block)
        raw = json.loads((path / "config.json").read_text())
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
        }
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    write_tensors(path, tensors, text_config(config).num_hidden_layers, shards)
    return path


def _as_on_the_hub(config, tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The tensors as hub checkpoints hold them, where that differs from transformers 5's state dict.

    Qwen3-MoE hub files hold one set of tensors per expert (transformers 5 fuses them on load).
    Qwen3.5 hub files also hold multi-token-prediction tensors (`mtp.*`, with an `mtp.layers.0.`
    that a naive layer-prefix detector mistakes for the decoder's) that no worker may load.
    """
    if config.model_type == "qwen3_moe":
        out = {}
        for name, t in tensors.items():
            layer, _, tail = name.partition(".mlp.experts.")
            if tail == "gate_up_proj":
                gate, up = t.chunk(2, dim=1)  # [E, I, H] each
                for j in range(t.shape[0]):
                    out[f"{layer}.mlp.experts.{j}.gate_proj.weight"] = gate[j]
                    out[f"{layer}.mlp.experts.{j}.up_proj.weight"] = up[j]
            elif tail == "down_proj":
                for j in range(t.shape[0]):
                    out[f"{layer}.mlp.experts.{j}.down_proj.weight"] = t[j]
            else:
                out[name] = t
        return out
    if config.model_type in WRAPPED:
        generator = torch.Generator().manual_seed(seed + 1)
        H = config.text_config.hidden_size
        mtp = ["mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight",
               "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate_proj.weight"]
        dtype = next(iter(tensors.values())).dtype
        return tensors | {name: torch.randn(H, H, generator=generator).to(dtype) for name in mtp}
    return tensors


def _random_weights(family: str, config, seed: int) -> dict[str, torch.Tensor]:
    _, model_class, _ = FAMILIES[family]
    generator = torch.Generator().manual_seed(seed)
    model = model_class(config)
    tensors = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "norm" in name:
            center = 0 if family in PLUS_ONE_NORMS and "linear_attn.norm" not in name else 1
            value = center + 0.2 * torch.randn(param.shape, generator=generator)
        elif name.endswith("A_log"):  # decay rates A in [1, 15): g = -A softplus(a + dt_bias)
            value = torch.rand(param.shape, generator=generator) * 2.7
        elif name.endswith("bias"):
            value = 0.2 * torch.randn(param.shape, generator=generator)
        elif "embed_tokens" in name:
            value = torch.randn(param.shape, generator=generator)
        else:  # [..., out, in]: unit-variance outputs for unit-variance inputs, so attention is peaked
            value = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
        tensors[name] = value
    return tensors


def _quantize_layers(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Store each layer projection as e4m3 with one f32 scale per block (partial edge blocks too)."""
    bm, bn = block
    out = {}
    for name, w in tensors.items():
        if ".layers." not in name or "proj" not in name or not name.endswith(".weight") or w.dim() != 2:
            out[name] = w
            continue
        rows, cols = w.shape
        blocks_r, blocks_c = -(-rows // bm), -(-cols // bn)
        padded = torch.zeros(blocks_r * bm, blocks_c * bn)
        padded[:rows, :cols] = w.float()
        amax = padded.view(blocks_r, bm, blocks_c, bn).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / FP8_MAX  # [blocks_r, blocks_c]; dequantized = stored * scale
        expanded = scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
        out[name] = (w.float() / expanded).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale
    return out


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], layers: int, shards: int) -> None:
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return

    def shard_of(name: str) -> int:
        # Layers split into `shards` contiguous runs; embeddings with the first, head with the last.
        if ".layers." in name:
            return int(name.split(".layers.")[1].split(".")[0]) * shards // layers
        return 0 if "embed_tokens" in name else shards - 1

    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[shard_of(name)] for name in tensors}
    for i, file in enumerate(files):
        part = {name: t for name, t in tensors.items() if shard_of(name) == i}
        save_file(part, path / file, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# How transformers names the cache its layers and masks take: `cache` from after 5.17 on (5.17's
# `past_key_values`, deprecated since), read off the installed version.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class HFLayers:
    """HF's decoder layers `indices` of the checkpoint at `path`, run eagerly with a DynamicCache.

    Called as transformers 5.24's own *Model.forward calls them (read from its installed
    source): `layer(x, attention_mask=..., position_embeddings=(cos, sin), position_ids=...,
    cache=...)` (5.17 names it `past_key_values`: CACHE_ARGUMENT), cos/sin from
    `model.rotary_emb(x, position_ids)`, and the mask from `masking_utils`, sized against the
    cache layer being run (`layer_idx`) since only some layers ever see tokens here.
    """

    def __init__(self, path: Path, indices: list[int], dtype: torch.dtype, experts: str = "eager"):
        """experts: HF's MoE expert path; "eager" (its reference loop, which also runs in f64) or
        its default "grouped_mm"."""
        config = transformers.AutoConfig.from_pretrained(path)
        wrapped = config.model_type in WRAPPED
        model_class = FAMILIES[config.model_type][1] if wrapped else transformers.AutoModelForCausalLM
        model = model_class.from_pretrained(path, dtype=dtype, attn_implementation="eager", experts_implementation=experts)
        self.config = text_config(model.config)
        self.layer_types = getattr(self.config, "layer_types", None)
        # A wrapped family's decoder is the language model beside the vision tower.
        self.model = model.model.language_model if wrapped else model.model
        self.indices = indices
        self.dtype = dtype
        self.cache = DynamicCache(config=self.config)

    def fresh(self) -> HFLayers:
        """These layers with an empty cache: a new session's reference (loading the model is most of
        a test's time, so modules load it once and call this per session)."""
        self.cache = DynamicCache(config=self.config)
        return self

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, index_pos: int) -> torch.Tensor:
        """x: [1, T, H] at positions index_pos.. (must continue the cache) -> [1, T, H]."""
        positions = torch.arange(index_pos, index_pos + x.shape[1])[None, :]
        if self.config.model_type != "gemma3_text":
            # Qwen3.5's rotary has a position row per grid ([3, 1, T]; a text's rows are equal): 5.17 takes
            # only that, later versions also a [1, T] they expand.
            grids = hasattr(self.model.rotary_emb, "recomposition_frequencies")
            cos_sin = self.model.rotary_emb(x, position_ids=positions.expand(3, 1, -1) if grids else positions)
        for i in self.indices:
            layer = self.model.layers[i]
            if getattr(layer, "block_type", None) == "linear_attention":  # Qwen3.5: no mask, no rotary
                x = layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=positions,
                          **{CACHE_ARGUMENT: self.cache})
                continue
            if self.config.model_type == "gemma3_text":  # one rotary per layer type
                cos_sin = self.model.rotary_emb(x, positions, self.layer_types[i])
            # Mistral's and Phi-3's attention read the window from the config, EXAONE 4's is
            # sliding only where is_sliding, Qwen's and Gemma's per layer type.
            if self.config.model_type in ("mistral", "phi3"):
                sliding = self.config.sliding_window
            elif self.config.model_type == "exaone4":
                sliding = layer.self_attn.sliding_window if layer.self_attn.is_sliding else None
            else:
                sliding = getattr(layer.self_attn, "sliding_window", None)
            make_mask = create_sliding_window_causal_mask if sliding is not None else create_causal_mask
            mask = make_mask(
                config=self.config,
                inputs_embeds=x,
                attention_mask=None,
                position_ids=positions,
                **{CACHE_ARGUMENT: self.cache},
                layer_idx=i,
            )
            x = layer(x, attention_mask=mask, position_embeddings=cos_sin, position_ids=positions,
                      **{CACHE_ARGUMENT: self.cache})
        return x


# VibeVoice (--model-type audio-model): its config.json's architecture and model_type, and its
# stacks of Qwen2 layers (the Realtime 0.5B's TTS language model after its base one).
VIBEVOICE = {
    "vibevoice": ("VibeVoiceForConditionalGeneration", ("model.language_model.layers",)),
    "vibevoice_streaming": ("VibeVoiceStreamingForConditionalGenerationInference",
                            ("model.language_model.layers", "model.tts_language_model.layers")),
}
VIBEVOICE_ROPE_THETA = 1e6  # not transformers' default, so that a decoder_config read wrong shows


def make_vibevoice_checkpoint(tmp_path: Path, model_type: str, layers: tuple[int, ...], *,
                              torch_dtype: str = "float32", dtype: torch.dtype = torch.float32) -> tuple[Path, dict[str, Path]]:
    """A VibeVoice-shaped checkpoint under tmp_path/<model_type> (`layers[i]` layers in stack i), and
    per stack prefix a Qwen2 checkpoint holding that stack's layers as `model.layers.N`, which
    HFLayers runs as the oracle (transformers' Qwen2DecoderLayer).

    config.json nests the decoder's Qwen2 config in `decoder_config` (its num_hidden_layers
    counting every stack's, its `torch_dtype` as given) as the hub's VibeVoice files do; the
    Realtime's gives its TTS stack's count as tts_backbone_num_hidden_layers. The tensors hold
    each stack's layers under its prefix (each stack's own random weights), the stacks' embeddings
    and a prediction head with `layers` of its own, which is no decoder stack."""
    architecture, prefixes = VIBEVOICE[model_type]
    path = Path(tmp_path) / model_type
    path.mkdir(parents=True, exist_ok=True)
    hub = {"rope_theta": VIBEVOICE_ROPE_THETA, "use_sliding_window": False}
    oracles, tensors = {}, {}
    for seed, (prefix, count) in enumerate(zip(prefixes, layers, strict=True)):
        oracle = make_checkpoint(Path(tmp_path) / f"{model_type}-oracle", "qwen2", seed=seed, dtype=dtype,
                                 num_hidden_layers=count, hub_config=hub)
        oracles[prefix] = oracle
        stack = prefix.removesuffix(".layers")
        with safe_open(oracle / "model.safetensors", framework="pt") as f:
            for name in f.keys():
                if name.startswith("model."):
                    tensors[stack + name.removeprefix("model")] = f.get_tensor(name)
    hidden = TINY["hidden_size"]
    tensors["model.prediction_head.layers.0.ffn.weight"] = torch.randn(hidden, hidden).to(dtype)
    decoder = {key: value for key, value in json.loads((oracles[prefixes[0]] / "config.json").read_text()).items()
               if key not in ("architectures", "dtype", "torch_dtype")}
    config = {"architectures": [architecture], "model_type": model_type, "acoustic_vae_dim": 64,
              "decoder_config": decoder | {"num_hidden_layers": sum(layers), "torch_dtype": torch_dtype},
              "torch_dtype": torch_dtype}
    if len(layers) > 1:
        config["tts_backbone_num_hidden_layers"] = layers[1]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path, oracles
