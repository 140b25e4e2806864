"""A batched decode step of fixed shapes: on a GPU captured once as a CUDA graph, then replayed.

A decode step's kernels are many and small (norms, GEMMs, rotary, the KV write and attention of
every layer), so on a GPU their launches, not the GPU, set a step's time. A CUDA graph launches a
whole recorded step at once, but it replays fixed kernels over fixed buffers. So this is the paged
step (compute/paged_step.py) over buffers of fixed shape, `DecodeGraph`:

* the step's decode requests padded to a bucket of BUCKETS (1, 2, 4, 8, ... up to --max-batch): a row
  past the last request computes on whatever input it last held, writes its K/V into the pool's
  scratch block and reads its null block (kv_cache.SCRATCH_BLOCK, NULL_BLOCK), so it touches no
  session;
* each request's block table held to a fixed width, in blocks (a power of two, at least MIN_WIDTH); on
  a GPU each row reads its keys where they lie in the pool, up to its position (model/paged_attention.py,
  its keys split among programs by the width); elsewhere its blocks are gathered to the width and which
  keys each row sees worked out from its position inside the step (its window too), so a step whose rows
  would pad by far so (a long context beside short ones: StepRows.gathers_alike) takes the paged step,
  which gathers each group of rows alike to its own width;
* before each replay, the step's rows, positions, slot ids and block tables copied into the buffers
  (StepRows builds them as it does for the paged step); after it, the outputs copied out.

One graph per (run of layers and KV slots, bucket, width). Where the device has a KV budget (a GPU's
always has) and a graph holds all its layers, its pools are made at their full shares at its start
and the graphs of every bucket at the narrowest width with them (`prepare`, for the run of all its
layers); any other shape is made the first time a step of it comes (its time and memory logged), and
made again when a pool it reads has grown (a grown pool is another tensor: without a budget, or past
a pool's share). Prompt chunks, steps mixing them with decodes, and layers a graph cannot hold (a
MoE layer routes by data; a linear-attention layer keeps a recurrence) run the paged step, and so
does every step once a capture has failed (an op the capture refuses: logged once).

On a CPU the same buffers and the same computation run without a graph (`capture=False`): the tests
check there that this step equals the paged one, run so and recorded once then replayed as a graph
replays (fixed ops over fixed tensors, no Python: what changes between steps must reach the step through
its buffers), and tools/gpu_check that a replay on a GPU equals the same step run eagerly, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from cakemp.compute.kv_cache import BLOCK, NULL_BLOCK, SCRATCH_BLOCK, KVCache, Pool
from cakemp.compute.paged_step import StepRows
from cakemp.log import get_logger
from cakemp.model import attention
from cakemp.model.block import DecoderBlock
from cakemp.model.mlp import GatedMlp
from cakemp.model.rotary import Rotary

MIN_WIDTH = 16  # blocks (256 positions): the narrowest width a step's keys are gathered to


def capturable(block: object) -> bool:
    """Whether a graph can hold `block`'s forward: an attention layer with a dense MLP (a MoE routes
    tokens by their values; a linear-attention layer is a recurrence with a state of its own)."""
    return isinstance(block, DecoderBlock) and isinstance(block.mlp, GatedMlp)


def buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a step is padded to: powers of two below `max_batch`, then `max_batch`."""
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def width_for(blocks: int) -> int:
    """The width, in blocks, a step whose longest table holds `blocks` is gathered to."""
    width = MIN_WIDTH
    while width < blocks:
        width *= 2
    return width


