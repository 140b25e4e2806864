"""BlockRunner.run_batch: several sessions' requests computed as one batch give what each
gives alone, and one request's error fails that request alone.

"Alone" is a second runner on the same checkpoint serving the same requests one at a time
(`run`). Batched GEMMs may round differently from one-row ones, so the two are compared
within tests/support/tolerance.py's f32 bound, not bit for bit.
"""

import pytest
import torch

from cakemp.compute import paged_step
from cakemp.compute.runner import BlockRunner, Request
from cakemp.errors import CacheBudgetExceeded, InternalError, PositionGap, RecurrentRewind
from cakemp.op import Op
from tests.support.checkpoints import make_checkpoint
from tests.support.tolerance import assert_close

# family -> (the layer names' prefix, the layers served)
FAMILIES = {
    "llama": ("model.layers", [1, 2]),
    "gemma3": ("model.layers", [0, 1, 2, 3]),  # sliding and global layers, each with its own rotary
    "qwen3_5": ("model.language_model.layers", [1, 2, 3]),  # linear, linear, full attention
    "qwen3_moe": ("model.layers", [1, 2]),  # experts routed per token of the whole batch
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    overrides = {"sliding_window": 4} if name == "gemma3" else {}
    return name, make_checkpoint(tmp_path_factory.mktemp(name), name, **overrides)


def load(family, **kwargs) -> BlockRunner:
    name, path = family
    prefix, layers = FAMILIES[name]
    return BlockRunner.load(path, [f"{prefix}.{i}" for i in layers], "cpu", torch.float32, **kwargs)


def ops(family, position, layers=None):
    """The ops running `layers` (default: every served one) at `position`, each in its own KV slot."""
    _, served = FAMILIES[family[0]]
    return [Op(served.index(i), position, i) for i in (layers or served)]


def tokens(T, seed, hidden):
    return torch.randn(1, T, hidden, generator=torch.Generator().manual_seed(seed))


def prefilled(family, lengths: dict[int, int]) -> tuple[BlockRunner, BlockRunner]:
    """Two runners, each session of `lengths` prefilled to its length in both (their answers equal)."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    for session, T in lengths.items():
        x = tokens(T, session, hidden)
        assert_close(batched.run(session, x, ops(family, 0)), alone.run(session, x, ops(family, 0)))
    return batched, alone


def each_as_alone(batched: BlockRunner, alone: BlockRunner, requests: list[Request]) -> None:
    """`requests` run as one batch on `batched`: each result equals its request run alone on `alone`."""
    for request, result in zip(requests, batched.run_batch(requests), strict=True):
        assert isinstance(result, torch.Tensor), result
        assert_close(result, alone.run(request.session, request.x, request.ops))


def test_sessions_batched_at_different_positions_match_each_alone(family):
    """Four sessions prefilled to different lengths (1, 3, 7 and 12 tokens, one of them past Gemma's
    window), then decoding together for five steps, one of the steps also carrying another session's
    prompt chunk: every output equals the same request run alone."""
    lengths = {1: 1, 2: 3, 3: 7, 4: 12}
    batched, alone = prefilled(family, lengths)
    hidden = batched.config.hidden_size
    for step in range(5):
        requests = [Request(s, tokens(1, 100 * step + s, hidden), ops(family, lengths[s] + step)) for s in lengths]
        if step == 2:  # a prompt chunk arrives among the decodes: 6 tokens of session 5 at position 0
            requests.insert(1, Request(5, tokens(6, 99, hidden), ops(family, 0)))
        each_as_alone(batched, alone, requests)
    assert batched.kv_bytes() == alone.kv_bytes()


def test_decodes_of_far_apart_contexts_attend_in_groups_each_as_alone(family, monkeypatch):
    """Sessions at 2, 20, 40 and 100 positions decode together, with a split of one block (so that these
    short contexts group as long ones would): without a window, the longest and the shortest each alone
    (a view of the pool, or its own gather), those at 20 and 40 together, widest first; through Gemma's
    window, all together, each row reading its table from its own window's first block. Every output
    equals the same request run alone."""
    monkeypatch.setattr(paged_step, "_SPLIT_BYTES", 1)
    seen = []
    spans = paged_step.StepRows.spans
    monkeypatch.setattr(paged_step.StepRows, "spans", lambda *args: seen.append(spans(*args)) or seen[-1])
    lengths = {1: 2, 2: 20, 3: 40, 4: 100}
    batched, alone = prefilled(family, lengths)
    hidden = batched.config.hidden_size
    for step in range(3):
        each_as_alone(batched, alone, [Request(s, tokens(1, 100 * step + s, hidden), ops(family, lengths[s] + step))
                                       for s in lengths])
    if family[0] == "gemma3":  # layers 0-3 all slide (a window of 4)
        assert all(len(found) == 1 and isinstance(found[0].columns, torch.Tensor) for found in seen)
    else:
        assert any(len(found) > 1 for found in seen)


def test_a_windowed_row_in_its_tables_last_block_decodes_beside_one_straddling_a_block(family):
    """Sessions at 255 positions (the last of its table's 16 blocks) and 33 decode together: through
    Gemma's window of 4 the second reads two blocks from its window's first, so the first's two columns
    from its own first run past its table's width (its last column stands for them, masked); each equals
    its request alone."""
    lengths = {1: 255, 2: 33}
    batched, alone = prefilled(family, lengths)
    hidden = batched.config.hidden_size
    each_as_alone(batched, alone, [Request(s, tokens(1, 7 * s, hidden), ops(family, T)) for s, T in lengths.items()])


def test_a_request_alone_reads_its_keys_from_its_windows_first_block(family):
    """Two sessions prefill 192 positions 16 at a time in turn (their blocks interleave, so each request
    gathers its keys), then one decodes alone: each request equals its request alone, and through
    Gemma's window of 4 no gather held more than the blocks a window and a chunk span, not a table's 12."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    for position in range(0, 192, 16):
        for session in (1, 2):
            each_as_alone(batched, alone, [Request(session, tokens(16, session + position, hidden), ops(family, position))])
    each_as_alone(batched, alone, [Request(1, tokens(1, 5, hidden), ops(family, 192))])
    held = batched.cache.gather_space(1)[0].untyped_storage().nbytes() // (batched.cache.bytes_per_block // 2)
    assert held <= 3 if family[0] == "gemma3" else held >= 12  # (layers 0-3 all slide there)


def test_a_token_whose_layers_are_at_different_positions_batches_with_plain_decodes(family):
    """A token rewriting an earlier row at its first layer than at the others (each within what is
    cached), in one step with two plain decodes and a prompt chunk: its layers see their own rows and
    rotations, and so does every other request (the step's masks and rotations are made per set of
    layers at the same positions); each output equals the request run alone."""
    if family[0] == "qwen3_5":
        pytest.skip("a linear-attention layer's recurrence cannot rewind a row")
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    lengths = {1: 9, 2: 5, 3: 12}
    for session, T in lengths.items():
        x = tokens(T, session, hidden)
        batched.run(session, x, ops(family, 0))
        alone.run(session, x, ops(family, 0))
    skewed = [op._replace(index_pos=6 if k == 0 else 8) for k, op in enumerate(ops(family, 0))]
    requests = [Request(2, tokens(1, 21, hidden), ops(family, 5)), Request(1, tokens(1, 22, hidden), skewed),
                Request(4, tokens(3, 23, hidden), ops(family, 0)), Request(3, tokens(1, 24, hidden), ops(family, 12))]
    for request, result in zip(requests, batched.run_batch(requests), strict=True):
        assert isinstance(result, torch.Tensor), result
        assert_close(result, alone.run(request.session, request.x, request.ops))


def test_requests_with_different_layer_runs_are_each_computed_on_their_own_run(family):
    """Sessions running all the layers, the first only, and the last only, in one batch: each gets its own run's result."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    served = FAMILIES[family[0]][1]
    runs = {1: served, 2: served[:1], 3: served[-1:], 4: served}
    for position, T in ((0, 4), (4, 1), (5, 1)):
        requests = [Request(s, tokens(T, 10 * position + s, hidden), ops(family, position, run)) for s, run in runs.items()]
        for request, result in zip(requests, batched.run_batch(requests), strict=True):
            assert_close(result, alone.run(request.session, request.x, request.ops))


def test_sessions_keeping_a_layer_in_other_kv_slots_are_each_computed_in_their_own(family):
    """The same layers, but one session keeps them in the slots numbered the other way round (as a
    master may): batched beside a session of the usual numbering, each equals itself alone (the
    step groups them by KV slot, so each layer reads the right pool)."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    served = FAMILIES[family[0]][1]
    for position, T in ((0, 4), (4, 1), (5, 1)):
        usual = ops(family, position)
        swapped = [Op(op.layer, op.index_pos, served[-1 - i]) for i, op in enumerate(usual)]
        requests = [Request(1, tokens(T, position, hidden), usual), Request(2, tokens(T, position + 50, hidden), swapped)]
        for request, result in zip(requests, batched.run_batch(requests), strict=True):
            assert_close(result, alone.run(request.session, request.x, request.ops))


@pytest.mark.parametrize("bad, error", [
    (lambda family, hidden: Request(2, tokens(1, 7, hidden), ops(family, 9)), PositionGap),
    # Past the contract admission enforces: a layer this runner lacks, a KV slot past the model's.
    (lambda family, hidden: Request(2, tokens(1, 7, hidden), [Op(77, 3, 1)]), InternalError),
    (lambda family, hidden: Request(2, tokens(1, 7, hidden), [Op(0, 3, 99)]), InternalError),
    # An activation that is not what the runner computes: another dtype, another width.
    (lambda family, hidden: Request(2, tokens(1, 7, hidden).half(), ops(family, 3)), InternalError),
    (lambda family, hidden: Request(2, tokens(1, 7, hidden + 1), ops(family, 3)), InternalError),
])
@pytest.mark.parametrize("reuse", [False, True], ids=["", "prefix-reuse"])
def test_one_bad_request_in_a_batch_fails_alone(family, bad, error, reuse):
    """A request that cannot run gets its error; the others of the batch their results, and the bad
    session's state is untouched (it continues at its position afterwards). With prefix reuse, whose
    rows the step reads in one copy, as without."""
    batched, alone = load(family, prefix_reuse=reuse), load(family)
    hidden = batched.config.hidden_size
    for runner in (batched, alone):
        for session in (1, 2, 3):
            runner.run(session, tokens(3, session, hidden), ops(family, 0))
    requests = [Request(1, tokens(1, 11, hidden), ops(family, 3)), bad(family, hidden),
                Request(3, tokens(1, 13, hidden), ops(family, 3))]
    results = batched.run_batch(requests)
    assert isinstance(results[1], error)
    for i in (0, 2):
        assert_close(results[i], alone.run(requests[i].session, requests[i].x, requests[i].ops))
    x = tokens(1, 12, hidden)
    assert_close(batched.run(2, x, ops(family, 3)), alone.run(2, x, ops(family, 3)))


def test_a_request_over_the_cache_budget_fails_alone(family):
    """With room for one more session only, the second new session of a batch is refused; the first and
    a continuing session run."""
    probe = load(family)
    probe.run(1, tokens(2, 1, probe.config.hidden_size), ops(family, 0))
    per_session = probe.kv_bytes()
    runner = load(family, kv_budget_bytes=2 * per_session)
    hidden = runner.config.hidden_size
    runner.run(1, tokens(2, 1, hidden), ops(family, 0))
    results = runner.run_batch([Request(1, tokens(1, 2, hidden), ops(family, 2)),
                                    Request(2, tokens(2, 3, hidden), ops(family, 0)),
                                    Request(3, tokens(2, 4, hidden), ops(family, 0))])
    assert isinstance(results[0], torch.Tensor) and isinstance(results[1], torch.Tensor)
    assert isinstance(results[2], CacheBudgetExceeded)
    assert len(runner.sessions()) == 2


def test_a_fault_while_computing_fails_the_group_and_leaves_every_session_as_it_was(family, monkeypatch):
    """An error inside the batched compute fails that group's requests; each session's slots and
    linear states stay at their old positions, so the same requests then succeed and match alone."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    for runner in (batched, alone):
        for session in (1, 2):
            runner.run(session, tokens(3, session, hidden), ops(family, 0))
    requests = [Request(s, tokens(1, 20 + s, hidden), ops(family, 3)) for s in (1, 2)]
    last = batched.blocks[-1]
    with monkeypatch.context() as patch:
        patch.setattr(last, "forward", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
        results = batched.run_batch(requests)
    assert all(isinstance(result, RuntimeError) for result in results)
    for request, result in zip(requests, batched.run_batch(requests), strict=True):
        assert_close(result, alone.run(request.session, request.x, request.ops))


def test_out_of_memory_in_a_batch_fails_only_the_request_that_does_not_fit_alone(family, monkeypatch):
    """A step whose activations do not fit (a GPU's OOM, raised here by the last block for more than 4
    tokens) is run again request by request: the two decodes batched with a 6-token chunk get their
    results, equal to each alone, and only the chunk fails, its session left as it was (security
    review L8: one session's long chunk once failed every decode of its step)."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    for runner in (batched, alone):
        for session in (1, 2, 3):
            runner.run(session, tokens(3, session, hidden), ops(family, 0))
    requests = [Request(1, tokens(1, 31, hidden), ops(family, 3)), Request(2, tokens(6, 32, hidden), ops(family, 3)),
                Request(3, tokens(1, 33, hidden), ops(family, 3))]
    last = batched.blocks[-1]
    forward = last.forward

    def tight(x, *args):
        if x.shape[1] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(x, *args)

    with monkeypatch.context() as patch:
        patch.setattr(last, "forward", tight)
        results = batched.run_batch(requests)
    assert isinstance(results[1], torch.OutOfMemoryError)
    for i in (0, 2):
        assert_close(results[i], alone.run(requests[i].session, requests[i].x, requests[i].ops))
    assert_close(batched.run(2, requests[1].x, requests[1].ops), alone.run(2, requests[1].x, requests[1].ops))


def test_a_linear_layer_refuses_a_rewind_inside_a_batch(tmp_path):
    """A Qwen3.5 session asking to rewind its recurrent state fails alone; its batch-mates decode on."""
    family = ("qwen3_5", make_checkpoint(tmp_path, "qwen3_5"))
    runner = load(family)
    for session in (1, 2):
        runner.run(session, tokens(4, session, 64), ops(family, 0))
    results = runner.run_batch([Request(1, tokens(1, 5, 64), ops(family, 4)),
                                    Request(2, tokens(1, 6, 64), ops(family, 2))])
    assert isinstance(results[0], torch.Tensor) and isinstance(results[1], RecurrentRewind)


def test_a_batch_holds_one_request_per_session(family):
    runner = load(family)
    x = tokens(1, 0, runner.config.hidden_size)
    with pytest.raises(ValueError, match="one request per session"):
        runner.run_batch([Request(1, x, ops(family, 0)), Request(1, x, ops(family, 0))])


@pytest.mark.parametrize("nan_session_leaves", [True, False], ids=["left-its-blocks", "live-beside"])
def test_a_session_of_nan_rows_never_reaches_a_batched_decode(family, nan_session_leaves):
    """A session whose activations are NaN writes NaN K/V rows into its blocks. Then a short and a long
    session decode together: each decode row reads its blocks whole, masked past its own length, and
    the short one's table is padded to the long one's; a masked NaN key still makes a row NaN (0 * NaN).
    Whether the NaN session left (its blocks, taken back by the two, must have been wiped) or stays
    live (the padding must name none of its blocks, only the null block), each answer equals its answer
    alone."""
    runner, alone = load(family), load(family)
    hidden = runner.config.hidden_size
    runner.run(1, torch.full((1, 40, hidden), float("nan")), ops(family, 0))
    if nan_session_leaves:
        runner.free_session(1)
    for session, T in ((2, 3), (3, 40)):
        x = tokens(T, session, hidden)
        runner.run(session, x, ops(family, 0))
        alone.run(session, x, ops(family, 0))
    requests = [Request(2, tokens(1, 20, hidden), ops(family, 3)), Request(3, tokens(1, 30, hidden), ops(family, 40))]
    for request, result in zip(requests, runner.run_batch(requests), strict=True):
        assert_close(result, alone.run(request.session, request.x, request.ops))


def test_a_steps_gathers_share_one_kept_space_and_each_request_reads_its_own_keys(family):
    """Decode rows and two prompt chunks whose blocks interleave with other sessions' (so each is
    gathered, not read as a view) in one step: each equals its request alone, though every gather of
    the step lands in the same kept space; a second step of the same shape reuses that space."""
    batched, alone = load(family), load(family)
    hidden = batched.config.hidden_size
    for position in range(0, 48, 16):  # sessions 1-4 prefill 16 rows each in turn: their blocks interleave
        for session in range(1, 5):
            x = tokens(16, 10 * session + position, hidden)
            assert_close(batched.run(session, x, ops(family, position)), alone.run(session, x, ops(family, position)))

    def step(n):
        requests = [Request(1, tokens(1, n, hidden), ops(family, 48 + n)), Request(2, tokens(1, n + 1, hidden),
                    ops(family, 48 + n)), Request(3, tokens(5, n + 2, hidden), ops(family, 48 + 5 * n)),
                    Request(4, tokens(5, n + 3, hidden), ops(family, 48 + 5 * n))]
        for request, result in zip(requests, batched.run_batch(requests), strict=True):
            assert isinstance(result, torch.Tensor), result
            assert_close(result, alone.run(request.session, request.x, request.ops))

    step(0)
    space = batched.cache.gather_space(1)[0]
    # It holds at least a chunk's gather: its 4 blocks (to position 53), K's half of each block's bytes.
    assert space.untyped_storage().nbytes() >= 4 * batched.cache.bytes_per_block // 2
    step(1)
    assert batched.cache.gather_space(1)[0].data_ptr() == space.data_ptr()
