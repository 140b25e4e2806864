"""Stable Diffusion's components as a Cake worker computes them: diffusers' UNet and VAE and
transformers' CLIP text encoder, built from a config and loaded from one safetensors file, with
candle's differences from those libraries applied (Cake's worker runs candle):

* the UNet has no added conditioning (`addition_embed_type` None, `add_embedding.*` ignored):
  Cake's master never sends SDXL's pooled embedding and time ids;
* the UNet's GEGLU feed-forward gate is the tanh approximation of GELU (candle's `gelu`);
* a CLIP whose config says `gelu` computes its tanh approximation (candle's `Activation::Gelu`);
* CLIP's output is the last hidden state after the final layer norm, for SDXL too (diffusers
  takes the penultimate layer there).

Each component checks what it is given against its architecture (BadTensor: the master's
mistake) and computes a batch of calls with equal shapes at once (`run`), concatenated along
the batch dimension: several masters' UNet steps cost one pass over the weights.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.activations import GEGLU
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel

from cakemp.checkpoint.image import sd_configs
from cakemp.checkpoint.image.archs import MAX_SIDE
from cakemp.errors import BadTensor, CheckpointError
from cakemp.model.image.component import Component, Files, activation_bytes, vae_bytes


def _config(path: str | None, standard: dict[str, Any]) -> dict[str, Any]:
    if path is None:
        return dict(standard)
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _load(module: torch.nn.Module, weights: str, ignored: tuple[str, ...], rename=None) -> None:
    """Load `weights` into `module`; every parameter must be there, and nothing else but `ignored` prefixes."""
    state = load_file(weights)
    if rename is not None:
        state = rename(state)
    result = module.load_state_dict(state, strict=False)
    unexpected = [key for key in result.unexpected_keys if not key.startswith(ignored)]
    if result.missing_keys or unexpected:
        raise CheckpointError(f"{weights} does not fit its architecture: missing {result.missing_keys[:4]}, "
                              f"unexpected {unexpected[:4]}")


def _place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every weight to `device` in `dtype`, for inference. torch's own `to`: diffusers' warns that
    modules it would keep in f32 are cast, and these have none."""
    torch.nn.Module.to(module, device, dtype).eval()


