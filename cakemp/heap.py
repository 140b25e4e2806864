"""A serving process's heap: what it loaded kept out of the garbage collector's passes (the front,
each device, `cakemp serve`), and (the front, each device) glibc's malloc told to keep the memory
that frames and a prompt's activations pass through.

Python's cyclic garbage collector runs every few hundred net allocations of container objects, and
now and then a full pass that walks every object the process holds. A device process holds a few
hundred thousand once torch and its layers are loaded (a full pass over them took about 40 ms on
the 2-core VM, `python -m bench.gc_pause`, every session's step stalled meanwhile), the front tens
of thousands. What a process loads at start it keeps for its life, so once loaded, `freeze_loaded`
moves all of it out of the collector's reach (`gc.freeze`); the collector keeps running over what
serving allocates. (A frozen object whose count of references drops to zero is still freed; only a
reference cycle among frozen objects would never be: nothing loaded at start forms one later.)

Every request's payload (a prompt's hidden states: 512 KiB for 512 tokens of hidden 256 in f32,
4 MiB at hidden 4096 in bf16) is allocated, copied through and freed: the stream's buffer, the
frame's payload, the reply. By default glibc serves an allocation of more than 128 KiB (or more
than the largest it has freed since) with a fresh mmap, and hands the top of its heap back to
the kernel once more than twice that is free there; so each such frame paid for its pages again,
a page fault and a zeroed page per 4 KiB: about a quarter of the front's main thread's CPU on a
512-token prompt (3.3-3.4 ms against 2.4-2.7 ms once kept, three runs each, on the 2-core VM).

A device's prompt allocates and frees its activations the same way, MiBs each (a [512, 1792] bf16
MLP activation: 1.8 MiB), and, with 16-bit weights on a CPU, glibc kept mapping them afresh
prompt after prompt: 5,000-9,000 page faults a 512-token prompt through four layers of hidden 512
(bf16 or f16) after the first few, about 0 once kept, and the prompt through a node 0.89x (bf16)
and 0.93x (f16) the time (`bench.request_cost --hidden 512 --layers 4 --dtype bf16`; a live node's
faults are counted by tests/node/test_prompt_memory.py).

Kept here: allocations up to MMAP_THRESHOLD come from the heap, and the heap keeps up to
TRIM_THRESHOLD free at its top. The front therefore holds at most that much more than it uses
after a burst of large frames (its buffers themselves are bounded by --max-buffered-mib), and a
device that much more than its largest step needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the threshold it moves by itself
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Tell this process's malloc to keep freed memory for reuse; False where it cannot be told (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or one without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_loaded() -> int:
    """Exempt every object this process holds now from the garbage collector's passes (call once
    loaded, before serving): what is garbage already is collected first. Returns how many were."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
