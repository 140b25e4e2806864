"""The transformers sides the benchmarks (and tools/gpu_check's node-perf) time cakemp against are
transformers' own layers continuing their cache: a prompt, then a decode row, equal the oracle's.
A side that dropped its cache (a transformers version naming the argument otherwise takes an
unknown keyword silently) would time attention over one row and make every ratio a lie."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

from bench import blocks
from bench.step_growth import Transformers
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.tolerance import assert_close


def assert_continues_its_cache(forward: Callable[[torch.Tensor, int], torch.Tensor], path) -> None:
    """`forward(x, index_pos)`, a side's layers 0 and 1 of the checkpoint at `path` over x: [1, T, H] at
    positions index_pos.., equals the oracle's for a 6-row prompt and then the decode row after it."""
    oracle = HFLayers(path, [0, 1], torch.float32)
    prompt, row = torch.randn(1, 6, 64), torch.randn(1, 1, 64)
    with torch.inference_mode():
        got = forward(prompt, 0), forward(row, 6)
    assert_close(got[0], oracle(prompt, 0))
    assert_close(got[1], oracle(row, 6))


def test_the_batched_decode_side_continues_its_cache_as_transformers_does(tmp_path):
    path = make_checkpoint(tmp_path, "llama", num_hidden_layers=2)  # TINY: hidden 64, the bound's reductions
    side = Transformers(path, sessions=1, cached=1, layers=2)
    side.cache = transformers.DynamicCache(config=side.model.config)  # its own prompt forgotten: the oracle's
    assert_continues_its_cache(side._forward, path)


def test_the_block_benchmarks_side_continues_its_cache_as_transformers_does(tmp_path):
    path = make_checkpoint(tmp_path, "llama", num_hidden_layers=2)  # TINY: hidden 64, the bound's reductions
    side = blocks.HFLayers(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "sdpa")
    assert_continues_its_cache(lambda x, index_pos: side.prepare(x, index_pos)(), path)
