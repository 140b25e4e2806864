"""The fixed-shape decode step (compute/decode_graph.py) on the CPU: the plan a GPU captures, checked
against the paged step (compute/paged_step.py) of a second runner serving the same requests, within
tests/support/tolerance.py's f32 bound (a padded batch's GEMM may round differently). Each runs two
ways: eagerly, as a CPU's device runs it, and recorded once and replayed with a CUDA graph's semantics
(tests/support/cpu_graphs.py), where a value that reaches the step other than through its buffers goes
stale. tools/gpu_check checks on a GPU that a replay equals the eager step bit for bit.
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cakemp.compute.decode_graph import DecodeGraph, buckets, width_for
from cakemp.compute.kv_cache import BLOCK, NULL_BLOCK, SCRATCH_BLOCK
from cakemp.compute.loading import Rounding
from cakemp.compute.runner import BlockRunner, Request
from cakemp.model.weights import int4, int8
from cakemp.op import Op
from tests.support import cpu_graphs
from tests.support.checkpoints import make_checkpoint
from tests.support.families import family_checkpoint
from tests.support.tolerance import assert_close

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def family(request, tmp_path_factory):
    """Plain Llama; Qwen2's q/k/v biases; Qwen3's per-head q/k norms; Gemma 3's windows (4) and two
    rotaries; Phi-4-mini's partial longrope (switching factors past position 16) and window (5)."""
    return family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(params=["eager", "replayed"])
def graphs(request, monkeypatch):
    """How the runners' fixed-shape steps run: eagerly, or captured and replayed as a GPU's graphs are."""
    if request.param == "replayed":
        cpu_graphs.install(monkeypatch)
    return request.param


def load(path, **kwargs) -> BlockRunner:
    return BlockRunner.load(path, [f"model.layers.{i}" for i in LAYERS], "cpu", torch.float32, **kwargs)


def ops(position):
    return [Op(i, position, layer) for i, layer in enumerate(LAYERS)]


def tokens(T, seed, hidden):
    return torch.randn(1, T, hidden, generator=torch.Generator().manual_seed(seed))


def decode_together(graphed, paged, lengths: dict[int, int], steps: int, seed: int = 0, replayed: bool = True):
    """Every session of `lengths` (session -> positions cached) decodes `steps` tokens together on both
    runners; each step's outputs equal, and where graphs replay, each step was a replay (none where not
    `replayed`). The lengths advance."""
    hidden = graphed.config.hidden_size
    replays = cpu_graphs.Recording.replays
    for step in range(steps):
        requests = [Request(s, tokens(1, seed + 1000 * step + s, hidden), ops(lengths[s])) for s in lengths]
        for mine, theirs in zip(graphed.run_batch(requests), paged.run_batch(requests), strict=True):
            assert isinstance(mine, torch.Tensor), mine
            assert_close(mine, theirs)
        for s in lengths:
            lengths[s] += 1
    if graphed.graphs.capture and graphed.graphs.failed is None:
        assert cpu_graphs.Recording.replays == replays + (steps if replayed else 0)


def prefill(runners, lengths: dict[int, int]):
    hidden = runners[0].config.hidden_size
    for session, T in lengths.items():
        x = tokens(T, session, hidden)
        outputs = [runner.run(session, x, ops(0)) for runner in runners]
        assert_close(outputs[0], outputs[1])


