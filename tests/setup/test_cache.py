"""The zero-config model cache without a node: what counts as a valid cache, and what a push refuses."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from cakemp.errors import SetupError
from cakemp.master.model_push import model_chunks
from cakemp.setup.cache import MARKER, OWNER, ModelCache, cache_root, check_file_name, check_model_hash, disk_room
from cakemp.wire import ModelDataChunk, Revision

LAYERS = ("model.layers.0", "model.layers.1")
LIMIT = 1 << 30
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 512}


@pytest.fixture
def model(tmp_path) -> Path:
    """A two-layer model as a push needs it: config, tokenizer, one safetensors file."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "tokenizer.json").write_text("{}")
    save_file({f"{layer}.w": torch.arange(4000, dtype=torch.float32) for layer in LAYERS}, path / "model.safetensors")
    return path


@pytest.fixture
def cache(tmp_path) -> ModelCache:
    return ModelCache.for_model(tmp_path / "cake", "9f86d081", "0a1b2c3d")


def push(cache: ModelCache, chunks, layers=LAYERS, limit=LIMIT) -> None:
    receiving = cache.begin_push(layers, limit, verify_crc=True)
    try:
        for chunk in chunks:
            receiving.receive(chunk)
        receiving.finish()
    except BaseException:
        receiving.abort()
        raise


def chunks_of(model: Path) -> list[ModelDataChunk]:
    return list(model_chunks(model, LAYERS, Revision.V2, chunk_bytes=4096))


