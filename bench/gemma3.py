"""Gemma 3 layers: cakemp's decoder block against HF transformers' Gemma3DecoderLayer, same weights.

    python -m bench.gemma3 [--threads N] [--dtypes f32,bf16] [--steps 20]

Writes a random Gemma3ForCausalLM checkpoint with gemma-3-1b's layer shape (hidden 1152,
4 query heads on 1 kv head, head_dim 256, intermediate 6912, window 512) and 6 layers, the
family's pattern of five local layers and one global, bf16, to a temp dir; then, in one
process with the same thread count for both, as bench/blocks.py does for Llama:

* decode: one new token at context 1024 (then 1025, ...) through all 6 layers, so local
  layers read their 512-position window and the global one the whole context; HF's layers
  with a DynamicCache (which keeps only the window for local layers), eager attention (HF's
  reference path, and the one Gemma 3's model card asks for) and sdpa; steps alternate
  between the implementations and the best of each is reported, per layer;
* prefill: 128 tokens into an empty cache, the same way.

HF's masks (one per layer type) and rotary tables (one per layer type) are built outside its
timed call; cakemp's timing includes its own, its input checks and KV bookkeeping.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from bench import blocks
from bench.blocks import measure
from cakemp.compute.runner import BlockRunner
from tests.support.checkpoints import CACHE_ARGUMENT

SHAPE = dict(
    hidden_size=1152,
    intermediate_size=6912,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    num_hidden_layers=6,
    sliding_window=512,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    vocab_size=256,
    max_position_embeddings=32768,
)
CONTEXT = 1024
PREFILL = 128
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def write_checkpoint(directory: Path) -> None:
    config = transformers.Gemma3TextConfig(**SHAPE)
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF initialises the (1 + w) norms' w at 0; any w costs the same
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="200MB")


class HFLayers(blocks.HFLayers):
    """HF's Gemma 3 decoder layers with their own DynamicCache, called as Gemma3TextModel calls them."""

    def prepare(self, x: torch.Tensor, index_pos: int) -> Callable[[], torch.Tensor]:
        """The timed call, with the masks and cos/sin of both layer types prepared outside it."""
        self.config._attn_implementation = self.attention
        positions = torch.arange(index_pos, index_pos + x.shape[1])[None]
        kwargs = dict(config=self.config, inputs_embeds=x, attention_mask=None, position_ids=positions,
                      **{CACHE_ARGUMENT: self.cache})
        masks = {"full_attention": create_causal_mask(**kwargs),
                 "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
        rotary = {kind: self.model.rotary_emb(x, positions, kind) for kind in masks}
        kinds = self.config.layer_types

        def run() -> torch.Tensor:
            h = x
            for i, layer in enumerate(self.model.layers):
                h = layer(h, position_embeddings=rotary[kinds[i]], attention_mask=masks[kinds[i]],
                          position_ids=positions, **{CACHE_ARGUMENT: self.cache})
            return h

        return run


def compare(path: Path, dtype: torch.dtype, steps: int) -> dict[str, dict[str, float]]:
    """Best ms per layer for decode and prefill: cakemp, HF eager, HF sdpa."""
    layers = SHAPE["num_hidden_layers"]
    runner = BlockRunner.load(path, [f"model.layers.{i}" for i in range(layers)], "cpu", dtype)
    model = transformers.Gemma3ForCausalLM.from_pretrained(path, dtype=dtype)
    hf = {name: HFLayers(model, name) for name in ("eager", "sdpa")}

    return measure(runner, hf, layers, SHAPE["hidden_size"], dtype, torch.device("cpu"), steps, CONTEXT, PREFILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, cpu")
    print(f"gemma-3-1b layer: hidden {SHAPE['hidden_size']}, heads 4/1 kv, head_dim 256, "
          f"intermediate {SHAPE['intermediate_size']}; 5 local (window 512) + 1 global")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_checkpoint(path)
        for name in args.dtypes.split(","):
            r = compare(path, DTYPES[name], args.steps)
            blocks.print_comparison(name, r, CONTEXT, PREFILL)


if __name__ == "__main__":
    main()
