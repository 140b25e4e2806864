"""Block boundary benchmark: what a decode step costs the KV cache when a session's next row needs a new
block (every BLOCK positions, for every layer), at growing context lengths, side by side in one run.

    python -m bench.block_boundary [--contexts 256,4096,16384] [--sessions 8] [--layers 8] [--rounds 40]

For each context length, --sessions sessions each hold --layers KV slots of that many positions (the pools
and the block tables sized beforehand, so that nothing grows while it is timed); then each session's every
slot is taken across a block boundary, --rounds times, two ways on two such caches, round by round in
turn: as a decode step's plan does (`KVCache.continuing`: every slot's new block at once), and one
`KVCache.reserve` per session (each slot planned on its own, as any other request's plan is). The block
tables are kept as on a GPU, a copy apart from the host's (`Tables(mirrored=True)`, here on the CPU),
brought up to date once a round, as a step reads them. Printed: the µs per slot crossing each way, their
ratio, and per round's update of the copy (CPU time), each with its ratio to the shortest context's: near
1, the cost does not grow with the context (only the new blocks' entries are written, and copied, not
whole tables).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.pool import machine_line
from cakemp.compute.kv_cache import BLOCK, KVCache, Tables


def filled(context: int, sessions: int, layers: int, rounds: int) -> KVCache:
    """A cache of `sessions` sessions holding `layers` slots of `context` positions, sized for `rounds` more blocks each."""
    cache = KVCache(2, 16, torch.float32, torch.device("cpu"), max_context=context + (rounds + 1) * BLOCK)
    cache._tables = Tables(torch.device("cpu"), mirrored=True)  # a GPU's plan
    cache._tables._grow(sessions, layers, context // BLOCK + rounds + 1)  # no doubling while timed either
    blocks = sessions * (context // BLOCK + rounds + 1)
    for block_idx in range(layers):
        cache.pool(block_idx).grow(blocks, None)  # no doubling while timed
    for session in range(sessions):
        cache.reserve(session, {block_idx: (0, context - context % BLOCK) for block_idx in range(layers)})
    cache.tables  # noqa: B018  (brought up to date: the prompts' entries are not timed)
    return cache


def crossing_us(context: int, sessions: int, layers: int, rounds: int) -> dict[str, tuple[float, float]]:
    """For each way (continuing, reserve): CPU µs per slot taken across a block boundary, the sessions
    `context` positions in, and per update of the tables' device copy after a round of them."""
    slots = range(layers)
    ways = {"continuing": lambda cache, session, position: cache.continuing(session, slots, position),
            "reserve": lambda cache, session, position: cache.reserve(
                session, {block_idx: (position, position + 1) for block_idx in slots})}
    caches = {way: filled(context, sessions, layers, rounds) for way in ways}
    spent, copied = dict.fromkeys(ways, 0.0), dict.fromkeys(ways, 0.0)
    for r in range(rounds):
        position = context - context % BLOCK + r * BLOCK  # the first row of a block the slots do not hold yet
        for way, cross in ways.items():
            cache = caches[way]
            for session in range(sessions):
                for slot in cache.slots(session).values():
                    slot.length = position
                began = time.process_time()
                cross(cache, session, position)
                spent[way] += time.process_time() - began
                assert all(len(slot.table) == position // BLOCK + 1 for slot in cache.slots(session).values())
            began = time.process_time()
            cache.tables  # noqa: B018  (what a step reads: the device copy, updated)
            copied[way] += time.process_time() - began
    return {way: (spent[way] / (rounds * sessions * layers) * 1e6, copied[way] / rounds * 1e6) for way in ways}


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
    for context, ways in figures.items():
        (crossing, copy), (reserved, _) = ways["continuing"], ways["reserve"]
        print(f"context {context:6d}: {crossing:6.2f} µs per slot crossing ({crossing / first['continuing'][0]:.2f}x the "
              f"shortest's; {reserved:.2f} a slot reserved on its own, {crossing / reserved:.2f}x), "
              f"{copy:7.1f} µs per update of the device copy ({copy / first['continuing'][1]:.2f}x)")


if __name__ == "__main__":
    main()
