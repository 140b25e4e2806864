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
from cakemp.setup.cache import ModelCache, cache_root, check_file_name, check_model_hash, disk_room
from cakemp.master.model_push import model_chunks
from cakemp.wire import ModelDataChunk, Revision

LAYERS = ("model.layers.0", "model.layers.1")
LIMIT = 1 << 30


@pytest.fixture
def model(tmp_path) -> Path:
    """A two-layer model as a push needs it: config, tokenizer, one safetensors file."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
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
    assert [p.name for p in cache.directory.iterdir()] == []


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


def test_begin_push_removes_a_planted_link_not_its_target(cache, tmp_path, model):
    target = tmp_path / "precious"
    target.write_text("keep")
    cache.directory.mkdir(parents=True)
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
    assert [p.name for p in cache.directory.iterdir()] == []


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
