"""Tiny Stable Diffusion components for tests and benchmarks: diffusers and transformers modules
built from small configs with random weights, written in the HF cache layout Cake resolves
(`<root>/hub/models--runwayml--stable-diffusion-v1-5/snapshots/<rev>/…`, f16 files, each with its
config.json), and the oracle: the same library modules loaded from those files in-process,
with Cake's deviations (candle's tanh GELU) applied. No download.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.activations import GEGLU
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, Qwen3Config, Qwen3Model

from cakemp.wire import DType, RawTensor

REPOSITORY = "runwayml/stable-diffusion-v1-5"
REVISION = "0123456789abcdef0123456789abcdef01234567"
# "gelu" as the hub's SD 2.1 config writes it: Cake computes its tanh approximation.
CLIP = {"vocab_size": 1000, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 77, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
UNET = {"sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1, "block_out_channels": [32, 64],
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": 32, "attention_head_dim": 4, "norm_num_groups": 8}
VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [16, 32], "layers_per_block": 1,
       "norm_num_groups": 8, "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2}
SUBFOLDERS = {"clip": ("text_encoder", "model.fp16.safetensors"),
              "unet": ("unet", "diffusion_pytorch_model.fp16.safetensors"),
              "vae": ("vae", "diffusion_pytorch_model.fp16.safetensors")}
LATENT = (4, 8, 8)  # one image's latents: 16x16 pixels through the tiny VAE
VAE_SCALE = 0.18215


def _modules() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {"clip": CLIPTextModel(CLIPTextConfig(**CLIP)), "unet": UNet2DConditionModel(**UNET),
            "vae": AutoencoderKL(**VAE)}


def _configs() -> dict[str, dict]:
    return {"clip": CLIP, "unet": UNET, "vae": VAE}


def write_cache(root: Path) -> Path:
    """The tiny components in the HF cache layout under `root` (the node's --model); returns the snapshot."""
    repo = root / "hub" / ("models--" + REPOSITORY.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    for name, module in _modules().items():
        subfolder, file = SUBFOLDERS[name]
        (snapshot / subfolder).mkdir(parents=True)
        prefix = "text_model." if name == "clip" else ""  # as the hub's text encoder files name them
        state = {prefix + key: value.to(torch.float16).contiguous() for key, value in module.state_dict().items()}
        save_file(state, snapshot / subfolder / file)
        (snapshot / subfolder / "config.json").write_text(json.dumps(_configs()[name]))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


XL_REPOSITORY = "stabilityai/stable-diffusion-xl-base-1.0"
# SDXL's UNet as its hub config has it: with the pooled-text and time-id conditioning Cake skips.
XL_UNET = {**UNET, "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
           "projection_class_embeddings_input_dim": 80}


def write_xl_cache(root: Path) -> Path:
    """An SDXL-like unet (with add_embedding weights) and clip2 (a CLIP with projection) in the HF
    cache layout under `root`; returns the snapshot."""
    snapshot = root / "hub" / ("models--" + XL_REPOSITORY.replace("/", "--")) / "snapshots" / REVISION
    torch.manual_seed(1)
    modules = {"unet": (UNet2DConditionModel(**XL_UNET), XL_UNET, "unet/diffusion_pytorch_model.fp16.safetensors"),
               "clip2": (CLIPTextModelWithProjection(CLIPTextConfig(**CLIP, projection_dim=16)), CLIP,
                         "text_encoder_2/model.fp16.safetensors")}
    for module, config, file in modules.values():
        (snapshot / file).parent.mkdir(parents=True)
        save_file({k: v.to(torch.float16).contiguous() for k, v in module.state_dict().items()}, snapshot / file)
        (snapshot / file).with_name("config.json").write_text(json.dumps(config))
    return snapshot


def xl_oracle(snapshot: Path) -> dict[str, torch.nn.Module]:
    """The XL components as Cake computes them: a UNet without added conditioning (add_embedding
    left unloaded), clip2's text model with the tanh GELU and no projection."""
    unet = UNet2DConditionModel(**UNET)
    for block in unet.modules():
        if isinstance(block, GEGLU):
            block.gelu = types.MethodType(_tanh_gelu, block)
    state = {k: v.float() for k, v in load_file(snapshot / "unet/diffusion_pytorch_model.fp16.safetensors").items()
             if not k.startswith("add_embedding.")}
    unet.load_state_dict(state)
    clip2 = CLIPTextModel(CLIPTextConfig(**{**CLIP, "hidden_act": "gelu_pytorch_tanh"}))
    state = {k.removeprefix("text_model."): v.float()
             for k, v in load_file(snapshot / "text_encoder_2/model.fp16.safetensors").items()
             if k.startswith("text_model.")}
    clip2.load_state_dict(state)
    return {"unet": unet.eval(), "clip2": clip2.eval()}


def _tanh_gelu(self, gate):
    return F.gelu(gate, approximate="tanh")


def oracle(snapshot: Path) -> dict[str, torch.nn.Module]:
    """The components in f32 from the files in `snapshot`, as Cake computes them: CLIP's "gelu" and
    the UNet's GEGLU gate as candle's tanh approximation."""
    clip = CLIPTextModel(CLIPTextConfig(**{**CLIP, "hidden_act": "gelu_pytorch_tanh"}))
    unet = UNet2DConditionModel(**UNET)
    for block in unet.modules():
        if isinstance(block, GEGLU):
            block.gelu = types.MethodType(_tanh_gelu, block)
    modules = {"clip": clip, "unet": unet, "vae": AutoencoderKL(**VAE)}
    for name, module in modules.items():
        subfolder, file = SUBFOLDERS[name]
        module.load_state_dict({k.removeprefix("text_model."): v.float()
                                for k, v in load_file(snapshot / subfolder / file).items()})
        module.eval()
    return modules


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """Cake's pack_tensors: [n, ndim, dims…, data…, …] as one f32 vector."""
    parts = [torch.tensor([float(len(tensors))])]
    for t in tensors:
        parts.append(torch.tensor([float(t.dim()), *map(float, t.shape)]))
        parts.append(t.detach().float().reshape(-1))
    return torch.cat(parts)


def f32(vector: torch.Tensor | list[float]) -> RawTensor:
    """A 1-D f32 vector as a wire tensor (its bytes writable, as a received frame's are)."""
    data = torch.as_tensor(vector, dtype=torch.float32).contiguous()
    return RawTensor(bytearray(data.numpy().tobytes()), DType.F32, (data.numel(),))


def token_ids(ids: list[int] | torch.Tensor, length: int = 77) -> RawTensor:
    """U32 token ids [1, length], padded with the last id, as Cake's master sends them to clip."""
    ids = list(map(int, ids))
    ids = ids + [ids[-1]] * (length - len(ids))
    data = torch.tensor([ids], dtype=torch.int32)
    return RawTensor(bytearray(data.numpy().tobytes()), DType.U32, (1, length))


FLUX_REPOSITORY = "black-forest-labs/FLUX.2-klein-4B"
# A tiny Qwen3 with the layers FLUX.2 reads (8, 17, 26) and one more, which the node never loads.
QWEN3 = {"vocab_size": 500, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 28,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024,
         "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def write_flux_cache(cache: Path) -> Path:
    """FLUX.2-klein's text encoder (tiny, random) as Cake fetches it into `cache/hub` (its
    dirs::cache_dir()/hub): two shards of Qwen3ForCausalLM's weights, their index, the config."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(2)
    folder = cache / "hub" / ("models--" + FLUX_REPOSITORY.replace("/", "--")) / "snapshots" / REVISION / "text_encoder"
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in Qwen3ForCausalLM(Qwen3Config(**QWEN3)).state_dict().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({key: state[key] for key in keys}, folder / file)
    index = {"weight_map": {key: file for file, keys in shards.items() for key in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({**QWEN3, "architectures": ["Qwen3ForCausalLM"]}))
    return folder


FLUX_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [16, 32],
            "layers_per_block": 1, "norm_num_groups": 8, "down_block_types": ["DownEncoderBlock2D"] * 2,
            "up_block_types": ["UpDecoderBlock2D"] * 2}


def write_flux_vae(cache: Path) -> Path:
    """FLUX.2's VAE (tiny, random, its batch-norm statistics too) beside the text encoder; its folder."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(3)
    vae = AutoencoderKLFlux2(**FLUX_VAE)
    vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean))
    vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) + 0.5)
    folder = cache / "hub" / ("models--" + FLUX_REPOSITORY.replace("/", "--")) / "snapshots" / REVISION / "vae"
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, folder / "diffusion_pytorch_model.safetensors")
    (folder / "config.json").write_text(json.dumps(FLUX_VAE))
    return folder


