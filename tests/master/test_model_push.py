"""What the master pushes: Cake's file order, the rewritten index's exact bytes, chunking and compression."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import zstandard

from cakemp.errors import ConfigError
from cakemp.master.model_push import model_chunks, model_hash, push_files
from cakemp.wire import Revision
from tests.support.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", shards=4)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_model_hash_is_the_first_4_bytes_of_sha256_of_config_json(sharded):
    assert model_hash(sharded) == hashlib.sha256((sharded / "config.json").read_bytes()).hexdigest()[:8]


def test_a_sharded_model_pushes_config_tokenizer_rewritten_index_then_the_shards_of_the_layers(sharded):
    files = push_files(sharded, ["model.layers.1", "model.layers.2"])
    assert [name for name, _ in files] == ["config.json", "tokenizer.json", "model.safetensors.index.json",
                                           "model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors"]
    index = files[2][1]
    parsed = json.loads(index)
    assert set(parsed["weight_map"]) == {name for name in json.loads((sharded / "model.safetensors.index.json")
                                                                     .read_text())["weight_map"]
                                         if name.startswith(("model.layers.1.", "model.layers.2."))}
    # serde_json's to_vec_pretty: sorted keys (no indexmap), 2-space indent, ": ", no final newline.
    assert index == json.dumps(parsed, indent=2, sort_keys=True).encode() and not index.endswith(b"\n")
    assert index.startswith(b'{\n  "metadata": {\n')


def test_a_push_without_tokenizer_json_is_refused_as_cake_does(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        push_files(tmp_path, ["model.layers.0"])


def test_revision_2_chunks_compress_only_when_smaller_and_carry_the_crc_of_the_bytes_sent(sharded):
    chunks = list(model_chunks(sharded, ["model.layers.1"], Revision.V2, chunk_bytes=4096))
    assert any(c.compressed for c in chunks) and not all(c.compressed for c in chunks)
    rebuilt: dict[str, bytearray] = {}
    for c in chunks:
        assert c.checksum == zlib.crc32(c.data)
        data = c.data
        if c.compressed:
            assert zstandard.frame_content_size(c.data) == -1  # written without a content size, as Cake does
            data = zstandard.ZstdDecompressor().decompress(c.data, max_output_size=4096)
        assert c.offset == len(rebuilt.setdefault(c.filename, bytearray()))
        rebuilt[c.filename] += data
    assert rebuilt["model-00002-of-00004.safetensors"] == (sharded / "model-00002-of-00004.safetensors").read_bytes()


def test_revision_1_chunks_are_plain(sharded):
    chunks = list(model_chunks(sharded, ["model.layers.1"], Revision.V1, chunk_bytes=4096))
    assert not any(c.compressed or c.checksum for c in chunks)
