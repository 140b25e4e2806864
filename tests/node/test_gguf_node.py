"""`cakemp run --model x.gguf` over TCP, against HF's layers as transformers' own GGUF loader
builds them from the same file (tests/support/gguf_files.py: the file written by gguf-py's GGUFWriter,
the reference dequantized by gguf-py, the Llama q/k permutation undone by transformers).

One node at a time, each serving layers 1-3 of one file on one f32 CPU device:
* Llama (q/k rows in llama.cpp's permuted order), hidden 256 so that every matrix takes
  blocks of 256: q Q4_K, k Q5_K, v Q6_K, o Q3_K, gate Q2_K, up IQ4_XS, down TQ2_0;
* Qwen3 with heads of 128 over a hidden size of 64 (attention.key_length, which Cake ignores):
  Q4_1, Q5_0, Q5_1, BF16, Q4_0, F16 and IQ4_NL matrices, f32 q/k norms;
* Qwen3-MoE, 8 experts of 768, 2 per token, tied embeddings: experts stacked as llama.cpp
  stores them (gate Q8_0, up Q4_0, down TQ1_0), the router Q8_0;
* Qwen2 (the family Cake's GGUF path computes right), q/k/v biases, one kv head: Q8_0 and F16;
  then the same file again, the node started by id (`--model org/name/file.gguf`) from a
  temporary hub cache holding it, offline (HF_HUB_OFFLINE=1).
A prompt, 8 decode steps and (a second session) a prompt in 3-token chunks match HF to F32_REL
(both sides compute the same f32 weights: ours are bit-equal to gguf-py's dequantization).
Files cakemp does not take (an architecture, a ggml type, a malformed header, a served layer's
missing tensor) make the node exit 78 naming what it refused.
"""

from __future__ import annotations

import struct

import pytest

from tests.support.gguf_files import GgufSpec, hf_reference, needs_gguf, write_gguf
from tests.support.hub_cache import write_snapshot
from tests.support.quantized_node import check_prompt_decode_and_chunks, refused_at_start, start

SPECS = {
    "llama": GgufSpec("llama", hidden=256, ffn=512, types={
        "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q3_K", "ffn_gate": "Q2_K",
        "ffn_up": "IQ4_XS", "ffn_down": "TQ2_0", "token_embd": "F16", "output": "Q6_K"}),
    "qwen3": GgufSpec("qwen3", head_dim=128, rope_theta=1e6, types={
        "attn_q": "Q4_1", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "BF16", "ffn_gate": "Q4_0",
        "ffn_up": "F16", "ffn_down": "IQ4_NL", "token_embd": "F16"}),
    "qwen3moe": GgufSpec("qwen3moe", ffn=0, experts=8, expert_ffn=768, tied=True, types={
        "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "TQ1_0"}),
    "qwen2": GgufSpec("qwen2", kv_heads=1, rope_theta=1e6, types={"attn_v": "F16", "ffn_down": "F16"}),
}


# The Qwen2 file once more, its node started by Hugging Face id from a hub cache that holds it, offline.
BY_ID = "qwen2-by-id"
REPO = "tiny-org/qwen2-gguf"


@pytest.fixture(scope="module", params=[*SPECS, BY_ID])
def served(request, tmp_path_factory):
    arch = "qwen2" if request.param == BY_ID else request.param
    tmp = tmp_path_factory.mktemp(request.param)
    path = write_gguf(tmp / f"{arch}.gguf", SPECS[arch])
    reference = hf_reference(path, tmp / "reference")
    if request.param == BY_ID:
        snapshot = write_snapshot(tmp / "hub", REPO, {path.name: path})
        path.unlink()  # only the cache's copy remains
        path = snapshot / path.name
        node = start(path, tmp, f"{REPO}/{path.name}", env={"HF_HUB_CACHE": str(tmp / "hub"), "HF_HUB_OFFLINE": "1"})
    else:
        node = start(path, tmp)
    yield node, path, reference
    assert node.stop() == 0


@needs_gguf
def test_prompt_decode_and_chunked_prompt_match_hf(served):
    check_prompt_decode_and_chunks(*served)


@needs_gguf
def test_an_architecture_not_served_is_refused_at_start(tmp_path):
    path = write_gguf(tmp_path / "gemma3.gguf", GgufSpec("gemma3"))
    assert "GGUF architecture 'gemma3' is not supported by cakemp" in refused_at_start(path, tmp_path)


@needs_gguf
def test_a_ggml_type_not_dequantized_is_refused_at_start(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "q.gguf", GgufSpec("qwen3", types={"attn_q": "Q8_0"}))
    # The same file with one tensor's type number changed to MXFP4's (32 values in 17 bytes: the file still adds up).
    reader = gguf.GGUFReader(path)
    field = next(t for t in reader.tensors if t.name == "blk.2.attn_v.weight")
    data = bytearray(path.read_bytes())
    at = int(field.field.offset) + len(field.name) + 8 + 4 + 8 * len(field.shape)  # the u32 type
    assert struct.unpack_from("<I", data, at)[0] == int(gguf.GGMLQuantizationType.Q8_0)
    struct.pack_into("<I", data, at, int(gguf.GGMLQuantizationType.MXFP4))
    path.write_bytes(bytes(data))
    out = refused_at_start(path, tmp_path)
    assert "tensor blk.2.attn_v.weight is MXFP4, which cakemp does not dequantize" in out


@needs_gguf
def test_a_served_layer_s_missing_tensor_is_refused_at_start(tmp_path):
    """The front takes the file (its config is whole); the device's load names the tensor it lacks."""
    path = write_gguf(tmp_path / "q.gguf", GgufSpec("qwen3", omitted=frozenset({"blk.2.ffn_up.weight"})))
    assert "has no tensor for model.layers.2.mlp.up_proj.weight" in refused_at_start(path, tmp_path)


def test_a_malformed_file_is_refused_at_start_in_one_line(tmp_path):
    """A header claiming 2^60 tensors: refused before anything is allocated for them."""
    path = tmp_path / "huge.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0) + bytes(64))
    out = refused_at_start(path, tmp_path)
    assert "not a usable GGUF file: the tensor count 1152921504606846976 cannot fit in the file" in out