def flux_vae_oracle(folder: Path):
    """`decode(latents [b, h·w, 16], h, w)` as diffusers' Flux2KleinPipeline decodes: batch-norm
    denormalisation, its _unpatchify_latents, the VAE's decode."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline

    vae = AutoencoderKLFlux2(**FLUX_VAE).eval()
    vae.load_state_dict(load_file(folder / "diffusion_pytorch_model.safetensors"))

    def decode(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = latents.reshape(latents.shape[0], h, w, -1).permute(0, 3, 1, 2)  # the tokens' grid
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        x = Flux2KleinPipeline._unpatchify_latents(x * std + vae.bn.running_mean.view(1, -1, 1, 1))
        with torch.no_grad():
            return vae.decode(x).sample

    return decode


FLUX_TRANSFORMER = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 48,
                    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [4, 4, 4, 4],
                    "rope_theta": 2000, "guidance_embeds": False}


def write_flux_transformer(cache: Path) -> Path:
    """FLUX.2's MMDiT (tiny, random: 16 latent channels, text width 48 = the tiny encoder's 3 x 16); its folder."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(4)
    model = Flux2Transformer2DModel(**FLUX_TRANSFORMER)
    folder = cache / "hub" / ("models--" + FLUX_REPOSITORY.replace("/", "--")) / "snapshots" / REVISION / "transformer"
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "diffusion_pytorch_model.safetensors")
    (folder / "config.json").write_text(json.dumps(FLUX_TRANSFORMER))
    return folder


