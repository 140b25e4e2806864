"""The image architectures a Cake master can send a worker components of (`--image-model-arch`),
one row each (torch-free): each component's name (as topology entries spell it), the input its
SingleOp carries and the class that computes it (named by its module, which only a device
imports), and where the architecture's files are (its locator, locator.py).

A component takes either token ids (`Tokens`: U32 [b, L]) or Cake's `pack_tensors` vector
(`Packed`: F32 [total], wire/packing.py) of a fixed number of tensors with fixed ranks, as
Cake's master packs them (docs/models.md, Image components), each dim at most its limit here (the
batch, text length and sides: what bounds one call's cost before the device's budget does;
channels and widths the device checks against the component's config):

| arch  | component          | input                                                              |
|-------|--------------------|--------------------------------------------------------------------|
| sd    | clip, clip2        | U32 ids [1, 77]                                                    |
| sd    | unet               | [latents [2b,4,h,w], text embeddings [2b,77,D], timestep [1]]      |
| sd    | vae                | [direction [1] (1 encode, 0 decode), image [b,3,H,W] or latents]   |
| flux  | flux_text_encoder  | U32 ids [1, 512] (index_pos: the real token count)                 |
| flux  | flux_transformer   | [img [1,S,128], img_ids [1,S,4], txt [1,512,7680], txt_ids, t [1]] |
| flux  | flux_vae           | [dims [2], latents [1,S,128]]                                      |
| flux1 | flux1_transformer  | [img, img_ids, txt, txt_ids, timesteps [1], y [1,768], guidance?]  |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cakemp.checkpoint.image import flux_files, sd_files
from cakemp.checkpoint.image.locator import Locator
from cakemp.errors import ConfigError

MODEL_TYPES = ("text-model", "image-model", "audio-model")  # --model-type
# The most token ids one call may carry (FLUX.2's text encoder takes 512; a CLIP 77).
MAX_TOKENS = 1024
MAX_TOKEN_ROWS = 8
# The most images (or latents) one packed call may carry: Cake's master sends 1 to a VAE and 2
# (unguided and guided) to a UNet; the device then bounds what the call costs (compute/components.py).
MAX_IMAGE_BATCH = 8
# The largest image side a call may ask for, in pixels; a latent side is at most MAX_SIDE // 8.
MAX_SIDE = 4096
MAX_LATENT_SIDE = MAX_SIDE // 8
# The most image and text tokens of one FLUX transformer call (a 4096² image is 65536 tokens).
MAX_IMAGE_TOKENS = 65536
MAX_TEXT_TOKENS = 4096


@dataclass(frozen=True)
class Tokens:
    """U32 token ids [b, L], 1 <= b <= MAX_TOKEN_ROWS, 1 <= L <= MAX_TOKENS."""


Limits = tuple[int | None, ...]  # the most each dim of one tensor may be (None: the device checks it)


@dataclass(frozen=True)
class Packed:
    """A pack of tensors, each dim at most its limit; `forms`: the limits of each tensor of each form the
    pack may take (FLUX.1's guidance is optional), whose lengths are the tensors' ranks."""

    forms: tuple[tuple[Limits, ...], ...]
    names: tuple[str, ...]  # what each tensor is, for errors

    @property
    def ranks(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(len(limits) for limits in form) for form in self.forms)

    def describe(self) -> str:
        return "[" + ", ".join(self.names) + "]"


Input = Tokens | Packed


@dataclass(frozen=True)
class Served:
    """One component of an architecture: the input its call carries, and the class computing it."""

    input: Input
    cls: str  # the class's name in the architecture's model module


@dataclass(frozen=True)
class Arch:
    """One image architecture: adding one is a model module (cakemp/model/image/) and a row here,
    and a locator only if its files are laid out in a new way."""

    name: str  # --image-model-arch, as Cake spells it
    module: str  # the model module computing its components
    locate: Locator
    # Where a component whose locator found no config.json has its architecture from, for the log
    # ({version}: --sd-version).
    standard: str
    components: Mapping[str, Served]


# The limits of the tensors Cake packs (None: a width or channel count, checked by the device).
_IMAGES = (MAX_IMAGE_BATCH, None, MAX_SIDE, MAX_SIDE)  # [b, C, H, W] pixels (or latents, a VAE's side each)
_LATENTS = (MAX_IMAGE_BATCH, None, MAX_LATENT_SIDE, MAX_LATENT_SIDE)  # [b, C, h, w]
_IMAGE_ROWS = (1, MAX_IMAGE_TOKENS, None)  # a FLUX transformer's img or img_ids [1, S, ·]
_TEXT_ROWS = (1, MAX_TEXT_TOKENS, None)  # its txt or txt_ids [1, L, ·]
_SCALAR = (1,)
_FLUX1_FORM = (_IMAGE_ROWS, _IMAGE_ROWS, _TEXT_ROWS, _TEXT_ROWS, _SCALAR, (1, None))

_SD = Arch("sd", "cakemp.model.image.sd", sd_files.locate, "{version} standard (as Cake hard-codes it)", {
    "clip": Served(Tokens(), "Clip"),
    "clip2": Served(Tokens(), "Clip"),
    "unet": Served(Packed(((_LATENTS, (MAX_IMAGE_BATCH, MAX_TOKENS, None), _SCALAR),),
                          ("latents [2b,4,h,w]", "text embeddings [2b,L,D]", "timestep [1]")), "UNet"),
    "vae": Served(Packed(((_SCALAR, _IMAGES),), ("direction [1]", "image [b,3,H,W] or latents [b,4,h,w]")), "Vae"),
})
_FLUX = Arch("flux", "cakemp.model.image.flux", flux_files.locate, "its snapshot's config.json", {
    "flux_text_encoder": Served(Tokens(), "FluxTextEncoder"),
    "flux_transformer": Served(Packed(((_IMAGE_ROWS, _IMAGE_ROWS, _TEXT_ROWS, _TEXT_ROWS, _SCALAR),),
                                      ("img", "img_ids", "txt", "txt_ids", "timestep")), "FluxTransformer"),
    "flux_vae": Served(Packed((((2,), (MAX_IMAGE_BATCH, MAX_IMAGE_TOKENS, None)), (_SCALAR, _LATENTS)),
                              ("dims [2] (or direction [1])", "latents [1,S,128] (or [1,32,H,W])")), "FluxVae"),
})
_FLUX1 = Arch("flux1", "cakemp.model.image.flux1", flux_files.locate_flux1,
              "the checkpoint's tensor shapes, heads and RoPE axes as Cake's Config::dev", {
    "flux1_transformer": Served(Packed((_FLUX1_FORM, (*_FLUX1_FORM, _SCALAR)),
                                       ("img", "img_ids", "txt", "txt_ids", "timesteps", "y", "guidance")),
                                "Flux1Transformer"),
})
ARCHS: dict[str, Arch] = {arch.name: arch for arch in (_SD, _FLUX, _FLUX1)}


def check_components(arch: str, names: tuple[str, ...], sd_version: str) -> None:
    """Refuse (ConfigError) a topology entry naming what `arch` has no component for, as Cake's
    worker refuses it at load ("Model name not recognized")."""
    known = ARCHS[arch].components
    for name in names:
        if name not in known:
            raise ConfigError(f"Model name not recognized: {name!r} is no {arch} component (they are: "
                              f"{', '.join(known)})")
    if "clip2" in names and sd_version not in ("xl", "turbo"):
        raise ConfigError(f"clip2 is the second text encoder of SDXL and Turbo; --sd-version {sd_version} has none")
