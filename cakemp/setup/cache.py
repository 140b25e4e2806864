"""Cake's model cache on a zero-config node: where pushed files live, and a push written into it.

The directory is Cake's own (docs/protocol.md, Cache directory): `$XDG_CACHE_HOME/cake/<cluster hash>-<model hash>/`
(`~/.cache` without XDG_CACHE_HOME; `<cluster hash>` alone when an old master sends no model
hash), so a machine keeps one cache per cluster and model.

Unlike Cake, a cache counts only once a push completed (docs/protocol.md, Cache directory, says what Cake trusts):
every file is written beside its final name (`.<name>.partial`) and moved into place when
whole, the push ends by recording each file's size in a marker (`.cakemp-complete`, written
the same way) once config.json is a model cakemp runs (ModelConfig) with every assigned
layer, and a cache is valid only when that marker is there, every file in it has its recorded
size, and the files hold the assigned layers. A new push removes the marker first and
replaces files by name; a push that fails (interrupted, refused) removes the files it wrote,
so the next master is asked for the data again.

The node deletes nothing it did not write: only the files of the push under way (or, when
the files that push delivered prove unloadable, those). A cache that is not at fault (the
node stopped while loading, the devices lacked memory) keeps its files and marker. The
directory itself must be a real directory of the node's user: a symbolic link, or one that
holds files with neither the marker nor cakemp's own record (`.cakemp-cache`, written before
a push first writes into it), is refused with SetupError and left as it is.

A cache Cake itself wrote has no marker. It is adopted (the marker and the record written)
only when every file the layers need is whole by its own structure: config.json is a model
cakemp runs, the index parses, and each safetensors file is exactly as long as its header
says (8 + header + the last tensor's end), which an interrupted Cake push, truncating a
shard, fails.

Everything a master sends is checked before it touches the disk: file names are bare names
from the push's allowed set, offsets continue exactly where the file stands, a file's size
never changes, no file grows past its size, the push's sizes stay under a total limit (at most
what the disk has free as the push begins, less a margin), the CRC matches, and a zstd frame must
be whole and may not decompress past the file's size.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zstandard

from cakemp import log
from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import (
    CONFIG,
    INDEX,
    PUSH_CHUNK_BYTES,
    SINGLE,
    TOKENIZER,
    in_layer,
    read_weight_map,
    safetensors_names,
    safetensors_whole,
)
from cakemp.errors import CheckpointError, SetupError
from cakemp.wire import ModelDataChunk

MARKER = ".cakemp-complete"
# cakemp's record that the directory's files are its own (pushed, or adopted from Cake).
OWNER = ".cakemp-cache"
_PARTIAL = ".{}.partial"
_MODEL_HASH = re.compile(r"[0-9a-f]{8}")
_MAX_INDEX_BYTES = 64 << 20  # a rewritten index is a few MiB even for the largest models
_MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB
# What a push leaves free on the cache's disk: the larger of a share of the disk and a floor.
DISK_MARGIN_SHARE = 0.05
DISK_MARGIN_BYTES = 1 << 30


def cache_root() -> Path:
    """Where Cake keeps its caches: $XDG_CACHE_HOME/cake, else ~/.cache/cake (Linux's dirs::cache_dir)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return Path(base if os.path.isabs(base) else Path.home() / ".cache") / "cake"


def disk_room(path: Path) -> int:
    """The most a push may write on the disk holding `path`: what is free to this user, less the
    margin left for the host (its logs, other caches)."""
    disk = os.statvfs(path)
    margin = max(int(disk.f_blocks * disk.f_frsize * DISK_MARGIN_SHARE), DISK_MARGIN_BYTES)
    return max(0, disk.f_bavail * disk.f_frsize - margin)


def check_model_hash(model_hash: str) -> str:
    """`model_hash` if it is 8 lowercase hex digits or empty (it becomes part of a path); else SetupError."""
    if model_hash and not _MODEL_HASH.fullmatch(model_hash):
        raise SetupError(f"invalid model hash {model_hash[:64]!r}: expected 8 lowercase hex digits")
    return model_hash


def check_file_name(name: str) -> str:
    """`name` if it is a bare file name (no separator, not . or .., not hidden, no NUL); else SetupError."""
    if (not name or len(name.encode("utf-8", "surrogatepass")) > 255 or "/" in name or "\\" in name
            or "\0" in name or name.startswith(".")):
        raise SetupError(f"invalid file name {name[:64]!r}: expected a bare file name")
    return name


@dataclass(frozen=True)
class ModelCache:
    """One cluster's cache directory for one model."""

    directory: Path

    @classmethod
    def for_model(cls, root: Path, cluster_hash: str, model_hash: str) -> ModelCache:
        name = f"{cluster_hash}-{check_model_hash(model_hash)}" if model_hash else cluster_hash
        return cls(Path(root) / name)

    def covers(self, layers: Sequence[str]) -> bool:
        """Whether a completed push left every file whole here, holding every one of `layers`
        (or, in a directory cakemp has not written to, Cake's own files are whole: then they are
        adopted). Raises SetupError when the directory is not one the node may use."""
        self._check_directory()
        try:
            sizes = json.loads((self.directory / MARKER).read_text())["files"]
        except FileNotFoundError:
            return not os.path.lexists(self.directory / OWNER) and self._adopt(layers)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        try:
            if not all(os.lstat(self.directory / check_file_name(name)).st_size == size
                       for name, size in sizes.items()):
                return False
            return _holds_layers(self.directory, set(sizes), layers) and _config_fault(self.directory, layers) is None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError, SetupError):
            return False

    def _adopt(self, layers: Sequence[str]) -> bool:
        """A cache without a marker (Cake wrote it) counts, and gets a marker, when the files the
        layers need are whole by their own structure."""
        try:
            present = {entry.name for entry in os.scandir(self.directory)
                       if entry.is_file(follow_symlinks=False) and not entry.name.startswith(".")}
            if CONFIG not in present or not _holds_layers(self.directory, present, layers):
                return False
            needed = {CONFIG} | _weight_files(self.directory, present, layers)
            if _config_fault(self.directory, layers) is not None:
                return False
            if not all(safetensors_whole(self.directory / name) for name in needed - {CONFIG, INDEX}):
                return False
            sizes = {name: os.lstat(self.directory / name).st_size for name in needed}
            _write_atomically(self.directory / OWNER, b"")
            _write_atomically(self.directory / MARKER, json.dumps({"files": sizes}).encode())
            return True
        except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError, SetupError):
            return False

    def begin_push(self, layers: Sequence[str], max_total_bytes: int | None, verify_crc: bool) -> ModelPush:
        """Invalidate the cache, for a push of the files holding `layers`, all of them together at
        most `max_total_bytes` and what the disk has room for (None: the disk's room alone);
        `verify_crc`: the chunks carry a CRC, as they do at protocol revision 2. Raises SetupError
        when the directory is not the node's to write into (see the module docstring)."""
        self._check_directory()
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._check_directory()  # again: mkdir accepts a link to a directory that appeared meanwhile
        names = os.listdir(self.directory)
        if names and MARKER not in names and OWNER not in names:
            raise self._refusal(f"the model cache directory holds {len(names)} files cakemp did not write and no "
                                f"{MARKER}: refused, nothing removed; move them away for the node to take the push",
                                files=_listed(names))
        _write_atomically(self.directory / OWNER, b"")
        self.invalidate()
        room = disk_room(self.directory)
        limit = room if max_total_bytes is None else min(max_total_bytes, room)
        return ModelPush(self.directory, tuple(layers), limit, verify_crc)

    def invalidate(self, *, remove_files: bool = False) -> None:
        """Forget the cache (its marker): the next setup asks for the data again, and a push then
        replaces the files by name. With `remove_files`, the files the marker lists go too: the
        caller knows they came from the push this setup received, and that they cannot load."""
        try:
            sizes = json.loads((self.directory / MARKER).read_text())["files"] if remove_files else {}
        except (OSError, ValueError, KeyError, TypeError):
            sizes = {}
        try:
            os.unlink(self.directory / MARKER)
        except FileNotFoundError:
            pass
        for name in sizes if isinstance(sizes, dict) else ():
            try:
                os.unlink(self.directory / check_file_name(name))  # a symlink itself, never what it points at
            except (FileNotFoundError, SetupError):
                pass

    def _check_directory(self) -> None:
        """SetupError unless the directory is absent or a real directory of this node's user."""
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise self._refusal("the model cache directory is a symbolic link: refused, nothing written or removed "
                                "(the node writes only into a directory of its own)")
        if not stat.S_ISDIR(st.st_mode):
            raise self._refusal("the model cache path is not a directory: refused")
        if st.st_uid != os.geteuid():
            raise self._refusal(f"the model cache directory belongs to uid {st.st_uid}, not to this node's user "
                                f"(uid {os.geteuid()}): refused, nothing written or removed")

    def _refusal(self, reason: str, **detail: str) -> SetupError:
        """The SetupError for the master, which never learns the path; the log names the directory."""
        log.get_logger().warning("model cache directory refused", cache=str(self.directory), reason=reason, **detail)
        return SetupError(reason)


