"""What a --model argument names: a path, a `cake split` bundle, a Hugging Face id in the hub
cache (its layout built here as huggingface_hub writes it) or a GGUF file of one; which files a
node fetches; a layer's estimated size. No network: every file a test asks for is in its cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cakemp.checkpoint import hub
from cakemp.checkpoint.files import CONFIG, INDEX, estimated_layer_bytes, in_layer
from cakemp.checkpoint.hub import fetch_metadata, fetch_weights, shards_for
from cakemp.checkpoint.locate import ModelSource, Repository, hub_cache, locate, parse_repository, parse_repository_file
from cakemp.errors import CheckpointError, ConfigError
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf
from tests.support.hub_cache import COMMIT, write_snapshot

OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_the_cache_is_found_as_huggingface_hub_finds_it(tmp_path):
    """HF_HUB_CACHE, then the legacy HUGGINGFACE_HUB_CACHE, then HF_HOME/hub, then
    $XDG_CACHE_HOME/huggingface/hub, then ~/.cache/huggingface/hub."""
    every = {"HF_HUB_CACHE": "/a", "HUGGINGFACE_HUB_CACHE": "/b", "HF_HOME": "/c", "XDG_CACHE_HOME": "/d"}
    assert hub_cache(every) == Path("/a")
    assert hub_cache(every | {"HF_HUB_CACHE": ""}) == Path("/b")
    assert hub_cache({"HF_HOME": "/c", "XDG_CACHE_HOME": "/d"}) == Path("/c/hub")
    assert hub_cache({"XDG_CACHE_HOME": "/d"}) == Path("/d/huggingface/hub")
    assert hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"


@pytest.mark.parametrize("argument, expected", [
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", "main")),
    ("evilsocket/Qwen3-0.6B@v1.0", ("evilsocket/Qwen3-0.6B", "v1.0")),
    (f"org/name@{COMMIT}", ("org/name", COMMIT)),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ("./org/name", None),  # Cake's rule: a leading "." or "~", a leading "/", or other than one slash is a path
    ("~/models", None),
    ("/models/llama", None),
    ("models/llama/v2", None),
    ("llama", None),
    ("org/", None),
    ("org/.hidden", None),
    ("org/name@../../../etc", None),  # a revision that would climb out of refs/
    ("org/name@", ("org/name", "main")),
])
def test_an_id_is_one_slash_between_two_names_with_an_optional_revision(argument, expected):
    repository = parse_repository(argument)
    assert (None if repository is None else (repository.repo_id, repository.revision)) == expected


def test_an_id_is_its_refs_snapshot_and_a_revision_picks_another(cache):
    """org/name reads refs/main; @v2 refs/v2; @<commit> that snapshot itself."""
    main = write_snapshot(cache, "org/name", {CONFIG: "{}"})
    tagged = write_snapshot(cache, "org/name", {CONFIG: "{}"}, commit=OTHER, ref="v2")
    assert locate("org/name") == ModelSource(main, repository=Repository("org/name", "main", cache))
    assert locate("org/name@v2").path == tagged
    assert locate(f"org/name@{OTHER}").path == tagged


@pytest.mark.parametrize("held", ["v2", OTHER[:39], OTHER + "0", OTHER.upper(), f" {OTHER[:38]} "])
def test_a_ref_holding_anything_but_40_hex_digits_gives_no_path(cache, held):
    """refs/main names a snapshot folder the cache holds, but not by a commit: not trusted, no path."""
    write_snapshot(cache, "org/name", {CONFIG: "{}"}, commit=held.strip(), ref=None)
    (cache / "models--org--name" / "refs").mkdir()
    (cache / "models--org--name" / "refs" / "main").write_text(held)
    assert Repository("org/name", "main", cache).commit() is None
    assert locate("org/name").path is None


def test_an_existing_path_wins_over_an_id_of_the_same_spelling(cache, tmp_path, monkeypatch):
    """A directory ./org/name is that directory, though the cache holds org/name too."""
    write_snapshot(cache, "org/name", {CONFIG: "{}"})
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert locate("org/name") == ModelSource(Path("org/name"))


def test_an_id_the_cache_lacks_has_no_path_and_says_which_cache_was_searched(cache):
    source = locate("org/absent")
    assert source.path is None and source.repository == Repository("org/absent", "main", cache)
    with pytest.raises(ConfigError, match=f"org/absent is not in the Hugging Face cache {cache}$"):
        source.checkpoint()


def test_a_bundle_is_its_model_folder_and_its_topology(tmp_path):
    """`cake split`'s <worker>-node/: model/ (config.json copied in by hand) and topology.yml."""
    bundle = tmp_path / "w1-node"
    (bundle / "model").mkdir(parents=True)
    (bundle / "topology.yml").write_text("w1: {host: 'a:1', layers: [model.layers.0]}\n")
    with pytest.raises(ConfigError, match=f"bundle {bundle}: {bundle}/model/config.json is missing"):
        locate(str(bundle))
    (bundle / "model" / CONFIG).write_text("{}")
    assert locate(str(bundle)) == ModelSource(bundle / "model", topology=bundle / "topology.yml")
    assert locate(str(bundle / "model")) == ModelSource(bundle / "model")  # the model folder alone: a checkpoint


