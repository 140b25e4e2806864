"""FLUX.2-klein's components as a Cake worker serves them.

`flux_text_encoder`: transformers' Qwen3Model over token ids [b, 512], the hidden states after
layers 8, 17 and 26 (0-based) concatenated on the features (3 x 2560 = 7680 for klein-4B), no
final norm; replied as Cake's `pack_tensors` of that one tensor, an F32 vector. As Cake's
worker: attention is causal, and the SingleOp's `index_pos` carries the prompt's real token count
(a call's `token_count` here), so keys past it (the padding) are masked when 0 < count < L.

`flux_transformer`: diffusers' Flux2Transformer2DModel over [img [b, S, 128], img_ids [b, S, 4],
txt [b, L, 7680], txt_ids [b, L, 4], timestep [1]] (the timestep a sigma in [0, 1], scaled by
1000 inside, as candle's); no guidance embedding. Cake's weights are always BF16 and so is its
reply, the velocity [b, S, 128]; cakemp computes in bf16 too unless --dtype f32 (then in f32,
replied in BF16: Cake's master adds the reply to its BF16 latents, and candle refuses mixed dtypes).
Calls batch together when their shapes and position ids agree (each with its own timestep).

`flux_vae`: diffusers' AutoencoderKLFlux2, in f32 whatever --dtype says (as Cake). Its input is
[dims [2] = (h, w), patchified latents [1, h·w, 128]]: the latents are denormalised with the
VAE's batch-norm statistics (x·sqrt(running_var + 1e-4) + running_mean), unpatchified to
[1, 32, 2h, 2w] and decoded to an F32 image [1, 3, 16h, 16w]. Cake's legacy form
[direction [1], latents [1, 32, H, W]] decodes as is; its encode direction is refused, as Cake
refuses it.

Better than Cake where it changes no result: the layers after 26 are not loaded nor run (Cake
computes all 36 and throws 27-35 away, a quarter of the encoder's work); and with --dtype f16
the encoder computes in bf16, Qwen3's own dtype, whose range f16's overflow does not cut.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3Model

from cakemp.errors import BadTensor, CheckpointError
from cakemp.model.image.component import Component, Files, activation_bytes, vae_bytes

OUTPUT_LAYERS = (8, 17, 26)  # FLUX.2-klein's text conditioning: these layers' outputs, concatenated


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise BadTensor(message)


def _weights(folder: Path, layers: int) -> dict[str, torch.Tensor]:
    """The shards' tensors that the first `layers` layers and the embedding need, named as Qwen3Model
    names them (the files prefix them `model.`)."""
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as stored:  # only what is kept is read
            for key in stored.keys():
                name = key.removeprefix("model.")
                if name.startswith("layers.") and int(name.split(".")[1]) >= layers:
                    continue
                if name.startswith(("norm.", "lm_head.")):  # the final norm is not used
                    continue
                state[name] = stored.get_tensor(key)
    return state


class FluxTextEncoder(Component):
    """`flux_text_encoder`: ids [b, L] (and the real token count) -> pack([hidden [b, L, 3·H]]) in F32."""

    uses_token_count = True

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        try:
            config = json.loads(Path(files.config).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {files.config}: {e}") from None
        config.pop("layer_types", None)  # one per layer of the whole model; rebuilt for the layers kept
        self.layers = OUTPUT_LAYERS[-1] + 1
        if config.get("num_hidden_layers", 0) < self.layers:
            raise CheckpointError(f"{files.config}: the encoder has {config.get('num_hidden_layers')} layers, "
                                  f"FLUX.2 reads layer {OUTPUT_LAYERS[-1]}")
        self.config = Qwen3Config(**{**config, "num_hidden_layers": self.layers})
        with device:  # random initialisation where the weights will live (fast on a GPU), then overwritten
            self.module = Qwen3Model(self.config)
        result = self.module.load_state_dict(_weights(Path(files.weights), self.layers), strict=False)
        missing = [key for key in result.missing_keys if not key.startswith("norm.")]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"{files.weights} does not fit its config: missing {missing[:4]}, unexpected "
                                  f"{result.unexpected_keys[:4]}")
        self.dtype = torch.bfloat16 if dtype == torch.float16 else dtype
        torch.nn.Module.to(self.module, device, self.dtype).eval()
        self.name, self.device = name, device
        self._outputs: list[torch.Tensor] = []
        for index in OUTPUT_LAYERS:
            self.module.layers[index].register_forward_hook(lambda module, inputs, output: self._outputs.append(output))

    def prepare(self, ids: torch.Tensor, token_count: int = 0) -> tuple[torch.Tensor, ...]:
        """ids [b, L] and the mask of its real tokens (all real unless 0 < token_count < L, as Cake)."""
        _check(bool(((ids >= 0) & (ids < self.config.vocab_size)).all()),
               f"{self.name}: a token id is outside the vocabulary of {self.config.vocab_size}")
        _check(ids.shape[1] <= self.config.max_position_embeddings,
               f"{self.name}: {ids.shape[1]} tokens, at most {self.config.max_position_embeddings}")
        mask = torch.ones(ids.shape, dtype=torch.long)
        if 0 < token_count < ids.shape[1]:
            mask[:, token_count:] = 0
        return ids.to(self.device), mask.to(self.device)

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        return tuple(call[0].shape[1:])

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """Each layer's MLP intermediates [b, L, I] and attention scores [b, heads, L, L]."""
        batch, length = call[0].shape
        return activation_bytes(self.dtype, batch, length, self.config.intermediate_size,
                                self.config.num_attention_heads, length)

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        ids, mask = (torch.cat(parts) for parts in zip(*calls))
        self._outputs.clear()
        self.module(input_ids=ids, attention_mask=mask, use_cache=False)
        hidden = torch.cat(self._outputs, dim=-1).float()  # [sum b, L, 3·H]
        self._outputs.clear()
        return [_pack(part) for part in hidden.split([call[0].shape[0] for call in calls])]