class ModelPush:
    """One push into a cache directory: `receive` each chunk, then `finish` at ModelDataDone.

    Any refusal raises SetupError; the caller then calls `abort`, which removes the partial
    file (the marker was removed when the push began, so the cache stays invalid).
    """

    def __init__(self, directory: Path, layers: tuple[str, ...], max_total_bytes: int, verify_crc: bool):
        self._directory = directory
        self._verify_crc = verify_crc
        self._layers = layers
        self._max_total = max_total_bytes
        self._allowed = {CONFIG, TOKENIZER, SINGLE, INDEX}  # shards join once the index names them
        self._done: dict[str, int] = {}  # whole files moved into place -> size
        self._current: _File | None = None
        self._announced = 0  # sum of the sizes of the files begun
        self._decompressor = zstandard.ZstdDecompressor()

    def receive(self, chunk: ModelDataChunk) -> None:
        """Check and write one chunk."""
        name = check_file_name(chunk.filename)
        if self._current is None or self._current.name != name:
            self._start(name, chunk.total_size)
        current = self._current
        if chunk.total_size != current.size:
            raise SetupError(f"{name}: total_size changed from {current.size} to {chunk.total_size}")
        if chunk.offset != current.written:
            raise SetupError(f"{name}: chunk at offset {chunk.offset}, expected {current.written}")
        data = self._payload(chunk, current.size - current.written)
        current.write(data)
        if current.written == current.size:
            self._complete(current)

    def finish(self) -> None:
        """ModelDataDone: check the push is whole and holds the layers, then record it complete."""
        if self._current is not None:
            raise SetupError(f"{self._current.name}: push ended at {self._current.written} of "
                             f"{self._current.size} bytes")
        if CONFIG not in self._done:
            raise SetupError(f"the push has no {CONFIG}")
        if INDEX in self._done:
            missing = sorted(self._allowed - self._done.keys() - {CONFIG, TOKENIZER, SINGLE, INDEX})
            if missing:
                raise SetupError(f"the push lacks shards its index names: {', '.join(missing[:3])}")
        if not _holds_layers(self._directory, set(self._done), self._layers):
            raise SetupError(f"the pushed files do not hold every assigned layer ({', '.join(self._layers[:3])}, ...)")
        if (fault := _config_fault(self._directory, self._layers)) is not None:
            raise SetupError(f"cannot load the pushed model: {fault}")
        _write_atomically(self._directory / MARKER, json.dumps({"files": self._done}).encode())

    def abort(self) -> None:
        """Remove what this push wrote: the file being written and the whole ones (so that nothing
        of a failed push is ever adopted as a cache)."""
        if self._current is not None:
            self._current.discard()
            self._current = None
        for name in self._done:
            try:
                os.unlink(self._directory / name)
            except FileNotFoundError:
                pass
        self._done.clear()

    def _start(self, name: str, size: int) -> None:
        if self._current is not None:
            raise SetupError(f"{name} begins while {self._current.name} is at {self._current.written} "
                             f"of {self._current.size} bytes")
        if name not in self._allowed:
            raise SetupError(f"{name} is not a file of this push")
        if name in self._done:
            raise SetupError(f"{name} was pushed twice")
        if SINGLE in self._done.keys() | {name} and INDEX in self._done.keys() | {name}:
            raise SetupError(f"a push holds either {SINGLE} or {INDEX}, not both")
        if size > self._max_total - self._announced:
            raise SetupError(f"{name} of {size} bytes would take the push past the limit of {self._max_total} bytes "
                             "(--max-model-gib, or what the node's disk has free less a margin)")
        if name == CONFIG and size > _MAX_CONFIG_BYTES:
            raise SetupError(f"{CONFIG} of {size} bytes is past the limit of {_MAX_CONFIG_BYTES} bytes")
        self._announced += size
        self._current = _File.create(self._directory, name, size)

    def _payload(self, chunk: ModelDataChunk, room: int) -> bytes | memoryview:
        """The chunk's file bytes: CRC checked (revision 2 carries one), zstd undone, never more than `room`."""
        data = chunk.data
        if self._verify_crc and zlib.crc32(data) != chunk.checksum:
            raise SetupError(f"{chunk.filename}: CRC mismatch at offset {chunk.offset}")
        if not chunk.compressed:
            if len(data) > room:
                raise SetupError(f"{chunk.filename}: chunk at {chunk.offset} runs past total_size")
            return data
        bound = min(room, PUSH_CHUNK_BYTES)
        try:
            if (length := _frame_length(data)) != len(data):
                raise SetupError(f"{chunk.filename}: the chunk at {chunk.offset} is not one zstd frame "
                                 f"({len(data)} bytes, its frame {length})")
            declared = zstandard.frame_content_size(data)
            if declared > bound:
                raise SetupError(f"{chunk.filename}: compressed chunk declares {declared} bytes, room for {bound}")
            if bound == 0:
                raise SetupError(f"{chunk.filename}: compressed chunk past total_size")
            # Without a content size (Cake writes none) the output buffer is `bound` and a
            # frame that needs more, or that is cut short, is an error, not partial output.
            return self._decompressor.decompress(data, max_output_size=bound)
        except zstandard.ZstdError as e:
            raise SetupError(f"{chunk.filename}: bad zstd data at offset {chunk.offset}: {e}") from None

    def _complete(self, current: _File) -> None:
        current.close_into_place()
        self._done[current.name] = current.size
        self._current = None
        if current.name == INDEX:
            self._allowed |= _shards_of(self._directory / INDEX)


