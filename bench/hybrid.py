"""Qwen3.5 and Qwen3-MoE layers: cakemp's BlockRunner against HF transformers' layers, same weights.

    python -m bench.hybrid [--threads N] [--dtype f32|bf16] [--steps N]

Writes three random checkpoints at shapes scaled down from the real ones (Qwen3.5-9B:
hidden 4096, 16 x 256 gated attention heads on 4 kv heads, linear attention 16 key heads x
128 serving 32 value heads x 128, MLP 12288; Qwen3-30B-A3B: hidden 2048, 128 experts, 8 per
token, expert MLP 768) to fit this machine:

* linear: one Qwen3.5 Gated DeltaNet layer, hidden 1024, 8 key heads x 128 serving 16 value
  heads x 128, dense MLP 3072;
* full: one Qwen3.5 gated full-attention layer, hidden 1024, 8 x 128 heads on 2 kv heads
  (a quarter rotated), dense MLP 3072;
* moe: one Qwen3-MoE layer, hidden 1024, 8 x 128 heads on 2 kv heads, 32 experts, 4 per
  token, expert MLP 384 (HF's experts through its default grouped_mm path).

and times, in one process with the same thread count for both, per layer:
* decode: one new token at context 512 (then 513, ...), after a 512-token prefill into the
  session; steps alternate between the implementations and the best (minimum) of each is
  reported: the machine may be shared, and interference only ever adds time;
* prefill: 512 tokens into an empty session, the same way.

HF runs its layer as tests/support/checkpoints.py's HFLayers does (HF's own cache classes, eager
attention; its Gated DeltaNet falls back to its torch chunked/recurrent forms, since
flash-linear-attention and causal-conv1d are not installed here); its mask and cos/sin are
built inside the timed call, as cakemp's are.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.blocks import timed
from cakemp.compute.runner import BlockRunner
from tests.support.checkpoints import HFLayers, make_checkpoint

CPU = torch.device("cpu")

CONTEXT = 512
PREFILL = 512
COMMON = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=256,
              max_position_embeddings=4096, num_hidden_layers=2)
KINDS = {
    # (family, overrides, the layer timed)
    "linear": ("qwen3_5", dict(COMMON, intermediate_size=3072, linear_num_key_heads=8, linear_key_head_dim=128,
                               linear_num_value_heads=16, linear_value_head_dim=128,
                               layer_types=["linear_attention", "full_attention"]), 0),
    "full": ("qwen3_5", dict(COMMON, intermediate_size=3072, linear_num_key_heads=8, linear_key_head_dim=128,
                             linear_num_value_heads=16, linear_value_head_dim=128,
                             layer_types=["linear_attention", "full_attention"]), 1),
    "moe": ("qwen3_moe", dict(COMMON, intermediate_size=3072, num_experts=32, num_experts_per_tok=4,
                              moe_intermediate_size=384, norm_topk_prob=True), 0),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def compare(path: Path, family: str, index: int, dtype: torch.dtype, steps: int) -> dict[str, tuple[float, float]]:
    """Best ms of (cakemp, HF) for decode and prefill of layer `index`."""
    prefix = "model.language_model.layers" if family.startswith("qwen3_5") else "model.layers"

    def ops(position: int) -> list[tuple[str, int, int]]:
        return [(f"{prefix}.{index}", position, index)]

    runner = BlockRunner.load(path, [f"{prefix}.{index}"], "cpu", dtype)
    hf = HFLayers(path, [index], dtype, experts="grouped_mm" if family.endswith("moe") else "eager")
    hidden = runner.config.hidden_size
    generator = torch.Generator().manual_seed(1)

    def tokens(T: int) -> torch.Tensor:
        return torch.randn(1, T, hidden, generator=generator).to(dtype)

    results = {}
    with torch.inference_mode():
        context = tokens(CONTEXT)
        runner.run(0, context, runner.ops(ops(0)))
        hf(context, 0)
        ours, theirs = [], []
        for step in range(steps + 2):  # two warm-up steps
            x, position = tokens(1), CONTEXT + step
            t_ours = timed(lambda x=x, position=position: runner.run(0, x, runner.ops(ops(position))), CPU)
            t_hf = timed(lambda x=x, position=position: hf(x, position), CPU)
            if step >= 2:
                ours.append(t_ours)
                theirs.append(t_hf)
        results["decode"] = (min(ours) * 1e3, min(theirs) * 1e3)

        ours, theirs = [], []
        for step in range(max(3, steps // 4) + 1):
            x = tokens(PREFILL)
            runner.free_session(0)
            t_ours = timed(lambda x=x: runner.run(0, x, runner.ops(ops(0))), CPU)
            hf.cache = type(hf.cache)(config=hf.config)
            t_hf = timed(lambda x=x: hf(x, 0), CPU)
            if step >= 1:
                ours.append(t_ours)
                theirs.append(t_hf)
        results["prefill"] = (min(ours) * 1e3, min(theirs) * 1e3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=DTYPES, default="f32")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"threads={args.threads} dtype={args.dtype} context={CONTEXT} prefill={PREFILL} steps={args.steps}")
    print(f"{'layer':8} {'phase':8} {'cakemp ms':>10} {'HF ms':>10} {'cakemp/HF':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, (family, overrides, index) in KINDS.items():
            path = make_checkpoint(Path(tmp) / kind, family, dtype=dtype, **overrides)
            for phase, (ours, theirs) in compare(path, family, index, dtype, args.steps).items():
                print(f"{kind:8} {phase:8} {ours:10.2f} {theirs:10.2f} {ours / theirs:10.2f}")


if __name__ == "__main__":
    main()
