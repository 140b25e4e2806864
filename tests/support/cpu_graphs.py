"""CUDA graphs' replay semantics on the CPU, for tests: a captured step is a recording of its torch ops,
replayed over the very tensors they read and wrote when recorded.

A CUDA graph replays fixed kernels with fixed arguments: the addresses of the tensors they read and
write, and the Python numbers they were launched with. No Python runs at a replay. So a step is right
under a graph only if everything that changes from step to step reaches it through a tensor it reads
(the graph's buffers, filled before each replay), never through a Python value or a tensor made anew
outside the graph. Run eagerly, as the CPU runs the fixed-shape step, such a mistake shows nothing;
replayed from this recording it gives the stale answer a GPU would.

`install(monkeypatch)` puts the recording in the place of torch.cuda's graph, stream and pool calls, and
has every runner's decode graphs captured (as on a GPU), so that `DecodeGraph.capture` runs as written:
its warm-up, then the capture.

Replay re-runs each recorded op with the arguments it was recorded with (the same tensor objects, so
their current values; the same Python numbers) and copies each result into the tensor the recording
returned, which later ops read, as a kernel writes its output where it wrote it at capture. One thing a
GPU does is not modelled: a 0-dim host tensor used beside device tensors is read once, at capture (on
the CPU every tensor is the host's); the test of host reads (tests/compute/test_decode_graph.py) keeps
such tensors out of the step.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cakemp.compute.decode_graph import DecodeGraphs


class Recording(TorchDispatchMode):
    """torch.cuda.CUDAGraph's part: the ops run while recording, then `replay()`."""

    replays = 0  # of every recording, since `install`

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []  # (op, args, kwargs, what it returned)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        Recording.replays += 1
        for func, args, kwargs, out in self.ops:
            again = func(*args, **kwargs)
            for recorded, fresh in zip(tree_leaves(out), tree_leaves(again), strict=True):
                # An in-place op or a view returns the recorded memory itself: nothing to copy.
                if isinstance(recorded, torch.Tensor) and fresh.data_ptr() != recorded.data_ptr():
                    recorded.copy_(fresh)


class _Stream:
    def wait_stream(self, stream) -> None:
        pass


def install(monkeypatch) -> None:
    """Make decode graphs captured, and torch.cuda's capture record, on the CPU (see the module's docstring)."""
    made = DecodeGraphs.__init__
    monkeypatch.setattr(DecodeGraphs, "__init__",
                        lambda self, cache, max_batch, capture: made(self, cache, max_batch, capture=True))
    monkeypatch.setattr(Recording, "replays", 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Recording)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: graph)
