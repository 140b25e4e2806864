"""The image architectures a Cake master can send a worker components of (`--image-model-arch`),
one row each (torch-free): each component's name (as topology entries spell it), the input its
SingleOp carries and the class that computes it (named by its module, which only a device
imports), and where the architecture's files are (its locator, locator.py).

A component takes either token ids (`Tokens`: U32 [b, L]) or Cake's `pack_tensors` vector
(`Packed`: F32 [total], wire/packing.py) of a fixed number of tensors with fixed ranks, as
Cake's master packs them (docs/models.md, Image components):

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


@dataclass(frozen=True)
class Tokens:
    """U32 token ids [b, L], 1 <= b <= MAX_TOKEN_ROWS, 1 <= L <= MAX_TOKENS."""


@dataclass(frozen=True)
class Packed:
    """A pack of tensors of these ranks (any of `ranks`: FLUX.1's guidance is optional)."""

    ranks: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]  # what each tensor is, for errors

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


_SD = Arch("sd", "cakemp.model.image.sd", sd_files.locate, "{version} standard (as Cake hard-codes it)", {
    "clip": Served(Tokens(), "Clip"),
    "clip2": Served(Tokens(), "Clip"),
    "unet": Served(Packed(((4, 3, 1),), ("latents [2b,4,h,w]", "text embeddings [2b,L,D]", "timestep [1]")), "UNet"),
    "vae": Served(Packed(((1, 4),), ("direction [1]", "image [b,3,H,W] or latents [b,4,h,w]")), "Vae"),
})
_FLUX = Arch("flux", "cakemp.model.image.flux", flux_files.locate, "its snapshot's config.json", {
    "flux_text_encoder": Served(Tokens(), "FluxTextEncoder"),
    "flux_transformer": Served(Packed(((3, 3, 3, 3, 1),), ("img", "img_ids", "txt", "txt_ids", "timestep")),
                               "FluxTransformer"),
    "flux_vae": Served(Packed(((1, 3), (1, 4)), ("dims [2] (or direction [1])", "latents [1,S,128] (or [1,32,H,W])")),
                       "FluxVae"),
})
_FLUX1 = Arch("flux1", "cakemp.model.image.flux1", flux_files.locate_flux1,
              "the checkpoint's tensor shapes, heads and RoPE axes as Cake's Config::dev", {
    "flux1_transformer": Served(Packed(((3, 3, 3, 3, 1, 2), (3, 3, 3, 3, 1, 2, 1)),
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
