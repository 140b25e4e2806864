"""Block boundary benchmark: what a decode step costs the KV cache when a session's next row needs a new
block (every BLOCK positions, for every layer), at growing context lengths, side by side in one run.

    python -m bench.block_boundary [--contexts 256,4096,16384] [--sessions 8] [--layers 8] [--rounds 40]

For each context length, --sessions sessions each hold --layers KV slots of that many positions (the pools
and the block tables sized beforehand, so that nothing grows while it is timed); then each session's every slot is taken across
a block boundary, one `KVCache.reserve` per session, as a decode step's plan does, --rounds times. The
block tables are kept as on a GPU, a copy apart from the host's (`Tables(mirrored=True)`, here on the
CPU), brought up to date once a round, as a step reads them. Printed: the µs per slot crossing and per
round's update of the copy (CPU time), each with its ratio to the shortest context's: near 1, the cost
does not grow with the context (only the new blocks' entries are written, and copied, not whole tables).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.pool import machine_line
from cakemp.compute.kv_cache import BLOCK, KVCache, Tables


def crossing_us(context: int, sessions: int, layers: int, rounds: int) -> tuple[float, float]:
    """CPU µs per slot taken across a block boundary, the sessions `context` positions in, and per update
    of the tables' device copy after a round of them."""
    cache = KVCache(2, 16, torch.float32, torch.device("cpu"), max_context=context + (rounds + 1) * BLOCK)
    cache._tables = Tables(torch.device("cpu"), mirrored=True)  # a GPU's plan
    cache._tables._grow(sessions, layers, context // BLOCK + rounds + 1)  # no doubling while timed either
    blocks = sessions * (context // BLOCK + rounds + 1)
    for block_idx in range(layers):
        cache.pool(block_idx).grow(blocks, None)  # no doubling while timed
    start = context - context % BLOCK
    for session in range(sessions):
        cache.reserve(session, {block_idx: (0, start) for block_idx in range(layers)})
    cache.tables  # noqa: B018  (brought up to date: the prompts' entries are not timed)
    spent = copied = 0.0
    for r in range(rounds):
        position = start + r * BLOCK  # the first row of a block the slots do not hold yet
        for session in range(sessions):
            for slot in cache.slots(session).values():
                slot.length = position
            began = time.process_time()
            cache.reserve(session, {block_idx: (position, position + 1) for block_idx in range(layers)})
            spent += time.process_time() - began
        began = time.process_time()
        cache.tables  # noqa: B018  (what a step reads: the device copy, updated)
        copied += time.process_time() - began
    return spent / (rounds * sessions * layers) * 1e6, copied / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="256,4096,16384")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(machine_line())
    print(f"{args.sessions} sessions x {args.layers} KV slots, {args.rounds} block boundaries each")
    figures = {context: crossing_us(context, args.sessions, args.layers, args.rounds) for context in contexts}
    first = figures[contexts[0]]
    for context, (crossing, copy) in figures.items():
        print(f"context {context:6d}: {crossing:6.2f} µs per slot crossing ({crossing / first[0]:.2f}x the shortest's), "
              f"{copy:7.1f} µs per update of the device copy ({copy / first[1]:.2f}x)")


if __name__ == "__main__":
    main()