def test_buckets_and_widths():
    assert buckets(1) == (1,)
    assert buckets(32) == (1, 2, 4, 8, 16, 32)
    assert buckets(12) == (1, 2, 4, 8, 12)
    assert [width_for(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 64]


def test_sessions_padded_to_a_bucket_decode_as_the_paged_step(family, graphs):
    """Three sessions at different lengths (one past the windows, several past Phi's longrope switch)
    decode together: padded to a bucket of 4, each equals the paged step; then one leaves and the
    two left (a bucket of 2) still do; a prompt chunk among decodes takes the paged step."""
    graphed, paged = load(family, graph_batch=8), load(family)
    lengths = {1: 2, 2: 9, 3: 20}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=3)
    assert {key[1] for key in graphed.graphs.made} == {4}
    for runner in (graphed, paged):
        runner.free_session(2)
    del lengths[2]
    decode_together(graphed, paged, lengths, steps=2)
    hidden = graphed.config.hidden_size
    mixed = [Request(1, tokens(1, 5, hidden), ops(lengths[1])), Request(9, tokens(5, 6, hidden), ops(0))]
    for mine, theirs in zip(graphed.run_batch(mixed), paged.run_batch(mixed), strict=True):
        assert_close(mine, theirs)
    assert {key[1] for key in graphed.graphs.made} == {2, 4}


# Ops whose result the host must read (a value, or a shape that depends on values): on a GPU each waits
# for the device, which a CUDA graph's capture refuses; so do tensors made from Python data (lift_fresh:
# a copy from host memory).
HOST_READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique2",
              "unique_consecutive", "repeat_interleave", "lift_fresh", "lift_fresh_copy", "index by a mask"}