WEIGHT_MAP = {
    "model.embed_tokens.weight": "model-00001-of-00003.safetensors",
    "model.layers.0.mlp.up_proj.weight": "model-00001-of-00003.safetensors",
    "model.layers.1.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
    "model.layers.10.mlp.up_proj.weight": "model-00003-of-00003.safetensors",
    "model.layers.2.mlp.up_proj.weight": "model-00003-of-00003.safetensors",
    "lm_head.weight": "model-00003-of-00003.safetensors",
}


def test_a_worker_fetches_only_the_shards_holding_its_layers():
    """Layer 1's tensors live in shard 2 only ("model.layers.10." is not layer 1's); a master without
    remote layers needs every shard."""
    def serving(*layers):
        return lambda tensor: any(in_layer(tensor, layer) for layer in layers)

    assert shards_for(WEIGHT_MAP, serving("model.layers.1")) == {"model-00002-of-00003.safetensors"}
    assert shards_for(WEIGHT_MAP, serving("model.layers.0", "model.layers.2")) == {
        "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"}
    assert len(shards_for(WEIGHT_MAP, lambda tensor: True)) == 3


@pytest.mark.parametrize("shard", ["../../outside.safetensors", "/etc/passwd", "a\\..\\b"])
def test_an_index_naming_a_file_outside_the_snapshot_is_refused(shard):
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        shards_for({"model.layers.0.w": shard}, lambda tensor: True)


def test_a_snapshot_holding_what_a_node_needs_fetches_nothing(cache):
    """Config, index and shard 2 present: a node of layer 1 is ready with no download (none could run:
    huggingface_hub is never called), though shards 1 and 3 are absent."""
    snapshot = write_snapshot(cache, "org/name", {CONFIG: "{}", INDEX: json.dumps({"weight_map": WEIGHT_MAP}),
                                                  "model-00002-of-00003.safetensors": ""})
    source, fetched = fetch_metadata(locate("org/name"))
    assert (source.path, fetched) == (snapshot, [])
    assert fetch_weights(source, lambda tensor: in_layer(tensor, "model.layers.1")) == []
    assert fetch_weights(ModelSource(Path("/no/such/dir")), lambda tensor: True) == []  # a path is never fetched


def test_a_layers_size_is_its_tensors_bytes_from_the_headers_and_else_the_files_sizes(tmp_path):
    """Cake's estimate: the bytes of the "model.layers." tensors over the layer count, the embedding
    left out; with a shard missing, all present files' sizes over the layer count."""
    tensors = {"model.embed_tokens.weight": torch.zeros(100, 8), "model.layers.0.w": torch.zeros(4, 8),
               "model.layers.1.w": torch.zeros(4, 8, dtype=torch.float16), "model.layers.1.b": torch.zeros(3)}
    save_file({k: v for k, v in tensors.items() if "layers.1" not in k}, tmp_path / "a.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1" in k}, tmp_path / "b.safetensors")
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {
        k: "b.safetensors" if "layers.1" in k else "a.safetensors" for k in tensors}}))
    layer_bytes = 4 * 8 * 4 + 4 * 8 * 2 + 3 * 4  # f32 [4, 8], f16 [4, 8], f32 [3]
    assert estimated_layer_bytes(tmp_path, 2, "model.layers") == layer_bytes // 2
    (tmp_path / "b.safetensors").unlink()
    assert estimated_layer_bytes(tmp_path, 2, "model.layers") == (tmp_path / "a.safetensors").stat().st_size // 2
    assert estimated_layer_bytes(tmp_path / "empty", 2, "model.layers") == 0


