"""What a `--model` argument names, found on this machine (torch-free; every command asks here).

The rule, in order:

1. An existing path is a path, whatever it looks like (as Cake and transformers decide): a
   directory holding both `model/` and `topology.yml` is a `cake split` bundle (the checkpoint
   is `model/`, the topology `topology.yml`); any other directory is the checkpoint itself. (A
   file is passed on as it is: a `.gguf` file is told apart by `files.container_of`.)
2. Otherwise `org/name` or `org/name@revision` (exactly one slash, neither part empty nor
   starting with "." or "~", as Cake's `looks_like_hf_repo`) is a Hugging Face repository id:
   its snapshot is looked up in the hub cache as huggingface_hub lays it out,
   `<cache>/models--org--name/snapshots/<commit>/`, the commit read from `refs/<revision>`
   (default `main`) or given as the revision itself.
3. Otherwise `org/name[@revision]/path/in/repo.gguf` is one GGUF file of such a repository (the
   way GGUF models are published: one repository, a file per quantization), spelt as
   huggingface_hub's HfFileSystem spells a file (`hf://org/name@revision/path`); the revision
   is then one segment (a branch, tag or commit without "/") or, as HfFileSystem reads it, a
   pull request's `refs/pr/N`. It is that file of the snapshot. (Tried before 2, which would
   read `@v1/file.gguf` as a revision with a slash.)
   Cake takes no such id (its `looks_like_hf_repo` wants exactly one slash). One part of a split
   GGUF (`name-00001-of-00003.gguf`) is refused by its name, before anything is fetched.
4. Anything else is a path, which does not exist: it fails where the checkpoint is first read
   (its config.json "does not exist"), as a directory always has.

The cache is the first of $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub,
$XDG_CACHE_HOME/huggingface/hub and ~/.cache/huggingface/hub, as huggingface_hub reads them.
Fetching what a snapshot lacks is `checkpoint/hub.py`'s.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cakemp.checkpoint.files import CONFIG, container_of
from cakemp.errors import ConfigError

BUNDLE_MODEL = "model"  # what `cake split` names a bundle's checkpoint folder and topology file
BUNDLE_TOPOLOGY = "topology.yml"
DEFAULT_REVISION = "main"
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A revision names a branch, tag or commit: no path component may climb out of refs/.
_REVISION = re.compile(r"[A-Za-z0-9._\-/]+")
# org/name[@revision]/file: the revision one segment or, as HfFileSystem reads it, a pull request's refs/pr/N.
_REPOSITORY_FILE = re.compile(r"(?P<repository>[^/@]+/[^/@]+(?:@(?:refs/pr/\d+|[^/]+))?)/(?P<file>.+)")
# One part of a GGUF file split by llama-gguf-split, which cakemp does not load (gguf_model.hf_config).
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf")


@dataclass(frozen=True)
class Repository:
    """A Hugging Face model repository at a revision, and the hub cache it is looked up in."""

    repo_id: str  # "org/name"
    revision: str  # a branch, tag or commit
    cache: Path

    @property
    def folder(self) -> Path:
        """The repository's folder in the cache: models--org--name."""
        return self.cache / ("models--" + self.repo_id.replace("/", "--"))

    def commit(self) -> str | None:
        """The commit the revision names in the cache (refs/<revision>, or the revision itself); None if unknown."""
        if _COMMIT.fullmatch(self.revision):
            return self.revision
        try:
            commit = (self.folder / "refs" / self.revision).read_text().strip()
        except OSError:
            return None
        return commit if _COMMIT.fullmatch(commit) else None

    def snapshot(self) -> Path | None:
        """The snapshot folder of the revision's commit, when the cache holds one."""
        commit = self.commit()
        path = None if commit is None else self.folder / "snapshots" / commit
        return path if path is not None and path.is_dir() else None

    def __str__(self) -> str:
        return self.repo_id if self.revision == DEFAULT_REVISION else f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class ModelSource:
    """What a --model argument names: the checkpoint, a directory or a GGUF file (None: a
    repository's snapshot, or its file, that the cache does not hold yet), a bundle's topology
    file, the repository it came from and the file of it named (a GGUF; None: the snapshot)."""

    path: Path | None
    topology: Path | None = None
    repository: Repository | None = None
    filename: str | None = None

    def checkpoint(self) -> Path:
        """The checkpoint's path; a ConfigError when a repository's snapshot or file is not in the cache."""
        if self.path is None:
            assert self.repository is not None
            what = str(self.repository) if self.filename is None else f"{self.repository}: {self.filename}"
            raise ConfigError(f"{what} is not in the Hugging Face cache {self.repository.cache}")
        return self.path


