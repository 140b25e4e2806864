"""Loading a layer span: only its shards, cast on load, FP8 dequantized, missing tensors named."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute.runner import BlockRunner
from cakemp.errors import CheckpointError
from cakemp.model.block import DecoderBlock
from cakemp.model.weights import fp8
from cakemp.model.weights.safetensors import Checkpoint
from tests.support.checkpoints import make_checkpoint
from tests.support.families import HUB_FAMILIES


def test_only_the_shards_holding_the_layers_are_opened(tmp_path):
    """With the other shards deleted, layers 1-2 of a 4-shard checkpoint still load."""
    path = make_checkpoint(tmp_path, "llama", shards=4)  # one layer per shard
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map[f"model.layers.{i}.mlp.down_proj.weight"] for i in (1, 2)}
    for file in set(weight_map.values()) - needed:
        (path / file).unlink()
    runner = BlockRunner.load(path, ["model.layers.1", "model.layers.2"], "cpu", torch.float32)
    assert runner.layers == ("model.layers.1", "model.layers.2")


def test_single_file_checkpoint_loads_tensors_as_stored(tmp_path):
    """Without an index, tensors come from model.safetensors, bit for bit in f32, stacked per weight."""
    path = make_checkpoint(tmp_path, "qwen2")
    config = ModelConfig.from_dir(path)
    groups = {key: [f"model.layers.2.{name}" for name in members]
              for key, members in DecoderBlock.weight_groups(config, 2, lambda name: True).items()}
    loaded = Checkpoint(path, config).load(groups, torch.device("cpu"), torch.float32)
    with safe_open(path / "model.safetensors", "pt") as f:
        for key, members in groups.items():
            assert torch.equal(loaded[key], torch.cat([f.get_tensor(name) for name in members]))


def test_tensors_are_cast_to_the_compute_dtype(tmp_path):
    """A bf16 checkpoint loaded for f16 compute holds f16 tensors (as Cake's default does)."""
    path = make_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    runner = BlockRunner.load(path, ["model.layers.0"], "cpu", torch.float16)
    block = runner.block("model.layers.0")
    assert block.w_qkv.dtype == block.mlp.w_down.dtype == block.input_norm.dtype == torch.float16


def test_tensor_missing_from_its_shard_names_tensor_and_file(tmp_path):
    """A tensor listed in the index but absent from its shard is named with that shard's path."""
    path = make_checkpoint(tmp_path, "llama", shards=2)
    name = "model.layers.3.mlp.up_proj.weight"
    file = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(path / file, "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != name}
    save_file(kept, path / file)
    with pytest.raises(CheckpointError, match=rf"{name} is missing from .*{file}"):
        BlockRunner.load(path, ["model.layers.3"], "cpu", torch.float32)


def test_tensor_missing_from_the_index_names_tensor_and_index(tmp_path):
    """A tensor the index does not list is named with the index file."""
    path = make_checkpoint(tmp_path, "qwen3", shards=2)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.0.self_attn.k_norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_norm.weight is missing from .*index.json"):
        BlockRunner.load(path, ["model.layers.0"], "cpu", torch.float32)


def test_tensor_missing_from_single_file_names_it(tmp_path):
    """In a single-file checkpoint the missing bias is named with model.safetensors."""
    path = make_checkpoint(tmp_path, "qwen2")
    with safe_open(path / "model.safetensors", "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.self_attn.v_proj.bias"}
    save_file(kept, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"v_proj.bias is missing from .*model.safetensors"):
        BlockRunner.load(path, ["model.layers.1"], "cpu", torch.float32)


def test_unknown_layer_name_is_refused_at_load(tmp_path):
    """Asking for a layer the model does not have is a CheckpointError naming it."""
    path = make_checkpoint(tmp_path, "llama")
    with pytest.raises(CheckpointError, match="model.layers.9"):
        BlockRunner.load(path, ["model.layers.9"], "cpu", torch.float32)


def test_directory_without_weights_is_refused(tmp_path):
    """No index and no model.safetensors is a CheckpointError."""
    path = make_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither"):
        BlockRunner.load(path, ["model.layers.0"], "cpu", torch.float32)


def test_fp8_checkpoint_with_ragged_blocks_is_dequantized_on_load(tmp_path):
    """FP8 projections (sides not multiples of the 48x40 block) load as stored e4m3 times block scale."""
    path = make_checkpoint(tmp_path, "llama", shards=2, fp8_block=(48, 40))
    runner = BlockRunner.load(path, ["model.layers.2"], "cpu", torch.float32, pack_weights=False)  # as loaded
    block = runner.block("model.layers.2")
    files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    stored = {}
    for file in files:
        with safe_open(path / file, "pt") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.2.")}
    down = stored["model.layers.2.mlp.down_proj.weight"]
    assert down.dtype == torch.float8_e4m3fn
    scale = stored["model.layers.2.mlp.down_proj.weight_scale_inv"]
    rows, cols = down.shape  # [64, 128]: 64 = 48 + 16, 128 = 3 * 40 + 8
    expected = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            expected[i, j] = down[i, j].float() * scale[i // 48, j // 40]
    assert torch.equal(block.mlp.w_down, expected)
    q = stored["model.layers.2.self_attn.q_proj.weight"]
    q_scale = stored["model.layers.2.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(block.w_qkv[: q.shape[0]], fp8.dequantize(q, q_scale, (48, 40)))
    # Norms are not quantized and load as stored.
    assert torch.equal(block.input_norm, stored["model.layers.2.input_layernorm.weight"])


def test_fp8_weights_without_a_quantization_to_scale_them_are_refused_by_name(tmp_path):
    """An FP8 checkpoint whose config.json lost its quantization_config: its e4m3 weights are refused
    naming the first one, not read as if their codes were values."""
    path = make_checkpoint(tmp_path, "llama", fp8_block=(128, 128))
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"q_proj.weight is stored as torch.float8_e4m3fn, but config.json "
                                              "declares no quantization"):
        BlockRunner.load(path, ["model.layers.0"], "cpu", torch.float32)


def test_weights_that_disagree_with_config_are_refused_at_load(tmp_path):
    """A config.json that does not match the tensors (intermediate size) fails at load, naming the weight."""
    path = make_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model.layers.0: mlp.gate_proj.weight \+ mlp.up_proj.weight give shape \(256, 64\)"):
        BlockRunner.load(path, ["model.layers.0"], "cpu", torch.float32)


def test_fp8_qwen3_5_moe_loads_dequantized_and_skips_vision_and_mtp(tmp_path):
    """An FP8 Qwen3.5-MoE checkpoint's linear-attention projections load as e4m3 times block scale
    (fused in one matrix), its (1 + w) norms with the 1 added; vision and mtp tensors are never read."""
    path = make_checkpoint(tmp_path, "qwen3_5_moe", shards=2, fp8_block=(32, 48))
    runner = BlockRunner.load(path, ["model.language_model.layers.1"], "cpu", torch.float32, pack_weights=False)  # as loaded
    block = runner.block("model.language_model.layers.1")
    files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    stored = {}
    for file in files:
        with safe_open(path / file, "pt") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys()}
    prefix = "model.language_model.layers.1."
    assert stored[prefix + "linear_attn.in_proj_qkv.weight"].dtype == torch.float8_e4m3fn
    parts = [fp8.dequantize(stored[f"{prefix}linear_attn.in_proj_{p}.weight"],
                            stored[f"{prefix}linear_attn.in_proj_{p}.weight_scale_inv"], (32, 48))
             for p in ("qkv", "z", "b", "a")]
    assert torch.equal(block.mixer.w_in, torch.cat(parts))
    assert torch.equal(block.input_norm, stored[prefix + "input_layernorm.weight"] + 1)
    assert any(k.startswith("mtp.layers.0.") for k in stored) and any(k.startswith("model.visual.") for k in stored)


def test_fp8_fused_phi3_projections_dequantize_as_one_matrix(tmp_path):
    """Phi-3's pre-fused qkv_proj and gate_up_proj in FP8 load as their e4m3 times block scale."""
    family, overrides, hub_config = HUB_FAMILIES["phi3"]
    path = make_checkpoint(tmp_path, family, fp8_block=(48, 40), hub_config=hub_config, **overrides)
    runner = BlockRunner.load(path, ["model.layers.1"], "cpu", torch.float32, pack_weights=False)  # as loaded
    block = runner.block("model.layers.1")
    with safe_open(path / "model.safetensors", "pt") as f:
        for weight, name in ((block.w_qkv, "self_attn.qkv_proj"), (block.mlp.w_gate_up, "mlp.gate_up_proj")):
            stored = f.get_tensor(f"model.layers.1.{name}.weight")
            assert stored.dtype == torch.float8_e4m3fn
            scale = f.get_tensor(f"model.layers.1.{name}.weight_scale_inv")
            assert torch.equal(weight, fp8.dequantize(stored, scale, (48, 40)))


def test_gemma3_norms_fold_their_plus_one_in_f32(tmp_path):
    """Gemma 3's six norm weights w load as 1 + w in f32, even for a bf16 block (as HF computes them)."""
    family, overrides, hub_config = HUB_FAMILIES["gemma3"]
    path = make_checkpoint(tmp_path, family, dtype=torch.bfloat16, hub_config=hub_config, **overrides)
    block = BlockRunner.load(path, ["model.layers.1"], "cpu", torch.bfloat16).block("model.layers.1")
    norms = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "post_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    with safe_open(path / "model.safetensors", "pt") as f:
        for slot, name in norms.items():
            assert torch.equal(getattr(block, slot), f.get_tensor(f"model.layers.1.{name}.weight").float() + 1)
    assert block.w_qkv.dtype == torch.bfloat16