def _pack(x: torch.Tensor) -> torch.Tensor:
    """Cake's pack_tensors of the one tensor x: [1, ndim, dims…, data…] in F32."""
    header = torch.tensor([1.0, float(x.dim()), *map(float, x.shape)], device=x.device)
    return torch.cat([header, x.reshape(-1)])


def _diffusers_module(cls, files, what: str, device: torch.device) -> torch.nn.Module:
    """`cls` built from the component's config.json and loaded from its folder's safetensors file."""
    try:
        config = json.loads(Path(files.config).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {files.config}: {e}") from None
    with device:  # random initialisation where the weights will live (fast on a GPU), then overwritten
        module = cls.from_config(config)
    state = {}
    for shard in sorted(Path(files.weights).glob("*.safetensors")):
        with safe_open(shard, "pt") as stored:
            state.update({key: stored.get_tensor(key) for key in stored.keys()})
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"{files.weights}: the {what} does not fit its config: missing "
                              f"{result.missing_keys[:4]}, unexpected {result.unexpected_keys[:4]}")
    return module


class FluxTransformer(Component):
    """`flux_transformer`: (img, img_ids, txt, txt_ids, timestep) -> velocity [b, S, C] in BF16."""

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        self.module = _diffusers_module(Flux2Transformer2DModel, files, "transformer", device)
        self.dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        torch.nn.Module.to(self.module, device, self.dtype).eval()
        self.config = self.module.config
        self.name, self.device = name, device

    def prepare(self, img, img_ids, txt, txt_ids, timestep) -> tuple[torch.Tensor, ...]:
        axes = len(self.config.axes_dims_rope)
        _check(img.shape[2] == self.config.in_channels and txt.shape[2] == self.config.joint_attention_dim,
               f"flux_transformer: img [b, S, {self.config.in_channels}] and txt [b, L, "
               f"{self.config.joint_attention_dim}], got {list(img.shape)} and {list(txt.shape)}")
        _check(img.shape[0] == txt.shape[0] == 1 and tuple(img_ids.shape) == (1, img.shape[1], axes)
               and tuple(txt_ids.shape) == (1, txt.shape[1], axes), f"flux_transformer: one image, its ids "
               f"[1, S, {axes}] and [1, L, {axes}]")
        _check(img.shape[1] <= 65536 and txt.shape[1] <= 4096, "flux_transformer: at most 65536 image and 4096 "
               "text tokens")
        _check(timestep.numel() == 1 and bool(torch.isfinite(timestep).all()), "flux_transformer: the timestep "
               "is one finite number")
        _check(bool(torch.isfinite(img_ids).all() and torch.isfinite(txt_ids).all()), "flux_transformer: position "
               "ids are finite")
        to = {"device": self.device, "dtype": self.dtype}
        return (img.to(**to), img_ids[0].to(self.device), txt.to(**to), txt_ids[0].to(self.device),
                timestep.reshape(1).to(**to))

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        """Shapes and the position ids themselves: diffusers takes one set of ids for the whole batch."""
        img, img_ids, txt, txt_ids, *_ = call  # FLUX.1's calls carry y and guidance after them
        return (tuple(img.shape), tuple(txt.shape), img_ids.cpu().numpy().tobytes(), txt_ids.cpu().numpy().tobytes())

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """Over the joint sequence of S + L tokens: the feed-forward [1, S + L, 4·inner] and the
        attention scores [1, heads, S + L, S + L]."""
        tokens = call[0].shape[1] + call[2].shape[1]
        heads = self.config.num_attention_heads
        return activation_bytes(self.dtype, 1, tokens, 4 * heads * self.config.attention_head_dim, heads, tokens)

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        img = torch.cat([call[0] for call in calls])
        txt = torch.cat([call[2] for call in calls])
        timesteps = torch.cat([call[4] for call in calls])
        velocity = self.module(hidden_states=img, encoder_hidden_states=txt, timestep=timesteps,
                               img_ids=calls[0][1], txt_ids=calls[0][3]).sample
        return list(velocity.to(torch.bfloat16).split(1))