def locate(argument: str) -> ModelSource:
    """The ModelSource `argument` names, by the module's rule; a ConfigError for a bundle without config.json."""
    path = Path(argument).expanduser()
    if path.exists():
        return _bundle(path) if (path / BUNDLE_MODEL).is_dir() and (path / BUNDLE_TOPOLOGY).is_file() \
            else ModelSource(path)
    in_repository = parse_repository_file(argument)  # first: org/name@rev/file.gguf would pass as a revision
    if in_repository is not None:
        return _repository_file(*in_repository)
    repository = parse_repository(argument)
    if repository is None:
        return ModelSource(path)
    return ModelSource(repository.snapshot(), repository=repository)


def _repository_file(repository: Repository, filename: str) -> ModelSource:
    """A GGUF file of `repository`: the snapshot's when the cache holds it; one part of a split file refused."""
    if _SPLIT_PART.search(filename):
        raise ConfigError(f"{repository}: {filename} is one part of a split GGUF file, which cakemp does not load "
                          "(merge the parts first: llama-gguf-split --merge)")
    snapshot = repository.snapshot()
    cached = None if snapshot is None or not (snapshot / filename).is_file() else snapshot / filename
    return ModelSource(cached, repository=repository, filename=filename)


def _bundle(path: Path) -> ModelSource:
    """A `cake split` bundle: its model/ folder (which must hold config.json, which split does not write)."""
    model = path / BUNDLE_MODEL
    if not (model / CONFIG).is_file():
        raise ConfigError(f"bundle {path}: {model / CONFIG} is missing (cake split does not write it: copy the "
                          f"model's {CONFIG} into {model})")
    return ModelSource(model, topology=path / BUNDLE_TOPOLOGY)


def parse_repository(argument: str) -> Repository | None:
    """`org/name[@revision]` as a Repository in this machine's hub cache; None when it is not one."""
    name, _, revision = argument.partition("@")
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or argument.startswith((".", "~")) or "@" in revision:
        return None
    if any(part.startswith(".") for part in parts) or any(c.isspace() for c in argument):
        return None
    revision = revision or DEFAULT_REVISION
    if not _REVISION.fullmatch(revision) or ".." in revision.split("/") or revision.startswith("/"):
        return None
    return Repository(name, revision, hub_cache())


def parse_repository_file(argument: str) -> tuple[Repository, str] | None:
    """`org/name[@revision]/path/in/repo.gguf` as the Repository and the file's path in it; None
    when it is not one (a name not ending in .gguf, or a path part that is empty, "." or "..")."""
    match = _REPOSITORY_FILE.fullmatch(argument)
    if match is None:
        return None
    repository = parse_repository(match["repository"])
    filename = match["file"]
    if repository is None or not container_of(filename).is_file or any(part in ("", ".", "..") for part in filename.split("/")) \
            or "\\" in filename or any(c.isspace() for c in filename):
        return None
    return repository, filename


def hub_cache(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """The hub cache huggingface_hub uses under `environ`."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(variable):
            return Path(environ[variable]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    cache_home = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path("~/.cache").expanduser()
    return cache_home / "huggingface" / "hub"
