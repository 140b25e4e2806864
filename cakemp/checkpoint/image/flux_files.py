"""Where a FLUX component's files are (torch-free).

FLUX.1 (`locate_flux1`): Cake's worker takes --model as the single-file checkpoint itself
(flux1-dev-fp8.safetensors) and never downloads it; so does cakemp.

FLUX.2-klein (`locate`):

Cake's worker takes `--model` as the hub repository (black-forest-labs/FLUX.2-klein-4B) and
reads it from the cache `dirs::cache_dir()/hub`, which on Linux is `~/.cache/hub`, not HF's own
`~/.cache/huggingface/hub`. cakemp looks in both (Cake's first), and also takes `--model` as a
directory laid out like a snapshot. The files are the ones Cake fetches: the text encoder's
two shards and its config.json under `text_encoder/`, `transformer/diffusion_pytorch_model.safetensors`, the VAE's
`vae/diffusion_pytorch_model.safetensors` (with the snapshot's config.json files, which Cake
does not read: it hard-codes klein's transformer and decoder).
"""

from __future__ import annotations

import os
from pathlib import Path

from cakemp.checkpoint.image.locator import ImageFlags, Located
from cakemp.checkpoint.image.sd_files import snapshot_holding
from cakemp.errors import ConfigError

# component -> (the file whose presence marks a snapshot holding it, the directory its weights are in)
FILES = {"flux_text_encoder": ("text_encoder/config.json", "text_encoder"),
         "flux_transformer": ("transformer/config.json", "transformer"), "flux_vae": ("vae/config.json", "vae")}


def cache_roots() -> tuple[Path, ...]:
    """The caches a FLUX component is looked for in: Cake's, then HF's."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    hf = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME") or cache / "huggingface") / "hub")
    return cache / "hub", hf


def locate(component: str, flags: ImageFlags) -> Located:
    """FLUX.2's `component` of --model: the directory holding its weights (shards) and its config.json.
    Raises ConfigError."""
    marker, folder = FILES[component]
    model = flags.model
    if (Path(model) / marker).is_file():
        return _snapshot_folder(Path(model) / folder)
    for hub in cache_roots():
        snapshot = snapshot_holding(hub, model, marker)
        if snapshot is not None:
            return _snapshot_folder(snapshot / folder)
    roots = " or ".join(str(root) for root in cache_roots())
    raise ConfigError(f"{model}/{marker} is neither a directory's nor in the HF cache at {roots} (a cakemp node "
                      f"never downloads: fetch it with `hf download {model} --include '{folder}/*'`)")


def _snapshot_folder(folder: Path) -> Located:
    return Located(folder, folder / "config.json", "snapshot")


def locate_flux1(component: str, flags: ImageFlags) -> Located:
    """The single-file FLUX.1 checkpoint --model names; the architecture comes from its tensors'
    shapes. Raises ConfigError."""
    model = flags.model
    if not Path(model).is_file():
        raise ConfigError(f"--model {model}: no such file (FLUX.1's transformer is read from the single-file "
                          "checkpoint, such as flux1-dev-fp8.safetensors, that --model names, as Cake's worker)")
    return Located(Path(model), None, "tensor shapes")
