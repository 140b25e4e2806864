"""A GGUF file read by a node reads the served layers' tensors only: after the file's pages are
dropped from the page cache, loading one layer of four (BlockRunner.load, as a device process
does) brings that layer's bytes into memory and leaves the other layers' on disk, as mincore(2)
tells page by page. (Cake dequantizes every tensor of the file on every node.)"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch

from cakemp.checkpoint.gguf import GgufFile
from cakemp.compute.runner import BlockRunner
from tests.support.gguf_files import GgufSpec, needs_gguf, write_gguf

# About 4 MiB a layer in Q8_0: the kernel's read-around of a page fault (128 KiB by default)
# spills a few percent into a neighbour at most.
SPEC = GgufSpec("llama", hidden=512, ffn=2048, heads=4, kv_heads=2)


def resident(path: Path) -> list[bool]:
    """Whether each page of the file is in the page cache (mincore on a fresh private map of it)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable, so ctypes can take its address
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    start = ctypes.c_char.from_buffer(data)
    libc = ctypes.CDLL(None, use_errno=True)
    failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vector)
    del start
    data.close()
    if failed:
        pytest.skip(f"mincore failed here: errno {ctypes.get_errno()}")
    return [bool(v & 1) for v in vector]


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def layer_fraction(pages: list[bool], gguf: GgufFile, layer: int) -> float:
    """The share of the pages wholly inside layer `layer`'s tensors that are resident."""
    inside = [p for info in gguf.tensors.values() if info.name.startswith(f"blk.{layer}.")
              for p in range(-(-info.start // mmap.PAGESIZE), (info.start + info.nbytes) // mmap.PAGESIZE)]
    return sum(pages[p] for p in inside) / len(inside)


@needs_gguf
def test_loading_one_layer_reads_that_layer_s_bytes_only(tmp_path):
    path = write_gguf(tmp_path / "llama.gguf", SPEC)
    gguf = GgufFile(path)
    drop_from_page_cache(path)
    if sum(resident(path)) > 0.05 * len(resident(path)):
        pytest.skip("this filesystem keeps the file in memory (the page cache could not be dropped)")
    runner = BlockRunner.load(path, ["model.layers.2"], "cpu", torch.float32, pack_weights=False)
    assert runner.layers == ("model.layers.2",)
    pages = resident(path)
    assert layer_fraction(pages, gguf, 2) == 1.0
    for other in (0, 1, 3):
        assert layer_fraction(pages, gguf, other) < 0.1, f"layer {other}: {layer_fraction(pages, gguf, other):.2f}"