class _Dispatched(TorchDispatchMode):
    """The torch ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name.startswith("index") and len(args) > 1 and isinstance(args[1], list | tuple) else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            name = "index by a mask"  # its rows counted on the host first
        self.names.add(name)
        return func(*args, **(kwargs or {}))


def test_the_step_a_gpu_captures_reads_nothing_back_to_the_host(family, monkeypatch):
    """What a graph records (DecodeGraph._compute, every family's layers: windows, longrope's switch, q/k
    norms, biases) runs no op whose value the host reads, which a GPU's capture would refuse (and fall
    back to the paged step for good): checked here, where no GPU captures, op by op."""
    dispatched = _Dispatched()
    compute = DecodeGraph._compute

    def watched(graph):
        with dispatched:
            return compute(graph)

    monkeypatch.setattr(DecodeGraph, "_compute", watched)
    graphed, paged = load(family, graph_batch=4), load(family)
    lengths = {1: 3, 2: 18}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=2)
    assert {"linear", "scaled_dot_product_attention", "index_copy_"} <= dispatched.names  # the step ran under it
    assert not dispatched.names & HOST_READS


def test_a_step_past_its_width_takes_a_wider_graph(family, graphs):
    """Sessions crossing 256 positions (16 blocks) move to a graph of 32 blocks and stay equal."""
    graphed, paged = load(family, graph_batch=4), load(family)
    lengths = {1: 254, 2: 100}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=4)
    assert {key[2] for key in graphed.graphs.made} == {16, 32}


def test_a_grown_pool_gets_a_new_graph_and_padding_touches_no_session(tmp_path, graphs):
    """A graph reads the pools as they were when it was made: once a pool grows (more sessions than its
    first 64 blocks hold) the step makes another, and every graph of the old pool is dropped (it holds
    the old tensors). Padding rows (whose K/V are Qwen2's biases, not zeros) write the scratch block
    only: the null block stays zeros, and no table names the scratch block."""
    path = make_checkpoint(tmp_path, "qwen2")
    graphed, paged = load(path, graph_batch=8), load(path)
    lengths = {1: 30, 2: 3, 3: 40}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, {1: 30}, steps=1)  # a graph of bucket 1
    lengths[1] += 1
    decode_together(graphed, paged, lengths, steps=2)  # and of bucket 4
    first = graphed.graphs.made[(tuple((i, layer) for i, layer in enumerate(LAYERS)), 4, 16)]
    assert len(graphed.graphs.made) == 2
    grown = {s: 200 for s in range(10, 16)}  # 13 blocks each, 78 in all: past the first 64
    prefill((graphed, paged), grown)
    assert not first.reads(first.pools)
    decode_together(graphed, paged, lengths, steps=2, seed=7)
    (second,) = graphed.graphs.made.values()  # the first, holding the pool's old tensors, dropped
    assert second is not first and second.reads(second.pools)
    for pool in graphed.cache.pools.values():
        assert not pool.k[NULL_BLOCK].any() and not pool.v[NULL_BLOCK].any()
    named = set(graphed.cache.tables.flatten().tolist())
    assert SCRATCH_BLOCK not in named


def test_short_rows_beside_a_long_context_take_the_paged_step_where_keys_are_gathered(tmp_path, graphs):
    """Where rows' keys are gathered to a graph's width (no kernel reads them in place), one long context
    in a step of short ones would pad each short row to its width: 8 rows of 2 blocks each gathering 251.
    Such a step takes the paged step, which gathers each group of rows alike to its own width, and equals
    it; once the long session leaves, the short ones decode through a graph again."""
    path = make_checkpoint(tmp_path, "llama")
    graphed, paged = load(path, graph_batch=16, max_context=8192), load(path, max_context=8192)
    lengths = {s: 20 for s in range(1, 9)} | {9: 4000}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=2, replayed=False)
    assert graphed.graphs.made == {}
    for runner in (graphed, paged):
        runner.free_session(9)
    del lengths[9]
    decode_together(graphed, paged, lengths, steps=2)
    assert {key[1:] for key in graphed.graphs.made} == {(8, 16)}


def test_with_a_budget_the_pools_and_graphs_are_made_at_start_and_never_made_again(tmp_path, graphs):
    """Given a KV budget (a GPU's always has one), the runner makes its layers' pools at their shares and
    the graph of every bucket at the narrowest width as it loads. Sessions then fill the pools past the 64
    blocks a growing pool starts with (where a pool without a budget grows, and its graphs are made
    again: the test above), and every step is served by those graphs over those pools, equal to the paged
    step's."""
    path = make_checkpoint(tmp_path, "qwen2")
    graphed, paged = load(path, graph_batch=8, kv_budget_bytes=4 << 20), load(path)
    share = graphed.cache.max_blocks // len(LAYERS)
    assert {slot: len(pool.owners) for slot, pool in graphed.cache.pools.items()} == {i: share + 2 for i in LAYERS}
    run = tuple((i, layer) for i, layer in enumerate(LAYERS))
    made = dict(graphed.graphs.made)
    assert set(made) == {(run, bucket, 16) for bucket in buckets(8)}
    tensors = [pool.k for pool in graphed.cache.pools.values()]
    lengths = {1: 30, 2: 3, 3: 40}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=2)
    prefill((graphed, paged), {s: 200 for s in range(10, 16)})  # 13 blocks each, 78 in all: past 64
    decode_together(graphed, paged, lengths, steps=2, seed=7)
    assert all(pool.k is k for pool, k in zip(graphed.cache.pools.values(), tensors, strict=True))
    assert graphed.graphs.made == made
    served = made[run, 4, 16]  # the last step's rows were written into its buffers: it ran
    assert served.positions[0, :3].tolist() == [lengths[s] - 1 for s in lengths]


def test_sessions_sharing_a_kept_prefix_decode_through_the_graphs_as_the_paged_step(tmp_path, graphs):
    """As a GPU node runs by default: prefix reuse, shared between sessions. A chat's 40 rows are kept at
    its Goodbye. Another chat starting with its first 20 rows takes their first block from it (shared) and
    copies the second before writing its own rows there; then a session sending the first 36 rows again
    takes the kept chat's blocks, the first still shared with the other session. Decoding together through
    the graphs made at the start, both equal a runner's that never reused anything."""
    path = make_checkpoint(tmp_path, "llama")
    graphed = load(path, graph_batch=8, kv_budget_bytes=4 << 20, prefix_reuse=True, share_prefixes=True)
    paged = load(path)
    made = dict(graphed.graphs.made)
    hidden = graphed.config.hidden_size
    history = tokens(40, 3, hidden)
    graphed.run(1, history, ops(0))
    graphed.clear_session(1)  # Goodbye: its rows kept
    prompts = {3: torch.cat([history[:, :20], tokens(10, 4, hidden)], dim=1), 2: history[:, :36]}
    for session, x in prompts.items():
        assert_close(graphed.run(session, x, ops(0)), paged.run(session, x, ops(0)))
    assert graphed.prefixes.hits == 2
    pool = graphed.cache.pools[LAYERS[0]]
    first = graphed.cache.slot(2, LAYERS[0]).table[0]
    assert graphed.cache.slot(3, LAYERS[0]).table[0] == first and pool.owners[first] == 2
    decode_together(graphed, paged, {2: 36, 3: 30}, steps=3)
    assert graphed.graphs.made == made
    run = tuple((i, layer) for i, layer in enumerate(LAYERS))
    assert made[run, 2, 16].positions[0, :2].tolist() == [38, 32]  # the last step ran through it


def test_a_row_that_turns_padding_in_its_bucket_writes_no_session_s_blocks_any_more(tmp_path, graphs):
    """Four sessions fill a bucket of 4; one leaves, and a new session takes the blocks it freed. The
    other three decode on in the same bucket, its fourth row now padding: had that row kept the slot
    ids of the session that left, it would write into the new session's rows. The new session's next
    steps, with and then beside the three, equal the paged step's."""
    path = make_checkpoint(tmp_path, "llama")
    graphed, paged = load(path, graph_batch=8), load(path)
    lengths = {1: 20, 2: 20, 3: 20, 4: 20}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=2)
    freed = graphed.cache.slot(4, LAYERS[0]).table
    for runner in (graphed, paged):
        runner.free_session(4)
    del lengths[4]
    prefill((graphed, paged), {5: 30})
    assert graphed.cache.slot(5, LAYERS[0]).table[: len(freed)] == freed  # the blocks session 4 left
    decode_together(graphed, paged, lengths, steps=2)  # rows 1-3 of the bucket of 4, the fourth padding
    (graph,) = graphed.graphs.made.values()
    assert (graph.slot_ids[:, 3] == SCRATCH_BLOCK * BLOCK).all() and (graph.tables[:, 3] == NULL_BLOCK).all()
    assert (graph.positions[:, 3] == 0).all()  # the kernel reads a row's null blocks no further than position 0
    lengths[5] = 30
    decode_together(graphed, paged, lengths, steps=2, seed=9)
    assert {key[1] for key in graphed.graphs.made} == {4}


