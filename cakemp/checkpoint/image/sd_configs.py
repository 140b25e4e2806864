"""Each Stable Diffusion version's standard architecture, as Cake hard-codes it (candle's
`StableDiffusionConfig::{v1_5, v2_1, sdxl, sdxl_turbo}` and `clip::Config`), written as the
config.json diffusers and transformers read (torch-free).

A node uses these only where neither the snapshot nor --sd-config-dir has the component's
config.json (sd_files.py). The UNet's `addition_embed_type` is always None, as in candle: Cake's
master never sends SDXL's pooled text embedding and time ids, so its added conditioning is skipped.
"""

from __future__ import annotations

from typing import Any

_UNET_COMMON: dict[str, Any] = {
    "in_channels": 4, "out_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "norm_eps": 1e-5,
    "act_fn": "silu", "flip_sin_to_cos": True, "freq_shift": 0, "downsample_padding": 1,
    "center_input_sample": False, "mid_block_scale_factor": 1, "addition_embed_type": None,
}
_SD1_BLOCKS: dict[str, Any] = {
    "block_out_channels": [320, 640, 1280, 1280],
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
}
_XL_UNET: dict[str, Any] = {
    **_UNET_COMMON, "block_out_channels": [320, 640, 1280],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": [5, 10, 20], "transformer_layers_per_block": [1, 2, 10], "cross_attention_dim": 2048,
    "use_linear_projection": True,
}
UNETS: dict[str, dict[str, Any]] = {
    "v1-5": {**_UNET_COMMON, **_SD1_BLOCKS, "attention_head_dim": 8, "cross_attention_dim": 768,
             "use_linear_projection": False},
    "v2-1": {**_UNET_COMMON, **_SD1_BLOCKS, "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024,
             "use_linear_projection": True},
    "xl": _XL_UNET,
    "turbo": _XL_UNET,
}

_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "norm_num_groups": 32, "act_fn": "silu",
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
VAES: dict[str, dict[str, Any]] = {version: _VAE for version in UNETS}


def _clip(hidden: int, layers: int, heads: int, act: str) -> dict[str, Any]:
    return {"vocab_size": 49408, "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "max_position_embeddings": 77, "hidden_act": act, "layer_norm_eps": 1e-5}


# candle's Activation::Gelu is written "gelu" here, as the hub's config.json files write it;
# sd.py turns it into the tanh approximation candle computes (docs/components.md, Image components).
_XL_CLIP = _clip(768, 12, 12, "quick_gelu")
CLIPS: dict[str, dict[str, Any]] = {
    "v1-5": _XL_CLIP, "v2-1": _clip(1024, 23, 16, "gelu"), "xl": _XL_CLIP, "turbo": _XL_CLIP,
}
CLIP2 = _clip(1280, 32, 20, "gelu")
