"""FLUX.1's BFL -> diffusers renaming (cakemp/model/image/flux1.py) against diffusers' own single-file
converter, unmodified, at FLUX.1-dev's real size (19 + 38 blocks, 3072 wide), on the meta device:
every name and shape, no memory. The values are checked through a live node (tests/node/test_flux1_node.py)."""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

from cakemp.model.image.flux1 import diffusers_state
from tests.support.image import FLUX1_DEV, flux1_shapes


def test_the_renaming_is_diffusers_converters_at_flux1_dev_size():
    bfl = {name: torch.empty(shape, device="meta") for name, shape in flux1_shapes(True, FLUX1_DEV).items()}
    expected = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    ours = diffusers_state({name.removeprefix("model.diffusion_model."): t for name, t in bfl.items()}, 3072)
    assert {name: tuple(t.shape) for name, t in ours.items()} == {name: tuple(t.shape) for name, t in expected.items()}
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True)  # FLUX.1-dev's config: diffusers' defaults
    assert set(model.state_dict()) == set(ours)
