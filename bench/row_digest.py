"""Row digest benchmark: what naming a request's rows costs a device with prefix reuse, the chain of
SHA-256 digests it computes (compute/row_chain.py) beside the same chain of BLAKE2b digests, in one run.

    python -m bench.row_digest [--rows 128] [--repeats 30]

Every row of every request is hashed on the device's main thread, chained on the digest before it.
For rows of a few model widths (hidden 2048 in f32, 4096 and 8192 in bf16: 8, 8 and 16 KiB), random
bytes: the time to chain --rows rows (a prompt chunk) with RowChain.extension and with BLAKE2b (32-byte
digests, chained the same way), best of --repeats, and one row (a decode step's), best of 100 x --repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import timeit

from bench.pool import machine_line
from cakemp.compute.row_chain import DIGEST, RowChain

WIDTHS = (("hidden 2048, f32", 2048 * 4), ("hidden 4096, bf16", 4096 * 2), ("hidden 8192, bf16", 8192 * 2))


def blake2b_chain(previous: bytes, rows: memoryview, row_bytes: int) -> bytearray:
    """The same chain as RowChain's, with BLAKE2b digests."""
    digests = bytearray()
    for start in range(0, len(rows), row_bytes):
        h = hashlib.blake2b(previous, digest_size=DIGEST)
        h.update(rows[start : start + row_bytes])
        previous = h.digest()
        digests += previous
    return digests


def best_us(call, repeats: int) -> float:
    return min(timeit.repeat(call, number=1, repeat=repeats)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows of a prompt chunk")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(machine_line())
    print(f"| row | {args.rows} rows, SHA-256 | BLAKE2b | ratio | one row, SHA-256 | BLAKE2b | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row_bytes in WIDTHS:
        chain = RowChain(row_bytes)
        chunk, row = memoryview(os.urandom(row_bytes * args.rows)), memoryview(os.urandom(row_bytes))
        figures = []
        for rows, repeats in ((chunk, args.repeats), (row, 100 * args.repeats)):
            sha = best_us(lambda rows=rows: chain.extension(rows), repeats)
            blake = best_us(lambda rows=rows: blake2b_chain(b"", rows, row_bytes), repeats)
            figures += [f"{sha:.1f} µs", f"{blake:.1f} µs", f"{sha / blake:.2f}"]
        print(f"| {name} | " + " | ".join(figures) + " |")


if __name__ == "__main__":
    main()