def flux_transformer_oracle(folder: Path):
    """diffusers' Flux2Transformer2DModel in f32 from the folder's file, called as Flux2KleinPipeline calls it."""
    from diffusers import Flux2Transformer2DModel

    model = Flux2Transformer2DModel(**FLUX_TRANSFORMER).eval()
    model.load_state_dict(load_file(folder / "diffusion_pytorch_model.safetensors"))

    def velocity(img, img_ids, txt, txt_ids, t: float) -> torch.Tensor:
        with torch.no_grad():
            return model(hidden_states=img, encoder_hidden_states=txt, timestep=torch.tensor([t]), img_ids=img_ids,
                         txt_ids=txt_ids).sample

    return velocity


def flux_ids(h: int, w: int, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cake's master's position ids: the image's (0, row, column, 0) [1, h·w, 4], the text's (0, 0, 0, i)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zeros = torch.zeros(h * w)
    img_ids = torch.stack([zeros, rows.reshape(-1).float(), cols.reshape(-1).float(), zeros], dim=1)[None]
    txt_ids = torch.stack([torch.zeros(text)] * 3 + [torch.arange(text).float()], dim=1)[None]
    return img_ids, txt_ids


def flux_text_oracle(folder: Path):
    """FLUX.2's text conditioning from transformers' whole Qwen3Model: hidden_states 9, 18 and 27
    (after layers 8, 17, 26), concatenated; `encode(ids, real)` masks the keys past `real` (0: none)."""
    model = Qwen3Model(Qwen3Config(**QWEN3)).eval()
    state = {}
    for shard in folder.glob("*.safetensors"):
        state.update({k.removeprefix("model."): v for k, v in load_file(shard).items() if k.startswith("model.")})
    model.load_state_dict(state)

    def encode(ids: torch.Tensor, real: int = 0) -> torch.Tensor:
        mask = torch.ones_like(ids)
        if 0 < real < ids.shape[1]:
            mask[:, real:] = 0
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        return torch.cat([hidden[9], hidden[18], hidden[27]], dim=-1)

    return encode


# A tiny FLUX.1-dev in BFL's names, as Comfy's single file stores it: FLUX.1's 128-wide heads (one
# of them), 16 latent channels, text 32 wide, pooled 24, guidance embedded; two blocks of each kind.
FLUX1 = {"width": 128, "channels": 16, "text": 32, "pooled": 24, "double": 2, "single": 2}
FLUX1_DEV = {"width": 3072, "channels": 64, "text": 4096, "pooled": 768, "double": 19, "single": 38}  # the real one


def flux1_shapes(guidance: bool, sizes: dict = FLUX1) -> dict[str, tuple[int, ...]]:
    """Every tensor of BFL's FLUX.1 transformer (prefix model.diffusion_model.), with its shape; `guidance`:
    with dev's guidance embedder (schnell has none)."""
    w, mlp = sizes["width"], 4 * sizes["width"]
    linears = {"img_in": (w, sizes["channels"]), "txt_in": (w, sizes["text"]), "time_in.in_layer": (w, 256),
               "time_in.out_layer": (w, w), "vector_in.in_layer": (w, sizes["pooled"]), "vector_in.out_layer": (w, w),
               "final_layer.linear": (sizes["channels"], w), "final_layer.adaLN_modulation.1": (2 * w, w)}
    if guidance:
        linears |= {"guidance_in.in_layer": (w, 256), "guidance_in.out_layer": (w, w)}
    norms = {}
    for i in range(sizes["double"]):
        for stream in ("img", "txt"):
            block = f"double_blocks.{i}.{stream}_"
            linears |= {block + "mod.lin": (6 * w, w), block + "attn.qkv": (3 * w, w), block + "attn.proj": (w, w),
                        block + "mlp.0": (mlp, w), block + "mlp.2": (w, mlp)}
            norms |= {block + "attn.norm.query_norm.scale": (128,), block + "attn.norm.key_norm.scale": (128,)}
    for i in range(sizes["single"]):
        block = f"single_blocks.{i}."
        linears |= {block + "modulation.lin": (3 * w, w), block + "linear1": (3 * w + mlp, w),
                    block + "linear2": (w, w + mlp)}
        norms |= {block + "norm.query_norm.scale": (128,), block + "norm.key_norm.scale": (128,)}
    shapes = {f"{name}.weight": shape for name, shape in linears.items()}
    shapes |= {f"{name}.bias": shape[:1] for name, shape in linears.items()} | norms
    return {"model.diffusion_model." + name: shape for name, shape in shapes.items()}


def write_flux1_checkpoint(path: Path, guidance: bool = True) -> Path:
    """The tiny FLUX.1 as one file: matrices float8_e4m3fn without scales (as flux1-dev-fp8), biases and
    norm scales bf16, beside other components' tensors (Comfy's file holds CLIP, T5 and the VAE too)."""
    generator = torch.Generator().manual_seed(5)
    state = {}
    for name, shape in flux1_shapes(guidance).items():
        values = torch.randn(shape, generator=generator)
        if name.endswith(".scale"):
            state[name] = (1 + 0.1 * values).to(torch.bfloat16)
        elif len(shape) == 2:
            state[name] = (values / shape[1] ** 0.5).to(torch.float8_e4m3fn)
        else:
            state[name] = (0.1 * values).to(torch.bfloat16)
    state["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = torch.ones(8)
    state["vae.decoder.conv_in.weight"] = torch.ones(4, 4, 3, 3)
    save_file(state, path)
    return path


def flux1_converter():
    """diffusers' own BFL -> diffusers conversion, its hard-coded FLUX.1 width (3072, a local) set to the tiny one's."""
    import inspect

    from diffusers.loaders import single_file_utils

    source = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    assert "    inner_dim = 3072\n" in source
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {FLUX1['width']}"), namespace)
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"]


def flux1_transformer_oracle(path: Path, guidance: bool = True):
    """diffusers' FluxTransformer2DModel in f32 from the file, converted by diffusers' converter and
    called as FluxPipeline calls it (timestep the sigma, guidance the scale or None, ids [S, 3] and [L, 3])."""
    from diffusers import FluxTransformer2DModel

    stored = {k: v.float() for k, v in load_file(path).items() if k.startswith("model.diffusion_model.")}
    model = FluxTransformer2DModel(in_channels=FLUX1["channels"], num_layers=FLUX1["double"],
                                   num_single_layers=FLUX1["single"], attention_head_dim=128,
                                   num_attention_heads=FLUX1["width"] // 128, joint_attention_dim=FLUX1["text"],
                                   pooled_projection_dim=FLUX1["pooled"], guidance_embeds=guidance).eval()
    model.load_state_dict(flux1_converter()(stored))

    def velocity(img, img_ids, txt, txt_ids, t: float, y, scale: float | None) -> torch.Tensor:
        with torch.no_grad():
            return model(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y,
                         timestep=torch.tensor([t]), guidance=None if scale is None else torch.tensor([scale]),
                         img_ids=img_ids[0], txt_ids=txt_ids[0]).sample

    return velocity


def flux1_ids(h: int, w: int, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cake's FLUX.1 master's position ids: the image's (0, row, column) [1, h·w, 3], the text's zeros [1, L, 3]."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.zeros(h * w), rows.reshape(-1).float(), cols.reshape(-1).float()], dim=1)[None]
    return img_ids, torch.zeros(1, text, 3)
