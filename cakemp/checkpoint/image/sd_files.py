"""Where a Stable Diffusion component's weights and architecture come from (torch-free).

Weights, as Cake's `ModelFile::get` resolves them: an explicit --sd-unet/--sd-vae/--sd-clip/
--sd-clip2 file wins; else the version's hub repository in the HF cache under `<--model>/hub`
(`models--org--name/snapshots/<revision>/<file>`, the revision `refs/main` names, else the
newest snapshot holding the file). Cake always asks for the f16 files (its --sd-use-f16 cannot
be turned off) and, for XL and Turbo, takes the VAE from madebyollin/sdxl-vae-fp16-fix. Cake
downloads what is missing; a cakemp node never downloads, and names the file to fetch instead.

Architecture: the config.json beside the weights in the snapshot (hub repositories have one;
Cake ignores it); else `--sd-config-dir/<subfolder>/config.json`; else the version's standard
configuration as Cake hard-codes it (sd_configs.py).
"""

from __future__ import annotations

from pathlib import Path

from cakemp.checkpoint.image.locator import ImageFlags, Located
from cakemp.errors import ConfigError

SD_VERSIONS = ("v1-5", "v2-1", "xl", "turbo")  # --sd-version, as Cake spells it
REPOSITORIES = {
    "v1-5": "runwayml/stable-diffusion-v1-5",
    "v2-1": "stabilityai/stable-diffusion-2-1",
    "xl": "stabilityai/stable-diffusion-xl-base-1.0",
    "turbo": "stabilityai/sdxl-turbo",
}
XL_VAE_REPOSITORY = "madebyollin/sdxl-vae-fp16-fix"  # Cake's f16 VAE for XL and Turbo
# component -> (subfolder in the repository, weight file there)
FILES = {
    "unet": ("unet", "diffusion_pytorch_model.fp16.safetensors"),
    "vae": ("vae", "diffusion_pytorch_model.fp16.safetensors"),
    "clip": ("text_encoder", "model.fp16.safetensors"),
    "clip2": ("text_encoder_2", "model.fp16.safetensors"),
}
STANDARD = "standard"  # the config source when a version's hard-coded configuration is used


def locate(component: str, flags: ImageFlags) -> Located:
    """Where `component` of SD's --sd-version is: from its --sd-<component> file, else the HF cache
    under --model. Raises ConfigError naming what is missing."""
    subfolder, _ = FILES[component]
    explicit, config_dir = flags.weights.get(component), flags.config_dir
    if explicit:
        weights = Path(explicit)
        if not weights.is_file():
            raise ConfigError(f"--sd-{component} {explicit}: no such file")
        own = None
    else:
        repository, path = hub_file(component, flags.sd_version)
        weights = cached_file(Path(flags.model) / "hub", repository, path)
        own = weights.parent / "config.json"
    if own is not None and own.is_file():
        return Located(weights, own, "snapshot")
    if config_dir:
        given = Path(config_dir) / subfolder / "config.json"
        if given.is_file():
            return Located(weights, given, "--sd-config-dir")
    return Located(weights, None, STANDARD)


def hub_file(component: str, version: str) -> tuple[str, str]:
    """The repository and the file in it that Cake fetches for `component` of `version`."""
    subfolder, name = FILES[component]
    if component == "vae" and version in ("xl", "turbo"):
        return XL_VAE_REPOSITORY, "diffusion_pytorch_model.safetensors"
    return REPOSITORIES[version], f"{subfolder}/{name}"


def cached_file(hub: Path, repository: str, path: str) -> Path:
    """`path` of `repository` in the HF cache at `hub`. Raises ConfigError if it is not there."""
    found = snapshot_holding(hub, repository, path)
    if found is None:
        raise ConfigError(f"{repository}/{path} is not in the HF cache at {hub} (a cakemp node never downloads: "
                          f"fetch it with `HF_HOME={hub.parent} hf download {repository} {path}`, or give the file's "
                          "path)")
    return found / path


def snapshot_holding(hub: Path, repository: str, path: str) -> Path | None:
    """The snapshot of `repository` in the HF cache at `hub` that holds `path` (refs/main's first,
    then the newest), or None."""
    root = hub / ("models--" + repository.replace("/", "--"))
    snapshots = root / "snapshots"
    ref = root / "refs" / "main"
    candidates: list[Path] = []
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    if snapshots.is_dir():
        candidates.extend(sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True))
    for snapshot in candidates:
        if (snapshot / path).is_file():
            return snapshot
    return None