def test_a_completed_push_is_a_valid_cache_for_its_layers_only(cache, model):
    assert not cache.covers(LAYERS)
    push(cache, chunks_of(model))
    assert cache.covers(LAYERS) and cache.covers(LAYERS[:1])
    assert not cache.covers(("model.layers.2",))
    assert (cache.directory / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()


def test_a_file_changed_after_the_push_invalidates_the_cache(cache, model):
    push(cache, chunks_of(model))
    with open(cache.directory / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert not cache.covers(LAYERS)


def test_whole_files_cake_wrote_are_adopted(cache, model):
    """Cake writes no marker: its files count (and get one) when each is whole by its own structure."""
    cache.directory.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (cache.directory / name).write_bytes((model / name).read_bytes())
    assert cache.covers(LAYERS)
    assert (cache.directory / ".cakemp-complete").exists()


@pytest.mark.parametrize("damage", ["truncated shard", "broken config", "no config"])
def test_what_an_interrupted_cake_push_left_is_not_adopted(cache, model, damage):
    cache.directory.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (cache.directory / name).write_bytes((model / name).read_bytes())
    if damage == "truncated shard":
        with open(cache.directory / "model.safetensors", "r+b") as f:
            f.truncate((model / "model.safetensors").stat().st_size - 1)
    elif damage == "broken config":
        (cache.directory / "config.json").write_text('{"num_hidden')
    else:
        (cache.directory / "config.json").unlink()
    assert not cache.covers(LAYERS)
    assert not (cache.directory / ".cakemp-complete").exists()


def test_a_failed_push_leaves_nothing_to_adopt(cache, model):
    """Whole files of a push refused later are removed with it, so they are never taken for Cake's."""
    chunks = chunks_of(model)
    with pytest.raises(SetupError):
        push(cache, chunks + [ModelDataChunk("evil.bin", 0, 1, b"x", False, zlib.crc32(b"x"))])
    assert not cache.covers(LAYERS)
    assert [p.name for p in cache.directory.iterdir()] == [OWNER]  # only cakemp's record that the directory is its own


def test_invalidate_forgets_the_files(cache, model):
    """A model that could not load is not taken up again, marker or not."""
    push(cache, chunks_of(model))
    cache.invalidate()
    assert not cache.covers(LAYERS)


def test_a_new_push_invalidates_first_and_an_aborted_one_leaves_no_partial_file(cache, model):
    push(cache, chunks_of(model))
    chunks = chunks_of(model)
    receiving = cache.begin_push(LAYERS, LIMIT, verify_crc=True)
    assert not cache.covers(LAYERS)
    for chunk in chunks[:-1]:
        receiving.receive(chunk)
    receiving.abort()
    assert not cache.covers(LAYERS)
    assert not [p for p in cache.directory.iterdir() if p.name.endswith(".partial")]


def test_a_push_replaces_a_planted_link_not_its_target(cache, tmp_path, model):
    """A link planted in the node's own cache in place of a file is replaced by the pushed file, never written through."""
    target = tmp_path / "precious"
    target.write_text("keep")
    push(cache, chunks_of(model))
    (cache.directory / "config.json").unlink()
    (cache.directory / "config.json").symlink_to(target)
    push(cache, chunks_of(model))
    assert target.read_text() == "keep"
    assert not (cache.directory / "config.json").is_symlink()


def test_a_push_past_the_total_size_limit_is_refused(cache, model):
    with pytest.raises(SetupError, match="limit"):
        push(cache, chunks_of(model), limit=(model / "model.safetensors").stat().st_size)


def test_the_room_on_the_disk_is_what_is_free_less_the_larger_of_5_percent_and_1_gib(tmp_path):
    disk = os.statvfs(tmp_path)
    margin = max(disk.f_blocks * disk.f_frsize // 20, 1 << 30)
    assert disk_room(tmp_path) == max(0, disk.f_bavail * disk.f_frsize - margin)


@pytest.mark.parametrize("cap", [None, 1 << 60])
def test_a_file_announcing_more_than_the_disk_has_room_for_is_refused_before_a_byte_is_written(cache, model, cap):
    """Without --max-model-gib, and with one above the disk's room: the first chunk of a file whose
    total_size passes the room on the cache's disk is refused before the file is created."""
    receiving = cache.begin_push(LAYERS, cap, verify_crc=True)
    room = disk_room(cache.directory)
    for chunk in (c for c in chunks_of(model) if c.filename != "model.safetensors"):
        receiving.receive(chunk)  # config.json and tokenizer.json fit
    # 1 GiB over, since other processes free and take disk space meanwhile.
    huge = ModelDataChunk("model.safetensors", 0, room + (1 << 30), b"x", False, zlib.crc32(b"x"))
    with pytest.raises(SetupError, match="model.safetensors of [0-9]+ bytes would take the push past the limit"):
        receiving.receive(huge)
    receiving.abort()
    assert [p.name for p in cache.directory.iterdir()] == [OWNER]


def test_a_zstd_frame_declaring_more_than_the_file_has_room_for_is_refused_unread(cache):
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    chunk = ModelDataChunk("config.json", 0, 1000, frame, True, zlib.crc32(frame))
    with pytest.raises(SetupError, match="declares"):
        push(cache, [chunk])


def test_a_push_missing_a_layer_is_refused(cache, model):
    with pytest.raises(SetupError, match="layer"):
        push(cache, chunks_of(model), layers=LAYERS + ("model.layers.7",))


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/etc/passwd", "a\\b", ".hidden", "x\0y", "é" * 200])
def test_only_bare_visible_file_names_pass(name):
    with pytest.raises(SetupError):
        check_file_name(name)


@pytest.mark.parametrize("hash_, ok", [("", True), ("0a1b2c3d", True), ("0A1B2C3D", False), ("0a1b2c3", False),
                                       ("0a1b2c3d0", False), ("../../x", False), ("0a1b2c3\n", False)])
def test_a_model_hash_is_8_lowercase_hex_digits_or_empty(hash_, ok):
    if ok:
        assert check_model_hash(hash_) == hash_
    else:
        with pytest.raises(SetupError):
            check_model_hash(hash_)


def test_the_cache_root_is_cakes(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "cake"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the XDG spec says
    assert cache_root() == Path.home() / ".cache" / "cake"
    assert ModelCache.for_model(tmp_path, "9f86d081", "").directory == tmp_path / "9f86d081"


# --------------------------------------------------------------------------- the pushed config.json


@pytest.mark.parametrize("change, fragment", [
    ({"num_attention_heads": 0}, "num_attention_heads 0"),
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"num_hidden_layers": 1}, "no layer model.layers.1"),
    ({"rope_scaling": 5}, "rope_scaling 5"),
])
def test_a_push_whose_config_is_not_a_model_with_the_layers_is_refused_and_removed(cache, model, change, fragment):
    """The marker is written only once config.json is a model cakemp runs with every assigned
    layer; otherwise the push is refused (saying why, with no path) and its files go."""
    (model / "config.json").write_text(json.dumps(CONFIG | change))
    with pytest.raises(SetupError, match="cannot load the pushed model") as refused:
        push(cache, chunks_of(model))
    assert fragment in str(refused.value) and str(cache.directory) not in str(refused.value)
    assert [p.name for p in cache.directory.iterdir()] == [OWNER] and not cache.covers(LAYERS)


def test_a_config_json_past_its_limit_is_refused_before_it_is_written(cache):
    chunk = ModelDataChunk("config.json", 0, 64 << 20, b"{", False, zlib.crc32(b"{"))
    with pytest.raises(SetupError, match="config.json of 67108864 bytes is past the limit"):
        push(cache, [chunk])


def test_a_completed_cache_whose_config_does_not_parse_is_not_reused(cache, model):
    """A marker from before config.json was checked (or a file changed to the same size) does not
    make a model that cannot load count."""
    push(cache, chunks_of(model))
    config = cache.directory / "config.json"
    size = config.stat().st_size
    config.write_text(json.dumps(CONFIG | {"num_attention_heads": 0}).ljust(size))
    assert config.stat().st_size == size and not cache.covers(LAYERS)


# --------------------------------------------------------------------------- only what the node wrote


def test_a_symlinked_cache_directory_is_refused_and_its_target_left_alone(cache, tmp_path, model):
    """A cache directory that is a link is refused by covers and by a push, and no file of its target is touched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("keep")
    for name in ("config.json", "model.safetensors"):  # even whole model files are not adopted through a link
        (victim / name).write_bytes((model / name).read_bytes())
    cache.directory.parent.mkdir(parents=True)
    cache.directory.symlink_to(victim)
    with pytest.raises(SetupError, match="symbolic link"):
        cache.covers(LAYERS)
    with pytest.raises(SetupError, match="symbolic link"):
        cache.begin_push(LAYERS, LIMIT, verify_crc=True)
    assert sorted(p.name for p in victim.iterdir()) == ["config.json", "important.txt", "model.safetensors"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_cache_directory_of_another_user_is_refused(cache, model):
    cache.directory.mkdir(parents=True)
    os.chown(cache.directory, 65534, 65534)
    with pytest.raises(SetupError, match="belongs to uid 65534"):
        cache.covers(LAYERS)
    with pytest.raises(SetupError, match="belongs to uid 65534"):
        cache.begin_push(LAYERS, LIMIT, verify_crc=True)


def test_a_cache_path_that_is_a_file_is_refused(cache):
    cache.directory.parent.mkdir(parents=True)
    cache.directory.write_text("not a directory")
    with pytest.raises(SetupError, match="not a directory"):
        cache.begin_push(LAYERS, LIMIT, verify_crc=True)
    assert cache.directory.read_text() == "not a directory"


def test_a_directory_of_files_cakemp_did_not_write_is_refused_not_emptied(cache, model):
    """Files that are neither a completed cache nor a whole Cake cache, in a directory cakemp never wrote to, stay:
    covers says no and the push is refused."""
    cache.directory.mkdir(parents=True)
    (cache.directory / "notes.txt").write_text("keep")
    (cache.directory / "config.json").write_text('{"num_hidden')  # an interrupted Cake push, say
    assert not cache.covers(LAYERS)
    with pytest.raises(SetupError, match="holds 2 files cakemp did not write .* nothing removed"):
        cache.begin_push(LAYERS, LIMIT, verify_crc=True)
    assert sorted(p.name for p in cache.directory.iterdir()) == ["config.json", "notes.txt"]


def test_a_push_and_its_abort_leave_files_they_did_not_write(cache, model):
    """In the node's own cache, a push replaces its files by name; aborted, it removes only
    the files it wrote, never another file there."""
    push(cache, chunks_of(model))
    (cache.directory / "operator-notes.txt").write_text("keep")
    chunks = chunks_of(model)
    receiving = cache.begin_push(LAYERS, LIMIT, verify_crc=True)
    config_chunks = [c for c in chunks if c.filename == "config.json"]
    for chunk in config_chunks:
        receiving.receive(chunk)
    receiving.abort()
    names = {p.name for p in cache.directory.iterdir()}
    assert "operator-notes.txt" in names and "config.json" not in names  # the one file this push wrote is gone
    assert {"model.safetensors", "tokenizer.json"} <= names and not cache.covers(LAYERS)


def test_invalidate_keeps_the_files_unless_told_they_came_from_the_failed_push(cache, model):
    """invalidate() drops the marker only; remove_files drops the files the marker lists and nothing else."""
    push(cache, chunks_of(model))
    (cache.directory / "operator-notes.txt").write_text("keep")
    cache.invalidate()
    assert {"config.json", "model.safetensors", "tokenizer.json", "operator-notes.txt"} <= {
        p.name for p in cache.directory.iterdir()}
    assert not cache.covers(LAYERS)  # cakemp's own files without a marker are not adopted as Cake's
    push(cache, chunks_of(model))
    cache.invalidate(remove_files=True)
    assert sorted(p.name for p in cache.directory.iterdir()) == [OWNER, "operator-notes.txt"]


def test_a_push_that_died_midway_is_not_adopted_and_does_not_block_the_next(cache, model):
    """A node killed mid-push leaves a partial file and no marker: the directory is still the
    node's, its files are not taken for a Cake cache, and the next push completes over them."""
    chunks = chunks_of(model)
    receiving = cache.begin_push(LAYERS, LIMIT, verify_crc=True)
    for chunk in chunks[:-1]:
        receiving.receive(chunk)  # then the process dies: no abort, no finish
    assert any(p.name.endswith(".partial") for p in cache.directory.iterdir())
    assert not cache.covers(LAYERS) and not (cache.directory / MARKER).exists()
    push(cache, chunks)
    assert cache.covers(LAYERS) and not any(p.name.endswith(".partial") for p in cache.directory.iterdir())


@pytest.mark.parametrize("extra", [b"junk", "frame"], ids=["trailing-bytes", "second-frame"])
def test_a_zstd_chunk_must_be_exactly_one_frame(cache, extra):
    """A chunk holding a frame and then anything (garbage, a second frame) is refused, not half
    written (the second frame's bytes were once silently dropped, the garbage ignored)."""
    compressor = zstandard.ZstdCompressor(write_content_size=False)
    frame = compressor.compress(b'{"a": 1}')
    data = frame + (compressor.compress(b'{"b": 2}') if extra == "frame" else extra)
    chunk = ModelDataChunk("config.json", 0, 16, data, True, zlib.crc32(data))
    with pytest.raises(SetupError, match="is not one zstd frame"):
        push(cache, [chunk])


def test_a_zstd_chunk_cut_short_is_refused(cache):
    frame = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(os.urandom(4096))[:-3]
    chunk = ModelDataChunk("config.json", 0, 4096, frame, True, zlib.crc32(frame))
    with pytest.raises(SetupError, match="is not one zstd frame"):
        push(cache, [chunk])


def test_a_rename_that_fails_closes_the_file_once(tmp_path):
    """When moving a whole file into place fails (here its name is a directory), discarding it closes
    nothing more: the descriptor number, reused meanwhile by another file, stays that file's."""
    from cakemp.setup.cache import _File

    pushed = _File.create(tmp_path, "model.safetensors", 3)
    pushed.write(b"abc")
    (tmp_path / "model.safetensors" / "occupied").mkdir(parents=True)
    with pytest.raises(OSError):
        pushed.close_into_place()
    other = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT, 0o600)  # likely the number just freed
    try:
        pushed.discard()
        os.fstat(other)  # still open: EBADF here was the double close
    finally:
        os.close(other)
    assert not (tmp_path / ".model.safetensors.partial").exists()
