"""FLUX.1's `flux1_transformer` as a Cake worker serves it (--image-model-arch flux1).

The weights are the single-file checkpoint Cake's worker takes as --model (flux1-dev-fp8.safetensors,
Comfy's format: the transformer under `model.diffusion_model.`, beside CLIP, T5 and the VAE, which
are not read), in BFL's original key names, its matrices float8_e4m3fn without scales. They are
renamed to diffusers' FluxTransformer2DModel's names (`diffusers_name`) and dequantized on load to the
compute dtype (as Cake's Fp8Linear does; keeping them FP8 for the GPU's FP8 matmul is not done).

The architecture is read from the tensors' shapes (width, depth, channels, text and pooled widths,
whether guidance is embedded); the heads are 128 wide with RoPE axes (16, 56, 56), as Cake's
`Config::dev` hard-codes them, and the MLP 4 times the width (diffusers' only ratio).

A call is Cake's pack of [img [1, S, C], img_ids [1, S, 3], txt [1, L, T], txt_ids [1, L, 3],
timesteps [1], y [1, P], guidance [1]?] (guidance only where the checkpoint embeds it: FLUX.1-dev;
schnell's, which does not, ignores one). The timestep is a sigma in [0, 1] and the guidance the
scale (3.5), both multiplied by 1000 inside, as candle's timestep_embedding does. The reply is the
velocity [1, S, C] in BF16, as Cake's; the computation is in bf16 (Cake casts everything to BF16)
unless --dtype f32. Calls batch together when their shapes and position ids agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from safetensors import SafetensorError, safe_open

from cakemp.errors import CheckpointError
from cakemp.model.image.component import Component, Files
from cakemp.model.image.flux import FluxTransformer, _check

PREFIX = "model.diffusion_model."  # the transformer's tensors in Comfy's single-file checkpoint
HEAD_DIM = 128
AXES = (16, 56, 56)  # RoPE dimensions of (index, row, column), Cake's Config::dev; they add up to HEAD_DIM
MLP_RATIO = 4

# BFL's name (after the block index) -> diffusers' (after its block prefix): the one-to-one renames.
EMBEDDERS = {"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
             "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
             "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
             "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
             "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
             "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
             "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2"}
DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
          "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
          "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
          "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
          "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
          "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
          "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out",
          "norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}
# BFL's fused projections -> the diffusers matrices they stack (on the output rows), in order.
FUSED_DOUBLE = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
FUSED_SINGLE = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}


def _renamed(name: str, table: dict[str, str], prefix: str) -> str | None:
    """`name` (BFL's, block index stripped, ending .weight/.bias/.scale) in diffusers' naming, or None."""
    for bfl, ours in table.items():
        if name == bfl or name.startswith(bfl + "."):
            return prefix + ours + name[len(bfl):]
    return None


def _split(name: str, tensor: torch.Tensor, table: dict[str, tuple[str, ...]], prefix: str,
           width: int) -> dict[str, torch.Tensor] | None:
    """A fused projection's rows [3·W (+ 4·W)] cut into its diffusers matrices, or None if `name` is no fused one."""
    for bfl, parts in table.items():
        if name.startswith(bfl + "."):
            kind = name[len(bfl):]  # .weight or .bias
            sizes = [width] * 3 + [tensor.shape[0] - 3 * width] * (len(parts) - 3)
            if min(sizes) <= 0 or sum(sizes) != tensor.shape[0]:
                raise CheckpointError(f"FLUX.1 checkpoint: {name} has {tensor.shape[0]} rows, not {len(parts)} "
                                      f"projections of a {width}-wide model")
            return {prefix + part + kind: piece for part, piece in zip(parts, tensor.split(sizes), strict=True)}
    return None


def diffusers_state(bfl: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """BFL's FLUX.1 tensors (no prefix) renamed to FluxTransformer2DModel's. Raises CheckpointError on one
    it has no name for. The final layer's modulation is (shift, scale) in BFL's order, (scale, shift) in
    diffusers' AdaLayerNormContinuous: its halves are swapped."""
    state = {}
    for name, tensor in bfl.items():
        block, _, rest = name.partition(".")
        if name.startswith("final_layer.adaLN_modulation.1."):
            shift, scale = tensor.chunk(2)
            state["norm_out.linear" + name[len("final_layer.adaLN_modulation.1"):]] = torch.cat([scale, shift])
            continue
        if block in ("double_blocks", "single_blocks"):
            index, _, rest = rest.partition(".")
            ours = "transformer_blocks" if block == "double_blocks" else "single_transformer_blocks"
            prefix = f"{ours}.{index}."
            table, fused = (DOUBLE, FUSED_DOUBLE) if block == "double_blocks" else (SINGLE, FUSED_SINGLE)
            parts = _split(rest, tensor, fused, prefix, width)
            if parts is not None:
                state.update(parts)
                continue
            renamed = _renamed(rest, table, prefix)
        else:
            renamed = _renamed(name, EMBEDDERS, "")
        if renamed is None:
            raise CheckpointError(f"FLUX.1 checkpoint: no FluxTransformer2DModel tensor for {name}")
        state[renamed] = tensor
    return state


def _read(path: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The transformer's tensors of the single file (prefixed `model.diffusion_model.`, or a bare BFL file),
    each on the device in `dtype` as it is read (FP8 dequantized there: no f32 copy of the whole model)."""
    try:
        with safe_open(path, "pt") as stored:
            keys = list(stored.keys())
            prefix = PREFIX if any(key.startswith(PREFIX) for key in keys) else ""
            if prefix + "img_in.weight" not in keys:  # refused before reading what may be another model's gigabytes
                raise CheckpointError(f"{path} holds no FLUX.1 transformer (no {PREFIX}img_in.weight)")
            return {key[len(prefix):]: stored.get_tensor(key).to(device).to(dtype)
                    for key in keys if key.startswith(prefix)}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read the FLUX.1 checkpoint {path}: {e}") from None


def _config(bfl: dict[str, torch.Tensor], path: Path) -> dict:
    """FluxTransformer2DModel's config from the tensors' shapes. Raises CheckpointError."""
    try:
        width, channels = bfl["img_in.weight"].shape
        head = bfl["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
        mlp = bfl["double_blocks.0.img_mlp.0.weight"].shape[0]
        config = {"in_channels": channels, "attention_head_dim": head, "num_attention_heads": width // head,
                  "joint_attention_dim": bfl["txt_in.weight"].shape[1],
                  "pooled_projection_dim": bfl["vector_in.in_layer.weight"].shape[1],
                  "guidance_embeds": "guidance_in.in_layer.weight" in bfl, "axes_dims_rope": AXES,
                  "num_layers": 1 + max(int(k.split(".")[1]) for k in bfl if k.startswith("double_blocks.")),
                  "num_single_layers": 1 + max(int(k.split(".")[1]) for k in bfl if k.startswith("single_blocks."))}
    except (KeyError, ValueError, IndexError) as e:
        raise CheckpointError(f"{path} holds no FLUX.1 transformer (under {PREFIX}): {e!r}") from None
    if head != HEAD_DIM or width % head or mlp != MLP_RATIO * width:
        raise CheckpointError(f"{path}: heads {head} wide (FLUX.1's are {HEAD_DIM}), width {width}, MLP {mlp} "
                              f"(FLUX.1's is {MLP_RATIO} times the width)")
    return config


class Flux1Transformer(Component):
    """`flux1_transformer`: (img, img_ids, txt, txt_ids, timesteps, y[, guidance]) -> velocity [1, S, C] in BF16."""

    def __init__(self, name: str, files: Files, version: str, device: torch.device, dtype: torch.dtype):
        self.dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        path = Path(files.weights)
        bfl = _read(path, device, self.dtype)
        config = _config(bfl, path)
        state = diffusers_state(bfl, config["attention_head_dim"] * config["num_attention_heads"])
        del bfl
        with torch.device("meta"):  # no random initialisation: every parameter is the checkpoint's
            self.module = FluxTransformer2DModel(**config)
        try:
            self.module.load_state_dict(state, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{path}: the FLUX.1 transformer does not fit its shapes: {e}") from None
        self.module.eval()
        self.config = self.module.config
        self.name, self.device = name, device

    def prepare(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None) -> tuple[torch.Tensor, ...]:
        c = self.config
        _check(img.shape[2] == c.in_channels and txt.shape[2] == c.joint_attention_dim
               and tuple(y.shape) == (1, c.pooled_projection_dim),
               f"flux1_transformer: img [1, S, {c.in_channels}], txt [1, L, {c.joint_attention_dim}] and y "
               f"[1, {c.pooled_projection_dim}], got {list(img.shape)}, {list(txt.shape)} and {list(y.shape)}")
        _check(img.shape[0] == txt.shape[0] == 1 and tuple(img_ids.shape) == (1, img.shape[1], 3)
               and tuple(txt_ids.shape) == (1, txt.shape[1], 3),
               "flux1_transformer: one image, its ids [1, S, 3] and the text's [1, L, 3]")
        _check(img.shape[1] <= 65536 and txt.shape[1] <= 4096, "flux1_transformer: at most 65536 image and 4096 "
               "text tokens")
        if c.guidance_embeds:
            _check(guidance is not None, "flux1_transformer: this checkpoint embeds guidance (FLUX.1-dev): the pack "
                   "needs the guidance [1] as its 7th tensor")
        scalars = (timesteps,) if guidance is None else (timesteps, guidance)
        _check(all(s.numel() == 1 for s in scalars) and all(bool(torch.isfinite(t).all()) for t in
               (*scalars, y, img_ids, txt_ids)), "flux1_transformer: the timestep and guidance are one finite "
               "number each, y and the position ids finite")
        to = {"device": self.device, "dtype": self.dtype}
        kept = guidance if c.guidance_embeds else torch.zeros(1)  # schnell's: no guidance embedder reads it
        return (img.to(**to), img_ids[0].to(self.device), txt.to(**to), txt_ids[0].to(self.device),
                timesteps.reshape(1).to(**to), y.to(**to), kept.reshape(1).to(**to))

    group = staticmethod(FluxTransformer.group)  # shapes and position ids, as FLUX.2's: one set of ids per batch
    cost = FluxTransformer.cost  # over the joint sequence, as FLUX.2's

    def run(self, calls: Sequence[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        # The batch's img [b, S, C], txt [b, L, T], timesteps [b], y [b, P], guidance [b]; one set of ids (group).
        img, txt, timesteps, y, guidance = (torch.cat([call[i] for call in calls]) for i in (0, 2, 4, 5, 6))
        velocity = self.module(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y,
                               timestep=timesteps, img_ids=calls[0][1], txt_ids=calls[0][3],
                               guidance=guidance if self.config.guidance_embeds else None).sample
        return list(velocity.to(torch.bfloat16).split(1))

