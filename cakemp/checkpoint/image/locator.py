"""What an image architecture's file locator is: it reads the node's flags (`ImageFlags`) and says
where one component's weights and config.json are (`Located`), naming what is missing (ConfigError).
A cakemp node never downloads an image component: a locator names the file to fetch instead."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ImageFlags:
    """The flags a locator reads."""

    model: str  # --model: SD's HF cache root, FLUX.2's repository id or directory, FLUX.1's checkpoint file
    sd_version: str = "v1-5"  # --sd-version
    weights: Mapping[str, str | None] = field(default_factory=dict)  # --sd-unet/-vae/-clip/-clip2: component -> file
    config_dir: str | None = None  # --sd-config-dir


@dataclass(frozen=True)
class Located:
    """A component's weight file (or directory of shards) and its config.json (None: the architecture
    comes from elsewhere, see the row's `standard`), and where the config came from, for the log:
    "snapshot", "--sd-config-dir", "standard" or "tensor shapes"."""

    weights: Path
    config: Path | None
    config_source: str


Locator = Callable[[str, ImageFlags], Located]  # (component name, the flags) -> its files
