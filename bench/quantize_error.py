"""The perplexity change of --quantize: a tiny Llama trained here on a short text, its layers loaded
unquantized and rounded (int8; int4 in groups of 32, 64, 128), perplexity side by side in one run.

    python -m bench.quantize_error [--steps 100] [--seed 0]

The text is the opening of Moby-Dick (1851, public domain; tests/support/texts/), read as bytes
(a vocabulary of 256): its first 85 % trains, the rest is held out. The model (transformers'
LlamaForCausalLM, f32: hidden 128, 4 query heads on 2 kv heads of 32, intermediate 256, 2 layers,
the smallest shapes every group size divides) trains for --steps AdamW steps on random 64-byte
windows, 16 a batch, on one thread (about 5 s): at 100 steps the held-out perplexity is near its
lowest (13, seed 0; by 300 steps the model has memorized the training part, 2.1, and the held-out
part has risen to 68). It is saved as an HF checkpoint and its layers loaded by
BlockRunner.load onto the CPU in f32, with quantize=None and with each Rounding (what `cakemp run
--quantize` passes); embeddings, final norm and head are the trained model's, in f32, so only
the layers change. Perplexity: exp of the mean cross-entropy of each next byte, the held-out
part (and the training part) cut into 64-byte prompts, each from position 0 (the positions the
model trained at). The unquantized runner is
checked against transformers' own forward of the same bytes (printed: they agree to f32 rounding),
and the layers skipped altogether (embeddings straight to the head) show how much they carry.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
import transformers

from cakemp.compute.loading import Rounding
from cakemp.compute.runner import BlockRunner

TEXT = Path(__file__).resolve().parent.parent / "tests" / "support" / "texts" / "moby_dick_loomings.txt"
SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
WINDOW, BATCH = 64, 16
SCHEMES = {"unquantized": None, "int8, one scale a row": Rounding("int8", 128),
           "int4, groups of 32": Rounding("int4", 32), "int4, groups of 64": Rounding("int4", 64),
           "int4, groups of 128": Rounding("int4", 128)}


def split_text() -> tuple[torch.Tensor, torch.Tensor]:
    """The text's bytes as int64 ids: (training part, held-out part)."""
    ids = torch.tensor(list(TEXT.read_bytes()), dtype=torch.int64)
    cut = int(len(ids) * 0.85)
    return ids[:cut], ids[cut:]


def train(ids: torch.Tensor, steps: int, seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - WINDOW, (BATCH,))
        batch = torch.stack([ids[s:s + WINDOW] for s in starts])  # [BATCH, WINDOW]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def windows(ids: torch.Tensor) -> list[torch.Tensor]:
    """`ids` cut into WINDOW-byte prompts (the last one shorter): the positions the model trained at."""
    return list(ids.split(WINDOW))


def perplexity(model: transformers.LlamaForCausalLM, runner: BlockRunner | None, ids: torch.Tensor) -> float:
    """exp(mean next-byte cross-entropy) over `ids`' windows, each a prompt from position 0 (the
    session's KV replaced), the layers computed by `runner` (None: skipped, the embeddings go
    straight to the head: what the layers add, the scale a rounding error is read against)."""
    losses = []
    for window in windows(ids):
        hidden = model.model.embed_tokens(window)[None]  # [1, T, 128]
        if runner is not None:
            hidden = runner.run(0, hidden, runner.ops([(layer, 0, i) for i, layer in enumerate(runner.layers)]))
        logits = model.lm_head(model.model.norm(hidden))[0]  # [T, 256]
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum"))
    return math.exp(sum(losses).item() / sum(len(window) - 1 for window in windows(ids)))


def reference_perplexity(model: transformers.LlamaForCausalLM, ids: torch.Tensor) -> float:
    """The same figure from transformers' own forward of the whole model."""
    losses = [model(input_ids=w[None], labels=w[None]).loss * (len(w) - 1) for w in windows(ids)]
    return math.exp(sum(losses).item() / sum(len(window) - 1 for window in windows(ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    training, held_out = split_text()
    start = time.perf_counter()
    model = train(training, args.steps, args.seed)
    trained = time.perf_counter() - start
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model.save_pretrained(tmp)
        layers = [f"model.layers.{i}" for i in range(SHAPE["num_hidden_layers"])]
        for name, quantize in SCHEMES.items():
            runner = BlockRunner.load(tmp, layers, "cpu", torch.float32, pack_weights=False, quantize=quantize)
            rows[name] = [perplexity(model, runner, part) for part in (held_out, training)]
        rows["layers skipped"] = [perplexity(model, None, part) for part in (held_out, training)]
        reference = reference_perplexity(model, held_out)
    print(f"{len(training)} training bytes, {len(held_out)} held out; {args.steps} steps in {trained:.1f} s "
          f"(seed {args.seed}); transformers' held-out perplexity {reference:.4f}")
    print("| layers | held-out perplexity | vs unquantized | training-text perplexity | vs unquantized |")
    print("|---|---:|---:|---:|---:|")
    exact_held, exact_train = rows["unquantized"]
    for name, (held, seen) in rows.items():
        print(f"| {name} | {held:.4f} | {held / exact_held:.4f} | {seen:.4f} | {seen / exact_train:.4f} |")


if __name__ == "__main__":
    main()