class FluxVae(Component):
    """`flux_vae`: (dims [2], latents [b, h·w, 4·C]) or (direction [1] = 0, latents [b, C, H, W]) -> image."""

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        self.module = _diffusers_module(AutoencoderKLFlux2, files, "VAE", device)
        torch.nn.Module.to(self.module, device, torch.float32).eval()  # Cake's VAE always runs in f32
        self.channels = self.module.config.latent_channels
        self.name, self.device = name, device

    def prepare(self, head: torch.Tensor, latents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The latents as the decoder takes them: [b, C, 2h, 2w], f32, on the device."""
        if latents.dim() == 4:  # Cake's legacy form: [direction, latents]
            _check(head.numel() == 1 and float(head) == 0.0, "flux_vae: only decode (direction 0) is served, as Cake")
            _check(latents.shape[1] == self.channels, f"flux_vae: latents have {latents.shape[1]} channels, the "
                   f"decoder takes {self.channels}")
            _check(0 < latents.shape[2] * 8 <= 4096 and 0 < latents.shape[3] * 8 <= 4096, "flux_vae: an image "
                   "side past 4096")
            return (latents.to(self.device, torch.float32),)
        _check(head.numel() == 2 and all(float(v) == int(v) and 0 < v <= 256 for v in head.tolist()),
               "flux_vae: dims are the patchified latents' (h, w), whole numbers in 1..256")
        h, w = (int(v) for v in head.tolist())
        batch, tokens, features = latents.shape
        _check(tokens == h * w and features == 4 * self.channels, f"flux_vae: latents [{batch}, {tokens}, {features}]"
               f" are not [b, h·w = {h * w}, {4 * self.channels}]")
        bn = self.module.bn
        x = latents.to(self.device, torch.float32)
        x = x * torch.sqrt(bn.running_var + bn.eps) + bn.running_mean  # [b, h·w, 4C], per channel
        # Unpatchify: [b, h, w, (C, 2, 2)] -> [b, C, 2h, 2w], each token's 2x2 pixels in place.
        x = x.reshape(batch, h, w, self.channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return (x.reshape(batch, self.channels, 2 * h, 2 * w),)

    @staticmethod
    def group(call: tuple[torch.Tensor, ...]) -> tuple:
        return tuple(call[0].shape[1:])

    def cost(self, call: tuple[torch.Tensor, ...]) -> int:
        """vae_bytes of decoding the latents [b, C, H, W] to 8H x 8W pixels (the decoder's factor)."""
        latents = call[0]
        scale = 4 ** (len(self.module.config.block_out_channels) - 1)
        return vae_bytes(torch.float32, self.module.config.block_out_channels, latents.shape[0],
                         latents.shape[2] * latents.shape[3] * scale)

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        image = self.module.decode(torch.cat([latents for (latents,) in calls])).sample
        return list(image.split([call[0].shape[0] for call in calls]))