def test_a_live_session_of_nan_rows_never_reaches_its_neighbours_through_a_graph(tmp_path, graphs):
    """Session 1 of NaN activations stays live beside two sessions decoding in a padded bucket: their
    outputs equal the paged step's of a runner that never saw session 1."""
    path = make_checkpoint(tmp_path, "llama")
    graphed, paged = load(path, graph_batch=8), load(path)
    graphed.run(1, torch.full((1, 40, graphed.config.hidden_size), float("nan")), ops(0))
    lengths = {2: 3, 3: 20}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=3)
    assert graphed.graphs.made


@pytest.mark.parametrize("quantize", [Rounding("int4", 32), Rounding("int8", 128)], ids=str)
def test_kept_int4_and_int8_weights_multiply_inside_the_graph(tmp_path, graphs, quantize):
    """Matrices kept in 4 or 8 bits (rounded at load, as --quantize does) stay kept in a graph's step,
    their products inside it: decoding through it equals the paged step over the same kept weights."""
    path = make_checkpoint(tmp_path, "llama")
    graphed, paged = (load(path, quantize=quantize, **graph) for graph in ({"graph_batch": 4}, {}))
    kind = int8.Int8Weight if quantize.kernel == "int8" else int4.Int4Weight
    assert all(isinstance(block.w_qkv, kind) and isinstance(block.mlp.w_down, kind) for block in graphed.blocks)
    lengths = {1: 5, 2: 17}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=2)
    assert graphed.graphs.made


