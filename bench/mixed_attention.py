"""Mixed-step attention: a step's decode rows and prompt chunks in one attention call, or as cakemp
calls them (every decode row in one call, each chunk in one of its own), side by side in one run.

    python -m bench.mixed_attention [--device cpu|cuda] [--dtype f32|bf16] [--heads 32,8,128]
                                    [--context 512] [--steps "8+1x128,32+2x128,32"] [--reps 20] [--threads 1]

One attention layer's step over a paged KV pool (compute/kv_cache.py: blocks of 16 positions, the
sessions' blocks interleaved as concurrent sessions leave them), of query heads, KV heads and head
size --heads (Llama-3-8B's by default). A step "8+1x128" holds 8 decode rows, each over --context
positions of its own, and one 128-token prompt chunk after --context / 2 positions of its prompt.
Its rows' attention is computed four ways, each against the first within f32's or bf16's rounding:

* split: cakemp's `LayerPages.attend` (compute/paged_step.py): the decode rows in one call (on a
  GPU the paged kernel over their blocks where they lie, model/paged_attention.py; on a CPU SDPA over
  their gathered blocks with a mask), each chunk in one causal call over its own blocks;
* gathered: split with its decode rows over gathered blocks on a GPU too (the same as split on a CPU);
* padded: one SDPA call over every request, its rows padded to the longest request's and its keys
  gathered to the longest context, with a [B, 1, T, S] mask (built in the call's time);
* flex: one FlexAttention call (`torch.compile`d once, before timing) over every row, each request's
  keys gathered into one sequence and a document mask (each row: its request's keys, up to its own
  position); the block mask is made each step (`create_block_mask`, in the call's time; also
  printed alone), as it would be with the step's rows and tables changing;
* flex, mask given: the same call, its block mask made outside the time.

Each way gathers its keys into the same kept space (`KVCache.gather_space`), as split does.

Printed per step: each way's milliseconds a call (best of --reps, CUDA synchronised), and its
ratio over split's. flex's compile time is printed once per step shape (a step of another shape
compiles again, as every new row count would unless compiled dynamic).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bench.blocks import timed
from bench.pool import machine_line
from cakemp.compute.kv_cache import BLOCK, KVCache
from cakemp.compute.paged_step import StepRows, in_place_attention

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


class Step:
    """A step of `decodes` decode rows at `context` and `chunks` prompt chunks of `T` rows at
    `context // 2`, over one layer's pool in `cache`; q: [1, H_q, N, D], decode rows first."""

    def __init__(self, decodes: int, chunks: int, T: int, context: int, heads: tuple[int, int, int],
                 device: torch.device, dtype: torch.dtype):
        H_q, H_kv, D = heads
        self.cache = cache = KVCache(H_kv, D, dtype, device, max_context=context + T + 1)
        cache.paged_attend = in_place_attention(device, dtype, H_q // H_kv, D)  # as a runner's (a GPU's kernel)
        self.lengths = [1] * decodes + [T] * chunks
        self.starts = [context] * decodes + [context // 2] * chunks
        sessions = range(1, decodes + chunks + 1)
        ends = [start + T for start, T in zip(self.starts, self.lengths, strict=True)]
        # Each session's blocks taken a block at a time, all sessions in turn: interleaved in the pool.
        for position in range(0, max(ends), BLOCK):
            for session, end in zip(sessions, ends, strict=True):
                if position < end:
                    cache.reserve(session, {0: (position, min(position + BLOCK, end))})
        slots = [cache.slot(session, 0) for session in sessions]
        for rows in cache.pools[0].rows():
            rows.copy_(torch.randn(rows.shape, device=device).to(dtype))
        self.rows = StepRows(cache, sessions, self.lengths, self.starts, [[slot] for slot in slots], [0])
        self.q = torch.randn(1, H_q, sum(self.lengths), D, device=device).to(dtype)
        self.scale = D**-0.5
        self.tables = [slot.table[: -(-end // BLOCK)] for slot, end in zip(slots, ends, strict=True)]

    def split(self) -> torch.Tensor:
        return self.rows.layer(0).attend(self.q, None, self.scale)

    def gathered(self) -> torch.Tensor:
        """split, its decode rows attending over a gathered copy of their blocks whatever the device."""
        in_place, self.cache.paged_attend = self.cache.paged_attend, None
        try:
            return self.split()
        finally:
            self.cache.paged_attend = in_place

    def padded(self) -> torch.Tensor:
        """Every request in one SDPA call: rows padded to the longest request, keys to the longest context."""
        q, device = self.q, self.q.device
        B, T, width = len(self.lengths), max(self.lengths), max(map(len, self.tables))
        tables = self.rows.tables(0)[:, :width]  # [B, width], past a table's end the null block
        k, v = self.cache.pools[0].gather(tables, self.cache.gather_space(tables.numel()))  # [B, H_kv, width * BLOCK, D]
        firsts, lengths = self.rows.firsts, self.lengths
        rows = torch.tensor([firsts[b] + min(t, lengths[b] - 1) for b in range(B) for t in range(T)], device=device)
        q_pad = q[0].index_select(1, rows).view(q.shape[1], B, T, -1).transpose(0, 1)  # [B, H_q, T, D]
        positions = torch.tensor([[s + t for t in range(T)] for s in self.starts], device=device)  # [B, T]
        keys = torch.arange(width * BLOCK, device=device)
        mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, S]
        out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=mask[:, None], scale=self.scale, enable_gqa=True)
        picked = torch.cat([out[b, :, : self.lengths[b]] for b in range(B)], dim=1)  # [H_q, N, D]
        return picked[None]

    def flex_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's keys and values as one sequence, [1, H_kv, ΣS, D] each."""
        table = torch.tensor([b for t in self.tables for b in t], device=self.q.device)
        return self.cache.pools[0].gather(table[None], self.cache.gather_space(table.numel()))

    def flex_mask(self):
        """The block mask of `flex_keys`' sequence: each row sees its request's keys up to its own position."""
        device = self.q.device
        doc_q, pos_q = self.rows.request, self.rows.positions[0]  # [N] each row's request, its position
        spans = torch.tensor([len(t) * BLOCK for t in self.tables], device=device)
        doc_k = torch.repeat_interleave(torch.arange(len(self.tables), device=device), spans)
        pos_k = torch.arange(int(spans.sum()), device=device) - torch.repeat_interleave(spans.cumsum(0) - spans, spans)

        def seen(b, h, q_index, k_index):
            return (doc_q[q_index] == doc_k[k_index]) & (pos_k[k_index] <= pos_q[q_index])

        return create_block_mask(seen, None, None, self.q.shape[2], int(spans.sum()), device=device)

    def flex(self, attend, mask=None) -> torch.Tensor:
        k, v = self.flex_keys()
        return attend(self.q, k, v, block_mask=self.flex_mask() if mask is None else mask, scale=self.scale,
                      enable_gqa=True)


def measure(spec: str, context: int, heads: tuple[int, int, int], device: torch.device, dtype: torch.dtype,
            reps: int, flex: bool = True) -> dict[str, float]:
    """{way: ms a call} for a step `spec` ("decodes[+chunks x T]"), checked against split; without `flex`,
    split and gathered only (no compile)."""
    decodes, _, rest = spec.partition("+")
    chunks, T = (int(n) for n in rest.split("x")) if rest else (0, 1)
    attend = torch.compile(flex_attention, dynamic=False)  # each step shape its own: a dynamic recompile failed on a CPU
    with torch.inference_mode():  # as a device's step (its pool is made under it)
        step = Step(int(decodes), chunks, T, context, heads, device, dtype)
        reference = step.split()
        ways = {"split": step.split, "gathered": step.gathered}
        figures = {}
        if flex:
            start = time.perf_counter()
            given = step.flex_mask()
            ways |= {"padded": step.padded, "flex": lambda: step.flex(attend),
                     "flex, mask given": lambda: step.flex(attend, given)}
            step.flex(attend)
            figures["compile s"] = time.perf_counter() - start
        bound = 1e-4 if dtype == torch.float32 else 2e-2
        for name, way in ways.items():
            error = (way().float() - reference.float()).abs().max().item()
            if error > bound * reference.float().abs().max().item():
                raise AssertionError(f"{spec}: {name} differs from split by {error}")
            figures[name] = timed(way, device, reps) * 1e3
        if flex:
            figures["block mask alone"] = timed(step.flex_mask, device, reps) * 1e3
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="f32")
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", default="8+1x128,32+2x128,32")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = tuple(int(n) for n in args.heads.split(","))
    device = torch.device(args.device)
    print(machine_line())
    print(f"{args.device}, {args.dtype}, heads {heads}, context {args.context}, {args.threads} thread(s), "
          f"best of {args.reps}; ms a call (over split)")
    print("| step | split | gathered | padded | flex | flex, mask given | block mask alone | flex compile |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.steps.split(","):
        f = measure(spec, args.context, heads, device, DTYPES[args.dtype], args.reps)
        cells = [f"{f[name]:.3f} ({f[name] / f['split']:.2f}x)" for name in ("gathered", "padded", "flex", "flex, mask given")]
        print(f"| {spec} | {f['split']:.3f} | " + " | ".join(cells) +
              f" | {f['block mask alone']:.3f} | {f['compile s']:.1f} s |")


if __name__ == "__main__":
    main()
