"""A GGUF file in Hugging Face's terms: the config.json its metadata stands for, and the HF name
of each tensor. No torch: the front builds its ModelConfig from here before any device starts.

| general.architecture | family    | llama.cpp's converter permutes q/k rows |
|----------------------|-----------|-----------------------------------------|
| llama                | llama     | yes: undone at load (`permuted_heads`)   |
| qwen2                | qwen2     | no                                      |
| qwen3                | qwen3     | no                                      |
| qwen3moe             | qwen3_moe | no                                      |

Any other architecture is refused by name (Cake runs unknown ones as Llama). The metadata keys
read, each under "<arch>.": embedding_length, block_count, feed_forward_length,
attention.head_count(_kv), attention.key_length (head_dim; Cake ignores it, so Qwen3's heads
of 128 over a hidden size of 1024 fail there), attention.value_length (must equal it),
attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count (must be head_dim: no
partial rotary here), rope.scaling.type ("linear" and its factor; yarn refused), context_length,
and for MoE expert_count, expert_used_count, expert_feed_forward_length and
expert_weights_norm (llama.cpp's qwen3moe renormalises the top-k weights when it is absent).
Llama 3's rope scaling, which llama.cpp's converter stores as a `rope_freqs` tensor of
per-frequency factors, is refused by name, and so is a file split in parts (`split.count`).
Biases (Llama, Qwen3) follow the tensors present, as llama.cpp infers them, and a file without
output.weight ties lm_head to the embeddings.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cakemp.checkpoint.gguf import GgufFile, NumberArray
from cakemp.errors import CheckpointError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
_PERMUTED = frozenset({"llama"})


class GgmlFamily(NamedTuple):
    """A family of ggml types read alike: its types and the module that dequantizes them (and keeps
    those it can int4), named by path so that this stays torch-free (model/weights/ggml.py imports it)."""

    name: str
    types: tuple[str, ...]
    module: str


# One row per ggml family cakemp reads (a family is its module and this row).
GGML_FAMILIES = (
    GgmlFamily("legacy", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"), "cakemp.model.weights.ggml_legacy"),
    GgmlFamily("K-quants", ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"), "cakemp.model.weights.ggml_k"),
    GgmlFamily("IQ4", ("IQ4_NL", "IQ4_XS"), "cakemp.model.weights.ggml_iq4"),
    GgmlFamily("ternary", ("TQ1_0", "TQ2_0"), "cakemp.model.weights.ggml_ternary"),
)
# The ggml types read: floats as they are, the families' dequantized; a file with another among its
# tensors is refused here, before any device starts.
DEQUANTIZED_TYPES = ("F32", "F16", "BF16") + tuple(kind for family in GGML_FAMILIES for kind in family.types)
ROPE_FREQS = "rope_freqs.weight"

# GGUF tensor name -> HF name: the model's own, then each layer's (under blk.N. and model.layers.N.).
_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router [E, H]
    # Experts stacked [E, I, H] (gate, up) and [E, H, I] (down): mlx-lm's switch_mlp layout, which model/moe.py takes.
    **{f"ffn_{p}_exps.weight": f"mlp.switch_mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def hf_names(gguf_names: list[str] | set[str]) -> dict[str, str]:
    """HF name -> GGUF name, for every tensor of the file that has one (others are never read)."""
    out = {}
    for name in gguf_names:
        if name in _MODEL_NAMES:
            out[_MODEL_NAMES[name]] = name
            continue
        head, _, tail = name.partition(".")  # "blk", "7.attn_q.weight"
        index, _, rest = tail.partition(".")
        if head == "blk" and index.isdigit() and rest in _LAYER_NAMES:
            out[f"model.layers.{int(index)}.{_LAYER_NAMES[rest]}"] = name
    return out


def permuted_heads(gguf: GgufFile, gguf_name: str, heads: int, kv_heads: int) -> int | None:
    """The head count llama.cpp's converter permuted this tensor's rows by (q: the query heads,
    k: the key/value heads), or None for a tensor stored in HF's order."""
    if gguf.metadata.get("general.architecture") not in _PERMUTED:
        return None
    if ".attn_q." in gguf_name:
        return heads
    if ".attn_k." in gguf_name:
        return kv_heads
    return None


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    """The config.json (as a dict) that the file's metadata describes, for ModelConfig.from_dict."""
    arch = gguf.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{gguf.path}: GGUF architecture {arch!r} is not supported by cakemp "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    split = gguf.metadata.get("split.count", 1)
    if split != 1:
        raise CheckpointError(f"{gguf.path}: a GGUF file split in {split!r} parts is not supported "
                              "(merge them first: llama-gguf-split --merge)")
    if ROPE_FREQS in gguf.tensors:
        raise CheckpointError(f"{gguf.path}: per-frequency rope factors ({ROPE_FREQS}, Llama 3's rope scaling) "
                              "are not supported in GGUF files")
    _check_types(gguf)
    meta = _Metadata(gguf, arch)
    heads = meta.get("attention.head_count")
    head_dim = meta.get("attention.key_length", None)
    if meta.get("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{gguf.path}: {arch}.attention.value_length differs from key_length")
    d = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": meta.get("embedding_length"),
        "num_hidden_layers": meta.get("block_count"),
        "intermediate_size": meta.get("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("attention.head_count_kv", heads),
        "rms_norm_eps": meta.get("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta),
        "max_position_embeddings": meta.get("context_length"),
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    if head_dim is not None:
        d["head_dim"] = head_dim
    rotary = meta.get("rope.dimension_count", None)
    if rotary is not None and rotary != (head_dim or _quotient(d["hidden_size"], heads)):
        raise CheckpointError(f"{gguf.path}: {arch}.rope.dimension_count {rotary!r} is not the head size "
                              "(partial rotary is not supported in GGUF files)")
    if arch == "qwen3moe":
        d |= _moe(meta)
    return d


def _check_types(gguf: GgufFile) -> None:
    for name in hf_names(gguf.tensors).values():
        kind = gguf.tensors[name].type.name
        if kind not in DEQUANTIZED_TYPES:
            raise CheckpointError(f"{gguf.path}: tensor {name} is {kind}, which cakemp does not dequantize "
                                  f"(only {', '.join(DEQUANTIZED_TYPES)})")


class _Metadata:
    """`<arch>.KEY` lookups, a missing one (without a default) a CheckpointError naming it."""

    _REQUIRED = object()

    def __init__(self, gguf: GgufFile, arch: str):
        self.gguf, self.arch = gguf, arch

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.gguf.metadata:
            value = self.gguf.metadata[full]
            # config.json's values are JSON's: an array (a per-layer count) as the list it would be there
            return list(value) if isinstance(value, NumberArray) else value
        if default is self._REQUIRED:
            raise CheckpointError(f"{self.gguf.path}: GGUF metadata lacks {full}")
        return default


def _rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.get("rope.scaling.factor")}
    raise CheckpointError(f"{meta.gguf.path}: {meta.arch}.rope.scaling.type {kind!r} is not supported "
                          "(only none and linear)")


def _moe(meta: _Metadata) -> dict[str, Any]:
    if meta.get("expert_shared_count", 0):
        raise CheckpointError(f"{meta.gguf.path}: shared experts are not supported for {meta.arch}")
    return {
        "num_experts": meta.get("expert_count"),
        "num_experts_per_tok": meta.get("expert_used_count"),
        "moe_intermediate_size": meta.get("expert_feed_forward_length"),
        "norm_topk_prob": meta.get("expert_weights_norm", True),
    }


def _quotient(hidden: Any, heads: Any) -> Any:
    """hidden // heads where both are positive ints (ModelConfig checks them), else None."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
    return hidden // heads if ok else None
