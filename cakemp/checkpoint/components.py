"""The image components a Cake master can send a worker, by `--image-model-arch`: each one's
name (as topology entries spell it) and the input its SingleOp carries (torch-free).

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

from dataclasses import dataclass

from cakemp.errors import ConfigError

ARCHS = ("sd", "flux", "flux1")  # --image-model-arch, as Cake spells it
MODEL_TYPES = ("text-model", "image-model")  # --model-type (Cake's audio-model is not served)
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

COMPONENTS: dict[str, dict[str, Input]] = {
    "sd": {
        "clip": Tokens(),
        "clip2": Tokens(),
        "unet": Packed(((4, 3, 1),), ("latents [2b,4,h,w]", "text embeddings [2b,L,D]", "timestep [1]")),
        "vae": Packed(((1, 4),), ("direction [1]", "image [b,3,H,W] or latents [b,4,h,w]")),
    },
    "flux": {
        "flux_text_encoder": Tokens(),
        "flux_transformer": Packed(((3, 3, 3, 3, 1),), ("img", "img_ids", "txt", "txt_ids", "timestep")),
        "flux_vae": Packed(((1, 3), (1, 4)), ("dims [2] (or direction [1])", "latents [1,S,128] (or [1,32,H,W])")),
    },
    "flux1": {
        "flux1_transformer": Packed(((3, 3, 3, 3, 1, 2), (3, 3, 3, 3, 1, 2, 1)),
                                    ("img", "img_ids", "txt", "txt_ids", "timesteps", "y", "guidance")),
    },
}


def check_components(arch: str, names: tuple[str, ...], sd_version: str) -> None:
    """Refuse (ConfigError) a topology entry naming what `arch` has no component for, as Cake's
    worker refuses it at load ("Model name not recognized")."""
    known = COMPONENTS[arch]
    for name in names:
        if name not in known:
            raise ConfigError(f"Model name not recognized: {name!r} is no {arch} component (they are: "
                              f"{', '.join(known)})")
    if "clip2" in names and sd_version not in ("xl", "turbo"):
        raise ConfigError(f"clip2 is the second text encoder of SDXL and Turbo; --sd-version {sd_version} has none")
