"""Tiny checkpoints of the later families, with config.json keyed as their hub checkpoints are.

Each entry is make_checkpoint's (family, overrides, hub_config) for a 4-layer checkpoint
whose layers 1-3 hold both of the family's layer kinds (local and global where it has them),
with windows shorter than a 7-token prompt so the window bites inside a prompt, and the
ties the family's checkpoints use (Gemma 3 and Phi-4-mini tie, OLMo 2 and EXAONE 4 32B do not).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.checkpoints import OMIT, make_checkpoint

HUB_FAMILIES = {
    # gemma-3-1b: classic rope keys, no layer_types, tie_word_embeddings left out (means tied);
    # rope_scaling linear as on 4B+ global layers. Pattern 2: layers 1 and 3 global, 0 and 2 local.
    "gemma3": (
        "gemma3",
        {"head_dim": 32},  # != hidden / heads, and query_pre_attn_scalar != head_dim
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 24,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 4,
            "sliding_window_pattern": 2,
            "tie_word_embeddings": OMIT,
        },
    ),
    # Phi-4-mini: partial rotary 0.75 at the top level, longrope with top-level
    # original_max_position_embeddings (16 here: the tests' positions pass it, so both factor
    # sets are used), tied; Phi-3-mini's sliding_window (5 here) on every layer.
    "phi3": (
        "phi3",
        {"tie_word_embeddings": True},
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 16,
            "rope_theta": 10_000.0,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
            },
            "sliding_window": 5,
            "head_dim": 16,
            # The hub's token ids scaled into the tiny vocabulary (HF checks pad_token_id).
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
        },
    ),
    # OLMo-2-1124-7B: plain rope_theta, untied.
    "olmo2": ("olmo2", {}, {"rope_theta": 500_000.0, "rope_scaling": None}),
    # EXAONE-4.0-32B: layer_types and the LLLG pattern string, llama3 rope scaling, untied.
    "exaone4": (
        "exaone4",
        {},
        {
            "rope_theta": 1_000_000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "sliding_window": 5,
            "sliding_window_pattern": "LLLG",
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        },
    ),
    # Falcon3-7B-Base: LlamaForCausalLM with its own rope_theta and an explicit head_dim
    # (32 here, against hidden / heads = 16).
    "falcon3": (
        "llama",
        {"head_dim": 32},
        {"rope_theta": 1000042.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False},
    ),
}


def family_checkpoint(path: Path, name: str) -> Path:
    """A tiny checkpoint of family `name` in `path`: keyed as its hub checkpoints are where HUB_FAMILIES has
    it, else make_checkpoint's own."""
    if name in HUB_FAMILIES:
        family, overrides, hub = HUB_FAMILIES[name]
        return make_checkpoint(path, family, hub_config=hub, **overrides)
    return make_checkpoint(path, name)
