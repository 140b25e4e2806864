"""The front's heap: glibc's malloc told to keep the memory that frames pass through.

Every request's payload (a prompt's hidden states: 512 KiB for 512 tokens of hidden 256 in f32,
4 MiB at hidden 4096 in bf16) is allocated, copied through and freed: the stream's buffer, the
frame's payload, the reply. By default glibc serves an allocation of more than 128 KiB (or more
than the largest it has freed since) with a fresh mmap, and hands the top of its heap back to
the kernel once more than twice that is free there; so each such frame paid for its pages again,
a page fault and a zeroed page per 4 KiB: about a quarter of the front's main thread's CPU on a
512-token prompt (3.3-3.4 ms against 2.4-2.7 ms once kept, three runs each, on the 2-core VM).

Kept here: allocations up to MMAP_THRESHOLD come from the heap, and the heap keeps up to
TRIM_THRESHOLD free at its top. The front therefore holds at most that much more than it uses
after a burst of large frames (its buffers themselves are bounded by --max-buffered-mib). Only
the front asks this: device processes are spawned afresh, with glibc's defaults, and allocate
through torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util

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