def test_moe_and_linear_attention_layers_take_the_paged_step(tmp_path):
    """A layer a graph cannot hold (routed experts; a recurrence) keeps its run on the paged step."""
    for family, prefix in (("qwen3_moe", "model.layers"), ("qwen3_5", "model.language_model.layers")):
        path = make_checkpoint(tmp_path / family, family)
        runner = BlockRunner.load(path, [f"{prefix}.{i}" for i in LAYERS], "cpu", torch.float32, graph_batch=4,
                                  kv_budget_bytes=4 << 20)
        assert not runner.cache.pools  # nor are pools made at their shares for graphs that never run
        hidden = runner.config.hidden_size
        runner.run(1, tokens(3, 1, hidden), ops(0))
        runner.run(1, tokens(1, 2, hidden), ops(3))
        assert not runner.graphs.made


def test_a_graph_that_cannot_be_captured_leaves_every_step_to_the_paged_one(tmp_path):
    """Asked to capture where it cannot (this CPU torch has no CUDA graphs: the same path as an op a GPU's
    capture refuses), the first decode step falls back to the paged step, its answers right and no
    session's state touched, and graphs stay off after it, the reason kept."""
    path = make_checkpoint(tmp_path, "llama")
    graphed, paged = load(path, graph_batch=8), load(path)
    graphed.graphs.capture = True
    lengths = {1: 5, 2: 9}
    prefill((graphed, paged), lengths)
    decode_together(graphed, paged, lengths, steps=3)
    assert graphed.graphs.failed is not None and not graphed.graphs.made
    assert not graphed.graphs.takes(1, 1)


@torch.library.custom_op("cakemp_tests::paged_attend", mutates_args=())
def _paged_attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, window: int | None, scale: float, keys: int) -> torch.Tensor:
    """model/paged_attention.attend as one torch op: a replay of the recording re-runs it as a GPU's graph
    relaunches the kernel (the recording sees torch ops only, and the kernel is a Triton launch)."""
    from cakemp.model import paged_attention

    return paged_attention.attend(q, k_pool, v_pool, tables, positions, window, scale, keys)


def test_rows_read_in_place_decode_as_the_gathered_step(family, graphs):
    """A GPU's decode rows attend over their keys where they lie in the pool (model/paged_attention.py's
    Triton kernel, through its interpreter here), in a graph's step and in the paged step of a runner
    without graphs alike: both equal the paged step that gathers the keys, as sessions at different lengths
    (past the windows, past Phi's longrope switch, across 256 positions: a wider graph, its keys in two
    splits) decode together, and beside a prompt chunk."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (tests/conftest.py sets it)")
    graphed, in_place, paged = load(family, graph_batch=4), load(family), load(family)
    graphed.cache.paged_attend = in_place.cache.paged_attend = _paged_attend
    lengths = {1: 3, 2: 255, 3: 20}
    prefill((graphed, paged), lengths)
    prefill((in_place, paged), lengths)
    hidden = paged.config.hidden_size
    for step in range(3):
        requests = [Request(s, tokens(1, 1000 * step + s, hidden), ops(lengths[s])) for s in lengths]
        if step == 1:  # a prompt chunk beside the decodes: the paged step, its decode rows still in place
            requests.append(Request(9, tokens(5, 6, hidden), ops(0)))
        expected = paged.run_batch(requests)
        for runner in (graphed, in_place):
            for mine, theirs in zip(runner.run_batch(requests), expected, strict=True):
                assert isinstance(mine, torch.Tensor), mine
                assert_close(mine, theirs)
            runner.free_session(9)
        paged.free_session(9)
        for s in lengths:
            lengths[s] += 1
    assert {key[2] for key in graphed.graphs.made} == {16, 32}
