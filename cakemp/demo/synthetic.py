"""A small synthetic Llama checkpoint, written locally so the demo and tests need no download.

The checkpoint has the layout of a real Hugging Face Llama export: `config.json`
(LlamaForCausalLM), seeded random bf16 weights sharded into several safetensors files with a
`model.safetensors.index.json`, a byte-level BPE `tokenizer.json` that adds `<s>` in front of
every prompt and, in the demo's checkpoint, a chat template (`chat_template.jinja`) as instruct
models ship one, so that `cakemp generate` and `cakemp serve`'s chat route take it. The weights
are random, so generated text is gibberish; everything else (shapes, names, GQA, tokenizer) is
what a real model gives the code paths.

`demo_checkpoint()` builds it once into the user's cache directory and reuses it after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Bump when the files written for the same spec change, so old cache entries are not reused.
FORMAT_VERSION = 3

BOS = "<s>"
EOS = "</s>"

# The BPE merges are learned from this text; its words tokenize into few tokens, anything else
# falls back to single bytes (byte-level BPE never fails to encode).
CORPUS = """\
Cake splits a large language model across many machines. The master keeps the embeddings,
the final norm and the language model head; every worker holds a contiguous range of
transformer blocks and streams hidden states back over the network. A worker node reads a
topology file, loads its layers, and answers each batch of layers with the new hidden state.
cakemp is a worker for machines with several graphics cards: one front process terminates
the connections, and one device process per card holds its own layers and its own key and
value caches. The hidden states travel between them without a copy. The quick brown fox
jumps over the lazy dog. Once upon a time there was a small model that wanted to talk, but
its weights were random, so every sentence it said was a happy jumble of words and pieces
of words. It said hello to the world, and the world said hello back, one token at a time.
"""

# A chat template in the form instruct models ship it: each turn opened by its role, closed by the
# end token (so a generated answer stops at `</s>`), then the assistant's turn opened.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {{- '<|' + message.role + '|>\\n' + message.content | trim + eos_token + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and seed of a synthetic checkpoint; the vocabulary size comes from the tokenizer."""

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    vocab_target: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    shards: int = 2
    seed: int = 20260303
    chat_template: bool = False  # write CHAT_TEMPLATE as chat_template.jinja

    def version_hash(self) -> str:
        """A short digest of everything that decides the written files."""
        key = json.dumps(
            {"format": FORMAT_VERSION, "spec": dataclasses.asdict(self), "corpus": CORPUS, "template": CHAT_TEMPLATE},
            sort_keys=True,
        )
        return hashlib.sha256(key.encode()).hexdigest()[:12]


# The demo's checkpoint: the default shape, with a chat template.
DEMO = SyntheticSpec(chat_template=True)


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/cakemp`, or `~/.cache/cakemp` when the variable is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cakemp"


def demo_dir(spec: SyntheticSpec) -> Path:
    """Where `demo_checkpoint` keeps the checkpoint of `spec`."""
    return cache_root() / f"demo-{spec.version_hash()}"


def demo_checkpoint(spec: SyntheticSpec = DEMO) -> Path:
    """The cached checkpoint for `spec`, written first if it is not there yet."""
    final = demo_dir(spec)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the final path and rename, so a reader never sees a half-written checkpoint
    # and two concurrent builders leave one complete copy.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write_checkpoint(tmp, spec)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_checkpoint(directory: Path, spec: SyntheticSpec = SyntheticSpec()) -> None:
    """Write config, tokenizer and sharded weights of `spec` into an existing `directory`."""
    directory = Path(directory)
    tokenizer = build_tokenizer(spec.vocab_target)
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "model_max_length": spec.max_position_embeddings,
                    "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n"
    )
    if spec.chat_template:
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_shards(directory, _weights(spec, vocab_size, _unprintable(tokenizer)), spec.shards)


def build_tokenizer(vocab_target: int) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, with `<s>` prepended to every encoded sequence."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def _unprintable(tokenizer: Tokenizer) -> list[int]:
    """Ids whose text alone is empty or does not print: the special tokens, control bytes, and
    lone bytes of a multi-byte character (they decode to U+FFFD)."""
    ids = []
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        if not text or "\ufffd" in text or not (text.isprintable() or text == "\n"):
            ids.append(i)
    return ids


def _weights(spec: SyntheticSpec, vocab_size: int, quiet: list[int]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name, drawn from one seeded generator, in bf16.

    Linear weights are N(0, 0.02) as in HF's initialisation, except the query and key
    projections: N(0, 1/H) gives unit-variance q and k for a normalised input, so attention
    logits spread over a few units and which key wins depends on the rotary positions (at
    0.02 the logits are ~0.1, attention is nearly uniform, and a generation with the rotary
    offset dropped gives the same tokens). Norm weights are near 1 (not exactly 1, so a
    missing or misplaced norm changes the output). An untied lm_head is drawn
    wider, N(0, 0.15), so logits spread over a few units as a trained model's do, and its rows
    for the `quiet` tokens 20x narrower: sampling then rarely picks a token that cannot print
    alone, and the (random, meaningless) text reads as pieces of words rather than U+FFFD.
    """
    g = torch.Generator().manual_seed(spec.seed)
    h, i = spec.hidden_size, spec.intermediate_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim

    def linear(rows: int, cols: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * std).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": linear(vocab_size, h)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.q_proj.weight"] = linear(h, h, std=h**-0.5)   # [nh*hd, H]
        tensors[p + "self_attn.k_proj.weight"] = linear(kv, h, std=h**-0.5)  # [nkv*hd, H]
        tensors[p + "self_attn.v_proj.weight"] = linear(kv, h)    # [nkv*hd, H]
        tensors[p + "self_attn.o_proj.weight"] = linear(h, h)     # [H, nh*hd]
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_proj.weight"] = linear(i, h)        # [I, H]
        tensors[p + "mlp.up_proj.weight"] = linear(i, h)          # [I, H]
        tensors[p + "mlp.down_proj.weight"] = linear(h, i)        # [H, I]
    tensors["model.norm.weight"] = norm()
    if not spec.tie_word_embeddings:
        lm_head = linear(vocab_size, h, std=0.15)
        lm_head[quiet] /= 20
        tensors["lm_head.weight"] = lm_head
    return tensors


def _write_shards(directory: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """Split the tensors, in order, into `shards` files named as HF names them, plus the index."""
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        filename = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * per_shard:(s + 1) * per_shard]
        save_file({n: tensors[n] for n in part}, str(directory / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