def _tanh_gelu(self, gate: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise BadTensor(message)


def _text_model(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's text encoder files name their weights `text_model.*` (candle reads them so);
    transformers 5's CLIPTextModel holds them without the prefix."""
    return {key.removeprefix("text_model."): value for key, value in state.items()}


class Clip(Component):
    """`clip`/`clip2`: token ids [b, L] -> last hidden state after the final norm [b, L, D]."""

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        config = _config(files.config, sd_configs.CLIP2 if name == "clip2" else sd_configs.CLIPS[version])
        if config.get("hidden_act") == "gelu":  # candle's Activation::Gelu is the tanh approximation
            config["hidden_act"] = "gelu_pytorch_tanh"
        self.config = CLIPTextConfig(**config)
        with device:  # random initialisation where the weights will live (fast on a GPU), then overwritten
            self.module = CLIPTextModel(self.config)
        _load(self.module, files.weights, ("text_projection.", "embeddings.position_ids"), _text_model)
        _place(self.module, device, dtype)
        self.name, self.device = name, device

    def prepare(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids [b, L] int64 on the CPU, checked against the vocabulary and the positions."""
        _check(ids.shape[1] <= self.config.max_position_embeddings,
               f"{self.name}: {ids.shape[1]} tokens, at most {self.config.max_position_embeddings}")
        _check(bool(((ids >= 0) & (ids < self.config.vocab_size)).all()),
               f"{self.name}: a token id is outside the vocabulary of {self.config.vocab_size}")
        return (ids.to(self.device),)

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        """What calls computed together share (`run`): everything but the batch size."""
        return tuple(call[0].shape[1:])

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """Each layer's MLP intermediates [b, L, I] and attention scores [b, heads, L, L]."""
        batch, length = call[0].shape
        return activation_bytes(self.module.dtype, batch, length, self.config.intermediate_size,
                                self.config.num_attention_heads, length)

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        ids = torch.cat([ids for (ids,) in calls])
        hidden = self.module(input_ids=ids).last_hidden_state  # [sum b, L, D], after final_layer_norm
        return list(hidden.split([call[0].shape[0] for call in calls]))


class UNet(Component):
    """`unet`: (latents [B, C, h, w], text embeddings [B, L, D], timestep [1]) -> noise [B, C, h, w]."""

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        config = _config(files.config, sd_configs.UNETS[version])
        config["addition_embed_type"] = None  # Cake's master sends no added conditioning
        with device:
            self.module = UNet2DConditionModel.from_config(config)
        _load(self.module, files.weights, ("add_embedding.",))
        for block in self.module.modules():
            if isinstance(block, GEGLU):
                block.gelu = types.MethodType(_tanh_gelu, block)  # candle's gelu: the tanh approximation
        _place(self.module, device, dtype)
        self.config = self.module.config
        self.name, self.device, self.dtype = name, device, dtype
        self.factor = 2 ** (len(self.config.down_block_types) - 1)  # latent sides must divide by it

    def prepare(self, latents: torch.Tensor, text: torch.Tensor, timestep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, channels, height, width = latents.shape
        _check(channels == self.config.in_channels, f"unet: latents have {channels} channels, the UNet takes "
               f"{self.config.in_channels}")
        _check(batch >= 1 and text.shape[0] == batch, f"unet: {batch} latents but {text.shape[0]} text embeddings")
        _check(text.shape[2] == self.config.cross_attention_dim and text.shape[1] >= 1,
               f"unet: text embeddings are {text.shape[2]} wide, the UNet attends to {self.config.cross_attention_dim}")
        _check(height % self.factor == 0 and width % self.factor == 0 and 0 < height * 8 <= MAX_SIDE
               and 0 < width * 8 <= MAX_SIDE, f"unet: latents of {height}x{width} (each side a multiple of "
               f"{self.factor}, at most {MAX_SIDE // 8})")
        _check(timestep.numel() == 1 and math.isfinite(float(timestep)), "unet: the timestep is one finite number")
        return (latents.to(self.device, self.dtype), text.to(self.device, self.dtype),
                timestep.reshape(1).to(self.device).expand(batch))

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        """Latent and text shapes but the batch (each call's timestep is its own rows')."""
        return tuple(call[0].shape[1:]) + tuple(call[1].shape[1:])

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """Each resolution's activations (kept for the up path too) with its transformer's GEGLU
        feed-forward [B, h·w / 4^i, 8·C_i], and where it attends, its scores [B, heads_i, h·w / 4^i,
        h·w / 4^i + L] (self- and cross-attention)."""
        latents, text = call[0], call[1]
        batch, positions, length = latents.shape[0], latents.shape[2] * latents.shape[3], text.shape[1]
        levels = self.config.down_block_types
        # diffusers' UNet reads attention_head_dim as the number of heads where num_attention_heads is unset
        heads = self.config.num_attention_heads or self.config.attention_head_dim
        total = 0
        for i, (kind, width) in enumerate(zip(levels, self.config.block_out_channels, strict=True)):
            level_heads = (heads[i] if isinstance(heads, list | tuple) else heads) if "CrossAttn" in kind else 0
            at = positions >> (2 * i)
            total += activation_bytes(self.dtype, batch, at, 8 * width, level_heads, at + length)
        return total

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        latents, text, timesteps = (torch.cat(parts) for parts in zip(*calls))
        noise = self.module(latents, timesteps, encoder_hidden_states=text).sample
        return list(noise.split([call[0].shape[0] for call in calls]))


def _modern_attention_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Older VAE files name the mid-block attention query/key/value/proj_attn (candle reads both)."""
    renames = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}
    renamed = {}
    for key, value in state.items():
        for old, new in renames.items():
            if "attentions." in key and old in key:
                key = key.replace(old, new)
                value = value.squeeze(-1).squeeze(-1) if value.dim() == 4 else value  # 1x1 convs as linears
        renamed[key] = value
    return renamed


class Vae(Component):
    """`vae`: (direction [1], x): 1 encodes an image [b, 3, H, W] to sampled latents, 0 decodes latents."""

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        with device:
            self.module = AutoencoderKL.from_config(_config(files.config, sd_configs.VAES[version]))
        _load(self.module, files.weights, (), _modern_attention_names)
        _place(self.module, device, dtype)
        self.config = self.module.config
        self.name, self.device, self.dtype = name, device, dtype
        self.factor = 2 ** (len(self.config.block_out_channels) - 1)

    def prepare(self, direction: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _check(direction.numel() == 1 and float(direction) in (0.0, 1.0), "vae: the direction is 1 (encode) or 0 (decode)")
        encode = float(direction) == 1.0
        channels = self.config.in_channels if encode else self.config.latent_channels
        scale = 1 if encode else self.factor  # image pixels per element of x
        _check(x.shape[0] >= 1 and x.shape[1] == channels, f"vae: {'encode' if encode else 'decode'} takes "
               f"{channels} channels, got {x.shape[1]}")
        _check(0 < x.shape[2] * scale <= MAX_SIDE and 0 < x.shape[3] * scale <= MAX_SIDE
               and (not encode or (x.shape[2] % self.factor == 0 and x.shape[3] % self.factor == 0)),
               f"vae: an image of {x.shape[2] * scale}x{x.shape[3] * scale} (at most {MAX_SIDE}, sides a multiple "
               f"of {self.factor})")
        return (direction.reshape(1), x.to(self.device, self.dtype))

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        """The direction, and the shape but the batch."""
        return (float(call[0]),) + tuple(call[1].shape[1:])

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """vae_bytes over the image: x's pixels to encode, or its latents' times factor² to decode."""
        x = call[1]
        scale = 1 if float(call[0]) == 1.0 else self.factor * self.factor
        return vae_bytes(self.dtype, self.config.block_out_channels, x.shape[0], x.shape[2] * x.shape[3] * scale)

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        x = torch.cat([x for _, x in calls])
        if float(calls[0][0]) == 1.0:  # a group has one direction: it is part of its key
            y = self.module.encode(x).latent_dist.sample()  # mean + std * noise, from this process's RNG
        else:
            y = self.module.decode(x).sample
        return list(y.split([x.shape[0] for _, x in calls]))

