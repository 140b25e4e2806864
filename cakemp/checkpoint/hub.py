"""What a repository's snapshot lacks, fetched from the Hugging Face hub (torch-free).

Cake downloads a whole repository; a cakemp worker fetches `config.json`, the index and only
the shards that hold its own layers' tensors (`shards_for`), a master those of the tensors it
computes itself. The downloads go through huggingface_hub (the optional `hub` extra) into the
same cache `locate` reads, so they honour what it honours: HF_HUB_OFFLINE, HF_TOKEN and a stored
token, HF_ENDPOINT. Every file is fetched at the commit the snapshot is of, so all of them land
in one snapshot folder. Whatever goes wrong is one ConfigError line naming the repository and
the cache.

A GGUF file of a repository (`org/name/file.gguf`) is fetched whole, by master and worker alike:
it is one file, its config and tokenizer in its header, so there are no shards to choose among
(a node still reads only its own layers' bytes of it, through a memory map).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path, PurePosixPath

from cakemp.checkpoint.files import CONFIG, INDEX, SINGLE, estimated_layer_bytes, layer_bytes_of, read_weight_map
from cakemp.checkpoint.locate import ModelSource, Repository
from cakemp.errors import CheckpointError, ConfigError

INSTALL_HINT = "pip install 'cakemp[hub]'"


def fetch_metadata(source: ModelSource, required: Iterable[str] = (),
                   optional: Iterable[str] = ()) -> tuple[ModelSource, list[str]]:
    """`source` with config.json, the index (or, where a repository has none, its one weight file)
    and `required` (a master's tokenizer) in its snapshot, and, when config.json had to be fetched
    (the repository is new here), `optional` where the repository has them; the names downloaded.
    A repository's GGUF file is fetched alone, whole (its header holds the config and the
    tokenizer, so `required` and `optional` do not apply). A source that is no repository is
    returned as it is."""
    repository, snapshot = source.repository, source.path
    if repository is None:
        return source, []
    if source.filename is not None:  # one GGUF file, the whole checkpoint
        if snapshot is not None:
            return source, []
        path = _download(repository, source.filename, repository.commit() or repository.revision)
        return replace(source, path=path), [source.filename]
    fetched: list[str] = []
    if snapshot is None or not (snapshot / CONFIG).is_file():
        snapshot = _download(repository, CONFIG, repository.commit() or repository.revision).parent
        fetched.append(CONFIG)
    if not (snapshot / INDEX).is_file() and not (snapshot / SINGLE).is_file():
        weights = INDEX if _download(repository, INDEX, snapshot.name, optional=True) else SINGLE
        if weights == SINGLE:
            _download(repository, SINGLE, snapshot.name)
        fetched.append(weights)
    wanted = [(name, False) for name in required] + [(name, True) for name in optional if CONFIG in fetched]
    for name, may_lack in wanted:
        if not (snapshot / name).is_file() and _download(repository, name, snapshot.name, optional=may_lack):
            fetched.append(name)
    return replace(source, path=snapshot), fetched


def fetch_weights(source: ModelSource, wanted: Callable[[str], bool]) -> list[str]:
    """Download the weight files holding a tensor `wanted` picks that `source`'s snapshot lacks
    (after `fetch_metadata`); the names downloaded. Nothing for a source that is no repository,
    nor for a repository's GGUF file (`fetch_metadata` fetched it whole)."""
    if source.repository is None or source.filename is not None:
        return []
    snapshot = source.checkpoint()
    files = shards_for(read_weight_map(snapshot / INDEX), wanted) if (snapshot / INDEX).is_file() else {SINGLE}
    missing = sorted(name for name in files if not (snapshot / name).is_file())
    for name in missing:
        _download(source.repository, name, snapshot.name)
    return missing


def layer_bytes(source: ModelSource, num_layers: int, prefix: str) -> int:
    """One layer's size as Cake estimates it (`files.estimated_layer_bytes`); for a repository whose
    snapshot lacks some weight file, from the hub's copies of the headers (read by range requests,
    so a node that weighs the layers by memory still downloads only its own shards)."""
    snapshot = source.checkpoint()
    if source.repository is None or source.filename is not None:  # a path, or a GGUF file (here whole)
        return estimated_layer_bytes(snapshot, num_layers, prefix)
    files = set(read_weight_map(snapshot / INDEX).values()) if (snapshot / INDEX).is_file() else {SINGLE}
    if all((snapshot / name).is_file() for name in files):
        return estimated_layer_bytes(snapshot, num_layers, prefix)
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(f"{source.repository}: estimating a layer's size needs every weight file's header, and "
                          f"reading them from the hub needs huggingface_hub ({INSTALL_HINT})") from None
    try:
        metadata = huggingface_hub.HfApi().get_safetensors_metadata(source.repository.repo_id, revision=snapshot.name)
    except Exception as e:  # whatever the hub or the network raise (offline, unreachable, gated): one line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:256]
        raise ConfigError(f"{source.repository}: estimating a layer's size needs every weight file's header, and "
                          f"the hub's cannot be read: {reason}") from None
    sizes = {name: tensor.data_offsets[1] - tensor.data_offsets[0]
             for file in metadata.files_metadata.values() for name, tensor in file.tensors.items()}
    return layer_bytes_of(sizes, num_layers, prefix)


def shards_for(weight_map: Mapping[str, str], wanted: Callable[[str], bool]) -> set[str]:
    """The shard files of an index's `weight_map` that hold a tensor `wanted` picks. A shard name
    that would leave the snapshot folder (absolute, or climbing with ..) is a CheckpointError."""
    shards = {shard for tensor, shard in weight_map.items() if wanted(tensor)}
    for shard in shards:
        parts = PurePosixPath(shard).parts
        if not parts or shard.startswith("/") or ".." in parts or "\\" in shard:
            raise CheckpointError(f"{INDEX} names the weight file {shard!r}, outside the checkpoint")
    return shards


def _download(repository: Repository, filename: str, revision: str, *, optional: bool = False) -> Path | None:
    """`filename` of `repository` at `revision`, downloaded into the cache; None when `optional`
    and the repository has no such file. Every failure is a one-line ConfigError."""
    missing = f"{repository}: {filename} is not in the Hugging Face cache {repository.cache}"
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ConfigError(f"{missing}, and downloading it needs huggingface_hub ({INSTALL_HINT})") from None
    try:
        return Path(huggingface_hub.hf_hub_download(repository.repo_id, filename, revision=revision,
                                                    cache_dir=repository.cache))
    except errors.LocalEntryNotFoundError:  # before its base class: not cached, and the hub not asked or not reached
        why = "HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ConfigError(f"{missing} and {why}") from None
    except errors.EntryNotFoundError:  # the hub answered: the repository has no such file
        if optional:
            return None
        raise ConfigError(f"{repository} has no {filename} on the hub") from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:256]
        raise ConfigError(f"{missing} and cannot be downloaded: {reason}") from None