@pytest.mark.parametrize("argument, expected", [
    ("org/name/model-Q4_K_M.gguf", ("org/name", "main", "model-Q4_K_M.gguf")),
    ("org/name@v2/model.gguf", ("org/name", "v2", "model.gguf")),
    (f"org/name@{COMMIT}/q8/model.gguf", ("org/name", COMMIT, "q8/model.gguf")),  # a file in a folder
    ("org/name@refs/pr/3/model.gguf", ("org/name", "refs/pr/3", "model.gguf")),  # as HfFileSystem reads it
    ("org/name/model.safetensors", None),  # only a GGUF file is named inside a repository
    ("org/name/../model.gguf", None),
    ("org/name//model.gguf", None),
    ("org/name@../model.gguf", None),
    ("./org/name/model.gguf", None),  # the path rules of an id apply to its repository part
    ("/models/org/model.gguf", None),
    ("~/org/model.gguf", None),
    ("org/name/my model.gguf", None),
])
def test_a_gguf_file_of_a_repository_is_the_id_then_its_path_in_the_repository(argument, expected):
    named = parse_repository_file(argument)
    assert (None if named is None else (named[0].repo_id, named[0].revision, named[1])) == expected


def test_a_gguf_id_is_that_file_of_the_snapshot_and_missing_says_the_id_the_file_and_the_cache(cache):
    snapshot = write_snapshot(cache, "org/gguf", {"model-Q8_0.gguf": "GGUF"})
    assert locate("org/gguf/model-Q8_0.gguf") == ModelSource(
        snapshot / "model-Q8_0.gguf", repository=Repository("org/gguf", "main", cache), filename="model-Q8_0.gguf")
    assert locate(f"org/gguf@{COMMIT}/model-Q8_0.gguf").path == snapshot / "model-Q8_0.gguf"
    for absent in ("org/gguf/model-Q4_0.gguf", "org/gguf@v9/model-Q8_0.gguf", "org/none/model-Q8_0.gguf"):
        source = locate(absent)
        assert source.path is None and source.filename is not None
        with pytest.raises(ConfigError, match=f": {source.filename} is not in the Hugging Face cache {cache}$"):
            source.checkpoint()


def test_a_cached_gguf_id_fetches_nothing_more(cache):
    """The file is the whole checkpoint: no config.json, index, tokenizer or shard is asked for (none
    could be: huggingface_hub is never called)."""
    snapshot = write_snapshot(cache, "org/gguf", {"model.gguf": "GGUF"})
    source, fetched = fetch_metadata(locate("org/gguf/model.gguf"), ("tokenizer.json",), ("chat_template.jinja",))
    assert (source.path, fetched) == (snapshot / "model.gguf", [])
    assert fetch_weights(source, lambda tensor: True) == []


@needs_gguf
def test_a_cached_gguf_id_weighs_a_layer_from_its_file(cache, tmp_path):
    """A topology completed by memory weighs a GGUF id's layer from the cached file, never asking the hub."""
    path = write_gguf(tmp_path / "m.gguf", GgufSpec("qwen3"))
    write_snapshot(cache, "org/gguf", {"m.gguf": path})
    assert hub.layer_bytes(locate("org/gguf/m.gguf"), 4, "model.layers") == estimated_layer_bytes(path, 4, "model.layers")


def test_one_part_of_a_split_gguf_is_refused_by_its_name_before_any_fetch(cache):
    with pytest.raises(ConfigError, match="org/gguf: q8/model-00001-of-00003.gguf is one part of a split GGUF file"):
        locate("org/gguf/q8/model-00001-of-00003.gguf")
