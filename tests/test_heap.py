"""heap: once told, glibc keeps a freed frame-sized buffer for reuse instead of unmapping it."""

import platform
import subprocess
import sys

import pytest

# In a fresh interpreter (the test process's heap is already shaped by everything it loaded): the
# resident bytes gained by filling a 16 MiB buffer, and those still held once it is freed.
_PROBE = """
import sys
from cakemp import heap
from cakemp.rss import resident_bytes
kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
before = resident_bytes()
buffer = b"\\x01" * (16 << 20)  # every page written
filled = resident_bytes()
del buffer
print(kept, filled - before, resident_bytes() - before)
"""


def held_after_free(mode: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout
    kept, filled, held = out.split()
    return kept, int(filled), int(held)


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc's mallopt")
def test_a_freed_buffer_is_kept_only_once_told():
    _, filled, held = held_after_free("default")
    assert filled >= 15 << 20 and held < 4 << 20  # glibc's default: a fresh mapping, unmapped at free
    kept, filled, held = held_after_free("keep")
    assert kept == "True" and filled >= 15 << 20 and held >= 15 << 20  # kept in the heap, for the next frame
