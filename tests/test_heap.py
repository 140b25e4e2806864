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


_FREEZE_PROBE = """
import gc
from cakemp import heap
loaded = [[i] for i in range(1000)]  # containers the collector tracks
frozen = heap.freeze_loaded()
tracked = {id(o) for o in gc.get_objects()}
cycle = []
cycle.append(cycle)  # garbage made while serving, reachable only from itself
del cycle
print(frozen, sum(id(o) in tracked for o in loaded), gc.collect())
"""


def test_what_was_loaded_leaves_the_collectors_passes_and_later_garbage_is_still_collected():
    out = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, check=True).stdout
    frozen, still_tracked, collected = map(int, out.split())
    assert frozen >= 1000 and still_tracked == 0  # every loaded container is out of its passes
    assert collected >= 1  # the collector still runs over what came after: the cycle is freed
