"""How offloaded MoE experts reach their device (model/weights/expert_transfer.py) and when they are
read (model/weights/experts.py), on the CPU where the code allows it and on a GPU (marked `gpu`):

* PinnedPool: one ring reused, a copy's bytes never overwritten before its copy is done (the event
  it was moved with waited for first, the oldest first), grown once for a tensor larger than it;
* ExpertCache: hits move an expert to the most recently used end, room made by giving up the least
  recently used, never more than the capacity held;
* the order SparseMoe drives on a Qwen3.5-MoE layer (router, then the missed experts' reads, then
  the shared expert, then the routed products): with room for a step's misses all their reads start
  before the shared expert runs; with room for none, one does, and each next one once the expert
  before it has been handed out;
* on a GPU: StagedCopies through pinned memory and a side stream deliver the tensors (and kept
  int4 parts, packed on the GPU) exactly, the pool waiting for copies when it wraps.
"""

from __future__ import annotations

import pytest
import torch

from cakemp.compute.runner import BlockRunner
from cakemp.model.weights import expert_transfer
from cakemp.model.weights.expert_transfer import DirectReads, PinnedPool, StagedCopies
from cakemp.model.weights.experts import ExpertCache
from cakemp.model.weights.int4 import Int4Parts, Int4Weight
from tests.support.checkpoints import make_checkpoint


class Copy:
    """A copy out of the pool that is done only once waited for; it notes what the pool's bytes held then."""

    def __init__(self, staged: torch.Tensor, log: list):
        self.staged, self.log = staged, log
        self.original = staged.clone()

    def synchronize(self) -> None:
        self.log.append(torch.equal(self.staged, self.original))


def test_the_pool_reuses_one_ring_and_waits_for_a_copy_before_overwriting_its_bytes():
    log: list[bool] = []
    pool = PinnedPool(4096, pin=False)

    def move(staged):
        return staged.clone(), Copy(staged, log)

    tensors = [torch.full((250,), float(i)) for i in range(6)]  # 1000 bytes each: 1024 in the ring
    moved = [pool.through(tensor, move) for tensor in tensors[:4]]
    assert pool.allocations == 1 and pool.waits == 0  # four fill the ring; none waited for
    moved += [pool.through(tensor, move) for tensor in tensors[4:]]  # wrap onto the first two's bytes
    assert pool.waits == 2 and log == [True, True]  # each waited for while its bytes still held its tensor
    assert all(torch.equal(a, b) for a, b in zip(moved, tensors, strict=True))
    big = torch.arange(2048, dtype=torch.float32)  # 8 KiB: past the ring, which grows once every copy is done
    assert torch.equal(pool.through(big, move), big)
    assert pool.allocations == 2 and log == [True] * 6
    assert torch.equal(pool.through(tensors[0].to(torch.bfloat16), move), tensors[0].to(torch.bfloat16))
    assert pool.allocations == 2


def _pair(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(size // 8, dtype=torch.float32), torch.zeros(size // 8, dtype=torch.float32)


def test_the_cache_holds_at_most_its_capacity_giving_up_the_least_recently_used():
    cache = ExpertCache(3000)
    for expert in range(3):
        cache.put(("l", expert), _pair(1000), read_bytes=10)
    assert cache.resident_bytes == 3000 and (cache.misses, cache.read_bytes) == (3, 30)
    assert cache.find(("l", 0)) is not None and cache.find(("l", 9)) is None and cache.hits == 1
    cache.make_room(1500)  # reads in flight of 1500 bytes: experts 1 and 2 (least recent) given up
    assert cache.resident_bytes == 1000 and cache.find(("l", 1)) is None and cache.find(("l", 0)) is not None
    cache.put(("l", 5), _pair(4000), read_bytes=10)  # past the capacity: counted, not held
    assert cache.find(("l", 5)) is None and cache.resident_bytes == 1000 and cache.misses == 4


class Recorded:
    """A Transfer that notes each read it begins in `log`, and otherwise reads as DirectReads does."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def begin(self, load):
        self.log.append("read")
        return self.inner.begin(load)


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe")


@pytest.mark.parametrize("cache_experts", [8, 0])
def test_missed_experts_are_read_from_right_after_the_router_before_the_shared_expert(qwen3_5_moe, cache_experts):
    layer = "model.language_model.layers.1"
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(0))
    probe = BlockRunner.load(qwen3_5_moe, [layer], "cpu", torch.float32, expert_cache_bytes=1 << 30)
    expected = probe.run(0, x, probe.ops([(layer, 0, 0)]))
    expert_bytes = probe.expert_cache.resident_bytes // probe.expert_cache.misses
    runner = BlockRunner.load(qwen3_5_moe, [layer], "cpu", torch.float32,
                              expert_cache_bytes=cache_experts * expert_bytes)
    moe = runner.block(layer).mlp
    assert isinstance(moe.experts.transfer, DirectReads)  # a CPU's: no pinned memory, no stream
    log: list[str] = []
    moe.experts.transfer = Recorded(moe.experts.transfer, log)
    shared = moe.shared
    moe.shared = lambda x: (log.append("shared"), shared(x))[1]
    assert torch.equal(runner.run(0, x, runner.ops([(layer, 0, 0)])), expected)
    top_k = runner.config.moe.top_k
    # Room for both misses: both read before the shared expert; room for none: one ahead at a time.
    assert log == ["read"] * top_k + ["shared"] if cache_experts else log == ["read", "shared"] + ["read"] * (top_k - 1)
    assert runner.expert_cache.resident_bytes <= runner.expert_cache.capacity


@pytest.mark.gpu
def test_staged_copies_deliver_tensors_and_int4_parts_exactly_on_a_side_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    assert isinstance(expert_transfer.transfer(device), StagedCopies)
    pool = PinnedPool(1 << 16, pin=True)  # 64 KiB: the 128 KiB below wraps it, waiting for copies
    copies = StagedCopies(device, pool, torch.cuda.Stream(device))
    generator = torch.Generator().manual_seed(0)
    parts = Int4Parts(torch.randint(0, 16, (64, 256), generator=generator, dtype=torch.uint8),
                      torch.rand(64, 2, generator=generator) / 16 + 1e-3, torch.randn(64, 2, generator=generator) / 16, 128)
    pending = []
    for _ in range(8):
        plain = torch.randn(64, 256, generator=generator).to(torch.bfloat16)
        pending.append((plain, copies.begin(lambda device, fuse, plain=plain: (plain, fuse([parts])))))
    for plain, flight in pending:
        gate_up, down = flight.ready()
        assert torch.equal(gate_up.cpu(), plain)
        assert isinstance(down, Int4Weight) and down.packed.device == device
        reference = Int4Weight.create(Int4Parts(parts.codes.to(device), parts.scales.to(device),
                                                parts.zeros.to(device), 128))
        assert torch.equal(down.packed, reference.packed) and torch.equal(down.scales_and_zeros, reference.scales_and_zeros)
    assert pool.allocations == 1 and pool.waits > 0