class _File:
    """A file being pushed: written at `.<name>.partial`, moved to `name` when whole."""

    def __init__(self, directory: Path, name: str, size: int, fd: int):
        self.name, self.size, self.written = name, size, 0
        self._directory, self._fd = directory, fd

    @classmethod
    def create(cls, directory: Path, name: str, size: int) -> _File:
        # O_EXCL|O_NOFOLLOW: never through a link someone planted, never over a file of this push.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        partial = directory / _PARTIAL.format(name)
        try:
            os.unlink(partial)  # left by a push that died mid-file: the name is cakemp's own
        except FileNotFoundError:
            pass
        try:
            fd = os.open(partial, flags, 0o600)
        except OSError as e:
            raise SetupError(f"cannot create {name} in the cache: {e.strerror}") from None
        return cls(directory, name, size, fd)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            written = os.write(self._fd, view)
            view = view[written:]
            self.written += written

    def close_into_place(self) -> None:
        os.fsync(self._fd)
        self._close()
        os.replace(self._directory / _PARTIAL.format(self.name), self._directory / self.name)

    def discard(self) -> None:
        """Close (if still open) and remove the partial file; never raises, so an abort always ends."""
        try:
            self._close()
        except OSError:
            pass
        try:
            os.unlink(self._directory / _PARTIAL.format(self.name))
        except OSError:
            pass

    def _close(self) -> None:
        # Forgotten before it is closed: a close that fails, or a rename after it that does, must
        # not lead discard to close the number again, which by then may be another file's or socket's.
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _frame_length(data: bytes | memoryview) -> int:
    """The length of the zstd frame `data` begins with, from its header and block headers (each 3
    bytes, little-endian: last-block bit, 2 type bits, 21 size bits; an RLE block's content is one
    byte), plus the optional 4-byte checksum; more than len(data) when the frame is cut short."""
    position = zstandard.frame_header_size(data)
    while position + 3 <= len(data):
        header = int.from_bytes(data[position:position + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        position += 3 + (1 if kind == 1 else size)
        if last:
            return position + (4 if zstandard.get_frame_parameters(data).has_checksum else 0)
    return len(data) + 1


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)


def _config_fault(directory: Path, layers: Sequence[str]) -> str | None:
    """Why the directory's config.json is not a model cakemp runs with every one of `layers`
    (with no path in it: the master is told), or None when it is."""
    try:
        fd = os.open(directory / CONFIG, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        return f"cannot read {CONFIG}: {e.strerror}"
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        return f"{CONFIG} is past the limit of {_MAX_CONFIG_BYTES} bytes"
    try:
        config = ModelConfig.from_dict(json.loads(data), source=CONFIG)
    except (ValueError, RecursionError) as e:
        return f"{CONFIG} is not JSON: {str(e)[:100]}"
    except CheckpointError as e:
        return str(e)
    missing = [layer for layer in layers if config.layer_index(layer) is None]
    if missing:
        return (f"{CONFIG} has no layer {missing[0][:64]} (its layers are {config.layer_name(0)}.."
                f"{config.num_hidden_layers - 1})")
    return None


def _listed(names: list[str]) -> str:
    """A few of `names`, for an error (the rest counted)."""
    shown = ", ".join(name[:64] for name in sorted(names)[:3])
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"


def _shards_of(index: Path) -> set[str]:
    """The shard names a pushed index maps tensors to (each must be a bare name)."""
    weight_map = _weight_map(index)
    shards = {check_file_name(shard) for shard in weight_map.values()}
    if not all(shard.endswith(".safetensors") for shard in shards):
        raise SetupError(f"{INDEX} names a shard that is not a .safetensors file")
    return shards


def _weight_map(index: Path) -> dict[str, str]:
    try:
        return read_weight_map(index, _MAX_INDEX_BYTES)
    except CheckpointError as e:
        raise SetupError(str(e)) from None


def _holds_layers(directory: Path, files: set[str], layers: Sequence[str]) -> bool:
    """Whether the whole files `files` hold a tensor of every layer (Cake's rule: a `<layer>.` prefix)."""
    if INDEX in files:
        weight_map = _weight_map(directory / INDEX)
        return all(any(in_layer(name, layer) and shard in files for name, shard in weight_map.items())
                   for layer in layers)
    if SINGLE in files:
        names = safetensors_names(directory / SINGLE)
        return all(any(in_layer(name, layer) for name in names) for layer in layers)
    return False


def _weight_files(directory: Path, files: set[str], layers: Sequence[str]) -> set[str]:
    """The weight files (and the index) the layers' tensors are in."""
    if INDEX in files:
        weight_map = _weight_map(directory / INDEX)
        return {INDEX} | {shard for name, shard in weight_map.items()
                          if any(in_layer(name, layer) for layer in layers)}
    return {SINGLE}