class DecodeGraphs:
    """A runner's decode graphs, made as steps of new shapes come."""

    def __init__(self, cache: KVCache, max_batch: int, capture: bool):
        """`capture`: record CUDA graphs (a GPU); False runs the same fixed-shape step eagerly (a CPU's tests)."""
        self.cache = cache
        self.buckets = buckets(max_batch)
        self.max_width = -(-cache.max_context // BLOCK)
        self.capture = capture
        self.made: dict[tuple, DecodeGraph] = {}  # by (run, bucket, width)
        self.failed: str | None = None  # why a capture failed: graphs are then off
        self._memory_pool = None  # shared by every graph, made with the first
        self._log = get_logger()

    def takes(self, sessions: int, blocks: int) -> bool:
        """Whether a decode step of `sessions` requests whose longest table holds `blocks` fits a graph."""
        return self.failed is None and sessions <= self.buckets[-1] and blocks <= self.max_width

    def run(self, run_key: tuple, blocks: Sequence[DecoderBlock], rotaries: Sequence[Rotary | None],
            step: StepRows, x: torch.Tensor) -> torch.Tensor | None:
        """x: [1, B, H], one decode row per request of `step` (whose every op is an attention layer of
        `blocks`, in order) -> [1, B, H], through the graph of the step's shape; None where the step fits
        no graph (`takes`), where its rows' keys gathered to the graph's width would pad short rows by far,
        or where that graph could not be captured (the step then runs op by op, and so do all after it)."""
        B, needed = x.shape[1], step.blocks_needed
        if not self.takes(B, needed):
            return None
        width = min(width_for(needed), self.max_width)
        if self.cache.paged_attend is None and not step.gathers_alike(width, min(MIN_WIDTH, width)):
            return None  # every row's keys gathered to the width: a long row would pad each short one to it
        bucket = next(size for size in self.buckets if size >= B)
        key = run_key, bucket, width
        graph = self.made.get(key)
        if graph is None or not graph.reads(step.pools):
            # Graphs of a pool that grew hold its old tensors: dropped, so that the old memory is freed.
            self.made = {shape: made for shape, made in self.made.items() if made.reads(made.pools)}
            graph = self._make(blocks, rotaries, step.pools, bucket, width, x.shape[2], x.dtype)
            if graph is None:
                return None
            self.made[key] = graph
        return graph.run(step, x)

    def prepare(self, run_key: tuple, blocks: Sequence[DecoderBlock], rotaries: Sequence[Rotary | None],
                pools: Sequence[Pool], hidden: int, dtype: torch.dtype) -> None:
        """Make now, for the run `run_key` (as `run` names it), the graph of every bucket at the narrowest
        width: the shapes a node meets first, whose capture then delays no step. Logged once, with their
        time and memory and the KV pools' bytes. Wider graphs are made as contexts reach them; out of
        memory here stops this (logged), and the steps make what they need."""
        width = min(MIN_WIDTH, self.max_width)
        device = torch.device(self.cache.device)
        before, started = _allocated(device), time.perf_counter()
        for bucket in self.buckets:
            try:
                graph = self._make(blocks, rotaries, pools, bucket, width, hidden, dtype, log=False)
            except torch.OutOfMemoryError as e:
                self._log.error("decode graphs at start stopped: out of memory", batch=bucket, error=str(e)[:200])
                return
            if graph is None:
                return
            self.made[run_key, bucket, width] = graph
        self._log.info("decode graphs made at start", layers=len(blocks), batches=list(self.buckets), width=width * BLOCK,
                       captured=self.capture, seconds=round(time.perf_counter() - started, 3),
                       memory_bytes=_allocated(device) - before, kv_pool_bytes=self.cache.pool_bytes())

    def _make(self, blocks, rotaries, pools, bucket, width, hidden, dtype, log: bool = True) -> DecodeGraph | None:
        """A graph of this shape (captured on a GPU, its time and memory logged where `log`), or None where
        the capture failed: logged, graphs off."""
        graph = DecodeGraph(self.cache, blocks, rotaries, pools, bucket, width, hidden, dtype)
        if not self.capture:
            return graph
        device = graph.x.device
        before, started = _allocated(device), time.perf_counter()
        try:
            if self._memory_pool is None:
                self._memory_pool = torch.cuda.graph_pool_handle()
            graph.capture(self._memory_pool)
        except torch.OutOfMemoryError:
            raise  # the step's own rule applies: its requests are tried one by one
        except Exception as e:  # an op the capture refuses: the paged step serves, op by op
            self.failed = f"{type(e).__name__}: {e}"
            self._log.error("decode graph capture failed; decode steps run op by op", error=self.failed)
            return None
        if log:
            self._log.info("decode graph captured", layers=len(blocks), batch=bucket, width=width * BLOCK,
                           seconds=round(time.perf_counter() - started, 3), memory_bytes=_allocated(device) - before)
        return graph


def _allocated(device: torch.device) -> int:
    """The bytes torch has allocated on a GPU (0 on a CPU, which never captures but in tests)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class DecodeGraph:
    """The buffers of one shape of decode step, the step computed over them, and (on a GPU) its graph."""

    def __init__(self, cache: KVCache, blocks: Sequence[DecoderBlock], rotaries: Sequence[Rotary | None],
                 pools: Sequence[Pool], bucket: int, width: int, hidden: int, dtype: torch.dtype):
        device = cache.device
        self.cache, self.blocks, self.rotaries, self.dtype = cache, tuple(blocks), tuple(rotaries), dtype
        self.pools = tuple(pools)
        self._pool_tensors = tuple(pool.k for pool in pools)  # what the graph reads: a grown pool is another
        self.bucket, self.width = bucket, width
        L = len(blocks)
        self.x = torch.zeros(1, bucket, hidden, dtype=dtype, device=device)  # [1, bucket, H]
        # [2, L, bucket]: each row's position, and its row of the flat pool (StepRows.placed's layout)
        self.placed = torch.zeros(2, L, bucket, dtype=torch.int64, device=device)
        self.positions, self.slot_ids = self.placed
        self.slot_ids.fill_(SCRATCH_BLOCK * BLOCK)
        self.tables = torch.full((L, bucket, width), NULL_BLOCK, dtype=torch.int64, device=device)  # [L, bucket, W]
        self.rows = 0  # the rows of the last step run: those past them are padding already
        self.long = torch.zeros(L, bucket, dtype=torch.bool, device=device)  # rows past a longrope's switch
        self.keys = torch.arange(width * BLOCK, device=device)  # [S] each gathered key's position
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def reads(self, pools: Sequence[Pool]) -> bool:
        """Whether this graph reads `pools` as they are now (not a tensor one of them has since grown out of)."""
        return len(pools) == len(self.pools) and all(
            pool is mine and pool.k is tensor for pool, mine, tensor in zip(pools, self.pools, self._pool_tensors))

    def capture(self, memory_pool) -> None:
        """Record the step as a CUDA graph: run once on a side stream first, so that what a first call
        sets up (cuBLAS's workspace, a Triton kernel's compilation) happens outside the recording. The
        warm-up writes padding rows to the scratch block, and real rows nowhere yet (the buffers are idle)."""
        stream = torch.cuda.Stream(self.x.device)
        stream.wait_stream(torch.cuda.current_stream(self.x.device))
        with torch.cuda.stream(stream):
            self._compute()
        torch.cuda.current_stream(self.x.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=memory_pool):
            self.out = self._compute()

    def run(self, step: StepRows, x: torch.Tensor) -> torch.Tensor:
        """x: [1, B, H], the step's decode rows -> [1, B, H].

        Each copy and fill here is a launch on a GPU, ahead of the replay: the step's rows go in with
        three copies, and padding rows are reset only where the last step had a real row. A padding row
        keeps whatever input it held, at position 0: it writes only the scratch block and reads only the
        null block, and every op of a layer is row by row, so its output, discarded, reaches no row."""
        B = x.shape[1]
        self.x[:, :B] = x
        self.placed[:, :, :B] = step.placed
        tables = step.all_tables()  # [L, B, cache width]: past a table's end, NULL_BLOCK
        reach = min(tables.shape[2], self.width)  # the cache's width only grows: past `reach`, null still
        self.tables[:, :B, :reach] = tables[:, :, :reach]
        if B < self.rows:  # rows of the last step's requests, padding now
            self.slot_ids[:, B:self.rows] = SCRATCH_BLOCK * BLOCK
            self.tables[:, B:self.rows] = NULL_BLOCK
            self.positions[:, B:self.rows] = 0  # (on a GPU a row reads its null blocks up to its position)
        self.rows = B
        for index, rotary in enumerate(self.rotaries):
            if rotary is not None and rotary.long_inv_freq is not None:
                self.long[index, :B] = step.long_rows(index, rotary)
        if self.graph is None:
            return self._compute()[:, :B]
        self.graph.replay()
        return self.out[:, :B].clone()  # the next replay overwrites `out`

    def _compute(self) -> torch.Tensor:
        """The step over the buffers, [1, bucket, H]: tensor ops only, no value read back to the host."""
        x = self.x
        for index, (block, rotary) in enumerate(zip(self.blocks, self.rotaries, strict=True)):
            cos, sin = (None, None) if rotary is None else rotary.cos_sin(
                self.positions[index], self.dtype, self.long[index] if rotary.long_inv_freq is not None else None)
            x = block.forward(x, cos, sin, _FixedPages(self, index))
        return x


class _FixedPages:
    """model.block.Pages over a DecodeGraph's buffers: attention layer `index` of the step."""

    def __init__(self, graph: DecodeGraph, index: int):
        self.graph, self.index = graph, index

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, H_kv, bucket, D] into the rows' slots (padding rows: the scratch block)."""
        self.graph.pools[self.index].write(self.graph.slot_ids[self.index], k, v)

    def attend(self, q: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
        """q: [1, H_q, bucket, D] -> [1, H_q, bucket, D], each row over its request's keys to its position."""
        graph, pool = self.graph, self.graph.pools[self.index]
        if graph.cache.paged_attend is not None:  # a GPU's: each row's keys read where they lie in the pool
            return graph.cache.paged_attend(q[0].transpose(0, 1), pool.k, pool.v, graph.tables[self.index],
                                            graph.positions[self.index], window, scale, graph.width * BLOCK
                                            ).transpose(0, 1)[None]
        k, v = pool.gather(graph.tables[self.index])  # [bucket, H_kv, W * BLOCK, D]
        seen = attention.seen_keys(graph.keys, graph.positions[self.index], window)  # [bucket, S]
        return attention.attend_rows(q[0].transpose(0, 1), k, v, seen, scale).transpose(0, 1)[None]
