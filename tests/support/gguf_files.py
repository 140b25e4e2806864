"""Tiny GGUF files written by gguf-py's own GGUFWriter, and transformers' reading of them as the oracle.

    path = write_gguf(tmp_path / "llama.gguf", GgufSpec("llama", types={"attn_q": "Q4_K"}))
    reference = hf_reference(path, tmp_path / "reference")   # an HF checkpoint directory
    HFLayers(reference, [1, 2, 3], torch.float32)            # what a node serving `path` must compute

Tensors are named and shaped as llama.cpp's converter writes them (blk.N.attn_q.weight, ...),
each drawn at random in f32 and stored in its ggml type by gguf-py's own quantizer
(gguf.quants.quantize: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ1_0, TQ2_0, BF16, F16) or, for the
K-quants and IQ4_NL/IQ4_XS, which gguf-py cannot quantize, as random but valid blocks: random
code bytes with the block's f16 scales set to finite values of a size that keeps the weights
near 0.05. A Llama file's q/k rows
are therefore in llama.cpp's permuted order by construction (the file is the truth; the
oracle, transformers' GGUF loader, undoes the permutation with its own code).

The reference is what transformers builds from the file (config from its metadata, tensors
through gguf.quants.dequantize, the Llama permutation reversed), saved as an HF checkpoint so
HFLayers and AutoModelForCausalLM read it as any other.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

HAVE_GGUF = importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="gguf (gguf-py, the GGUF writer and oracle) is not installed")

# The types gguf-py cannot quantize, written as random blocks: (values, bytes) of a block, and
# its f16 scale fields (byte offsets) with the size they are set to, which keeps its largest
# weight near 0.1 (codes and sub-block scales at their largest).
RANDOM_BLOCKS = {
    "Q2_K": (256, 84, ((80, 2e-3), (82, 2e-3))),  # d, dmin: 15 * 3 * d
    "Q3_K": (256, 110, ((108, 8e-4),)),  # d: 32 * 4 * d
    "Q4_K": (256, 144, ((0, 1e-4), (2, 5e-4))),  # d, dmin: 63 * 15 * d
    "Q5_K": (256, 176, ((0, 5e-5), (2, 5e-4))),  # 63 * 31 * d
    "Q6_K": (256, 210, ((208, 2.5e-5),)),  # 128 * 32 * d
    "IQ4_NL": (32, 18, ((0, 8e-4),)),  # 127 * d
    "IQ4_XS": (256, 136, ((0, 2.5e-5),)),  # 32 * 127 * d
}


@dataclass(frozen=True)
class GgufSpec:
    """One file: its architecture, sizes, and the ggml type of each tensor kind ("attn_q", "ffn_down_exps",
    "token_embd", ...; matrices default to Q8_0, norms and biases to F32)."""

    arch: str
    hidden: int = 64
    ffn: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # attention.key_length; None: not written (hidden // heads)
    vocab: int = 128
    experts: int = 0
    expert_ffn: int = 0
    top_k: int = 2
    tied: bool = False
    rope_theta: float = 10000.0
    types: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    metadata: dict[str, object] = field(default_factory=dict)  # more "<arch>." keys, or None to leave one out
    extra_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> shape, stored F32
    global_metadata: dict[str, object] = field(default_factory=dict)  # keys written as they are ("tokenizer.ggml.*")
    omitted: frozenset[str] = frozenset()  # tensor names left out of the file

    def layer_tensors(self) -> dict[str, tuple[int, ...]]:
        """Kind -> shape (row-major, as torch sees it) of one layer's tensors."""
        H, D = self.hidden, self.head_dim or self.hidden // self.heads
        shapes = {"attn_norm": (H,), "attn_q": (self.heads * D, H), "attn_k": (self.kv_heads * D, H),
                  "attn_v": (self.kv_heads * D, H), "attn_output": (H, self.heads * D), "ffn_norm": (H,)}
        if self.arch == "qwen2":
            shapes |= {"attn_q.bias": (self.heads * D,), "attn_k.bias": (self.kv_heads * D,),
                       "attn_v.bias": (self.kv_heads * D,)}
        if self.arch in ("qwen3", "qwen3moe"):
            shapes |= {"attn_q_norm": (D,), "attn_k_norm": (D,)}
        if self.experts:
            E, F = self.experts, self.expert_ffn
            return shapes | {"ffn_gate_inp": (E, H), "ffn_gate_exps": (E, F, H), "ffn_up_exps": (E, F, H),
                             "ffn_down_exps": (E, H, F)}
        return shapes | {"ffn_gate": (self.ffn, H), "ffn_up": (self.ffn, H), "ffn_down": (H, self.ffn)}

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> shape, for the whole file."""
        out = {"token_embd.weight": (self.vocab, self.hidden), "output_norm.weight": (self.hidden,)}
        if not self.tied:
            out["output.weight"] = (self.vocab, self.hidden)
        for i in range(self.layers):
            for kind, shape in self.layer_tensors().items():
                out[f"blk.{i}.{kind}" + ("" if "." in kind else ".weight")] = shape
        return {name: shape for name, shape in (out | self.extra_tensors).items() if name not in self.omitted}

    def type_of(self, name: str, shape: tuple[int, ...]) -> str:
        kind = name.removeprefix("blk.").split(".", 1)[-1].removesuffix(".weight") if name.startswith("blk.") \
            else name.removesuffix(".weight")
        return self.types.get(kind, "Q8_0" if len(shape) > 1 else "F32")


def write_gguf(path: Path, spec: GgufSpec) -> Path:
    """The file of `spec` at `path`, written by gguf-py's GGUFWriter."""
    import gguf

    rng = np.random.default_rng(spec.seed)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    for key, value in _metadata(spec).items():
        _add(writer, f"{spec.arch}.{key}", value)
    for key, value in spec.global_metadata.items():
        _add(writer, key, value)
    for name, shape in spec.tensors().items():
        kind = spec.type_of(name, shape)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in RANDOM_BLOCKS:
            writer.add_tensor(name, random_blocks(rng, kind, shape), raw_dtype=qtype)
            continue
        values = (1 + 0.1 * rng.standard_normal(shape) if "norm" in name else 0.05 * rng.standard_normal(shape))
        values = values.astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(rng: np.random.Generator, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 [..., rows, blocks per row * block bytes]: random codes, finite scales (RANDOM_BLOCKS)."""
    values, block_bytes, scales = RANDOM_BLOCKS[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, size=(rows * cols // values, block_bytes), dtype=np.uint8)
    for at, size in scales:
        scale = (size * rng.uniform(0.5, 1.0, size=blocks.shape[0])).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], cols // values * block_bytes)


def _metadata(spec: GgufSpec) -> dict[str, object]:
    meta = {
        "context_length": 512, "embedding_length": spec.hidden, "block_count": spec.layers,
        "feed_forward_length": spec.ffn, "attention.head_count": spec.heads,
        "attention.head_count_kv": spec.kv_heads, "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": spec.rope_theta, "vocab_size": spec.vocab,
    }
    if spec.head_dim is not None:
        meta |= {"attention.key_length": spec.head_dim, "attention.value_length": spec.head_dim}
    if spec.arch == "llama":  # llama.cpp writes it for Llama; transformers reads head_dim from it
        meta["rope.dimension_count"] = spec.head_dim or spec.hidden // spec.heads
    if spec.experts:
        meta |= {"expert_count": spec.experts, "expert_used_count": spec.top_k,
                 "expert_feed_forward_length": spec.expert_ffn}
    return {key: value for key, value in (meta | spec.metadata).items() if value is not None}


def _add(writer, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        writer.add_string(key, str(value))


def hf_reference(path: Path, out: Path) -> Path:
    """transformers' model of the GGUF file at `path` (its own loader: config from the metadata,
    gguf-py's dequantization, the Llama q/k permutation undone), saved as an f32 HF checkpoint."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF; its config (less the loader's note) and its
    # tensors are all an HF checkpoint is.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, out / "model.safetensors")
    return out
