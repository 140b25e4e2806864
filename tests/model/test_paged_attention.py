"""The paged decode attention kernel (cakemp/model/paged_attention.py): each row's output is its
attention over the keys its block table names, up to its position and within its window, against an
f64 evaluation of the same values; it reads nothing else of the pool. On a GPU compiled, on a CPU
through Triton's interpreter (skipped where triton is not installed); compiled for sm_90 here too."""

import os

import pytest
import torch

pytest.importorskip("triton")

from cakemp.model import paged_attention  # noqa: E402
from tests.support.tolerance import decode_attention_bound  # noqa: E402
from tests.support.triton_compile import compile_kernels, require_nvidia_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (tests/conftest.py sets it)", allow_module_level=True)

pytestmark = pytest.mark.kernel  # (tools/gpu_check runs these on a GPU, compiled)
BLOCK = paged_attention.BLOCK
POOL_BLOCKS = 96


def seen(position: int, window: int | None) -> torch.Tensor:
    """The key positions a row at `position` sees."""
    return torch.arange(0 if window is None else max(0, position + 1 - window), position + 1)


def exact(q, k_pool, v_pool, table, position, window, scale):
    """One row's attention, [H_q, D] in f64, and each head's bound (tests/support/tolerance.py)."""
    H_q, D = q.shape
    H_kv = k_pool.shape[2]
    keys = seen(position, window)
    rows = table[keys // BLOCK] * BLOCK + keys % BLOCK
    k, v = k_pool.reshape(-1, H_kv, D)[rows], v_pool.reshape(-1, H_kv, D)[rows]  # [S, H_kv, D]
    out, bounds = torch.empty(H_q, D, dtype=torch.float64), []
    for head in range(H_q):
        kv_head = head // (H_q // H_kv)
        scores = (k[:, kv_head].double() @ q[head].double()) * scale
        out[head] = torch.softmax(scores, 0) @ v[:, kv_head].double()
        bounds.append(decode_attention_bound(q[head], k[:, kv_head], v[:, kv_head], scale, q.dtype))
    return out, torch.tensor(bounds, dtype=torch.float64)


def pools(H_kv, D, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(POOL_BLOCKS, BLOCK, H_kv, D, generator=generator) for _ in range(2))
    k[0] = v[0] = 0  # the null block, as the pools hold it
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def scattered_tables(rows, width, seed):
    """Each row's table: `width` distinct blocks of the pool's, in no order, none the null or scratch block."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(POOL_BLOCKS - 2, generator=generator)[:width] + 2 for _ in range(rows)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(("H_q", "H_kv", "D", "window"), [
    (4, 2, 16, None),  # n_rep 2
    (8, 1, 24, 37),  # n_rep 8, a head size padded (24 -> 32), a window
    (2, 2, 64, None),  # no GQA
    (32, 2, 16, 300),  # n_rep 16: the kernel's query rows all real; a window past a split's keys
], ids=["gqa", "window-odd-head", "mha", "wide-gqa-long-window"])
def test_each_row_attends_over_its_own_blocks_to_its_position(dtype, H_q, H_kv, D, window):
    """Rows at positions in their first block, mid-table and near its end (up to 3 splits of keys),
    tables scattered over the pool: each output within the analysis's bound of the exact one."""
    width, positions = 40, torch.tensor([5, 0, 250, 639, 300])  # 40 blocks: 640 positions, 3 splits
    k_pool, v_pool = pools(H_kv, D, dtype, seed=H_q + D)
    tables = scattered_tables(len(positions), width, seed=D)
    q = torch.randn(len(positions), H_q, D, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    scale = D**-0.5
    got = paged_attention.attend(q, k_pool, v_pool, tables.to(DEVICE), positions.to(DEVICE), window, scale,
                                 width * BLOCK)
    assert got.dtype == dtype and got.shape == q.shape
    for row, position in enumerate(positions.tolist()):
        expected, bounds = exact(q[row].cpu(), k_pool.cpu(), v_pool.cpu(), tables[row], position, window, scale)
        error = (got[row].cpu().double() - expected).abs().amax(1)
        assert (error <= bounds).all(), (row, (error / bounds).max().item())


def test_it_reads_nothing_past_a_row_s_position_nor_before_its_window():
    """Every pool row a row may not see is NaN (later rows of its last block, earlier rows of its first,
    the blocks of other tables, the null block); so are the query rows of padding: each real row's output
    is still its exact attention, and a strided query (a view of [1, H_q, B, D], as a layer holds it) is
    read as it lies."""
    H_q, H_kv, D, window = 4, 2, 16, 20
    k_pool, v_pool = pools(H_kv, D, torch.float32, seed=1)
    clean_k, clean_v = k_pool.clone(), v_pool.clone()
    positions = torch.tensor([3, 44, 290])
    tables = scattered_tables(len(positions), 20, seed=2)
    visible = torch.zeros(POOL_BLOCKS * BLOCK, dtype=torch.bool)
    for table, position in zip(tables, positions.tolist(), strict=True):
        keys = seen(position, window)
        visible[table[keys // BLOCK] * BLOCK + keys % BLOCK] = True
    for pool in (k_pool, v_pool):
        pool.view(-1, H_kv, D)[~visible.to(DEVICE)] = float("nan")
    q = torch.randn(1, H_q, len(positions), D, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    rows = q[0].transpose(0, 1)  # [B, H_q, D], strided
    got = paged_attention.attend(rows, k_pool, v_pool, tables.to(DEVICE), positions.to(DEVICE), window, D**-0.5,
                                 20 * BLOCK)
    for row, position in enumerate(positions.tolist()):
        expected, bounds = exact(rows[row].cpu(), clean_k, clean_v, tables[row], position, window, D**-0.5)
        assert ((got[row].cpu().double() - expected).abs().amax(1) <= bounds).all(), row


def test_a_padding_row_of_null_blocks_gives_zeros_and_no_nan():
    """A fixed-shape step's padding row: its table all the null block, at any stale position: its
    output is finite (the null block's zero values), so nothing it computes is NaN."""
    k_pool, v_pool = pools(2, 16, torch.float32, seed=5)
    tables = torch.zeros(2, 32, dtype=torch.int64, device=DEVICE)
    positions = torch.tensor([0, 400], device=DEVICE)
    q = torch.randn(2, 4, 16, device=DEVICE)
    got = paged_attention.attend(q, k_pool, v_pool, tables, positions, None, 0.25, 32 * BLOCK)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("keys", [256, 600], ids=["a-split", "inside-a-split"])
def test_a_row_past_the_keys_named_reads_nothing_beyond_them(keys):
    """`keys` must reach every row's position; a caller that names fewer (a bug) gets attention over the keys
    before it only, and no program reads past them: neither splits it did not launch (on a GPU, memory past
    their buffers) nor table entries past the row's (`keys` inside a split; those entries are NaN blocks here)."""
    k_pool, v_pool = pools(2, 16, torch.float32, seed=6)
    tables = scattered_tables(1, 40, seed=7)
    k_pool[tables[0, -(-keys // BLOCK):]] = v_pool[tables[0, -(-keys // BLOCK):]] = float("nan")
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    got = paged_attention.attend(q, k_pool, v_pool, tables.to(DEVICE), torch.tensor([630], device=DEVICE), None,
                                 0.25, keys)
    expected, bounds = exact(q[0].cpu(), k_pool.cpu(), v_pool.cpu(), tables[0], keys - 1, None, 0.25)
    assert ((got[0].cpu().double() - expected).abs().amax(1) <= bounds).all()


def test_the_keys_are_split_among_programs_by_the_width_asked_for():
    """256 positions a program, up to 64 programs a row and head; wider splits past that."""
    assert [paged_attention.splits_for(keys) for keys in (16, 256, 257, 640, 16384, 16385, 131072)] == [
        (1, 256), (1, 256), (2, 256), (3, 256), (64, 256), (33, 512), (64, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_start_up_trial_passes_the_kernel_and_fails_a_wrong_one(dtype, monkeypatch):
    """What a GPU device runs before it uses the kernel (paged_attention.trial, beside the portable way):
    it passes the kernel, here through the interpreter, and fails one that drops a row's last key."""
    paged_attention.trial(DEVICE, dtype, n_rep=4, head_dim=32)
    attend = paged_attention.attend

    def short_by_one(q, k_pool, v_pool, tables, positions, *args):
        return attend(q, k_pool, v_pool, tables, positions - 1, *args)

    monkeypatch.setattr(paged_attention, "attend", short_by_one)
    with pytest.raises(RuntimeError, match="differs from the portable way"):
        paged_attention.trial(DEVICE, dtype, n_rep=4, head_dim=32)


def test_a_gpu_takes_the_kernel_only_once_its_trial_passed(monkeypatch):
    """paged_step.in_place_attention: the CPU's decode rows attend over gathered keys, whatever Triton
    can do; a GPU's in place where the kernel's trial passed, else over gathered keys too, logged with
    why (no GPU is needed to decide: the trial is what touches the device)."""
    from structlog.testing import capture_logs

    from cakemp.compute.paged_step import in_place_attention

    def fails(*shape):
        raise RuntimeError("no kernel image is available")

    gpu = torch.device("cuda", 0)
    in_place_attention.cache_clear()  # it decides once a shape: the decisions made here go with this test
    try:
        assert in_place_attention(torch.device("cpu"), torch.float32, 4, 32) is None
        monkeypatch.setattr(paged_attention, "trial", lambda *shape: None)
        assert in_place_attention(gpu, torch.bfloat16, 4, 64) is paged_attention.attend
        monkeypatch.setattr(paged_attention, "trial", fails)
        with capture_logs() as logs:
            assert in_place_attention(gpu, torch.bfloat16, 8, 64) is None
        assert [log["reason"] for log in logs] == ["RuntimeError: no kernel image is available"]
    finally:
        in_place_attention.cache_clear()


def test_the_kernel_compiles_for_hopper_as_a_gpu_compiles_it():
    """The interpreter above runs the kernel's Python; a GPU compiles it, which refuses what the
    interpreter takes. Each dtype, with GQA groups of 1 to 8 and head sizes 64 to 256 (80: padded),
    compiled for sm_90 by Triton's own compiler as far as the GPU's binary (tests/support/triton_compile.py);
    skipped where Triton has no NVIDIA backend."""
    require_nvidia_backend()
    cases = [f"paged:{dtype}:{n_rep}:{head_dim}" for dtype in ("bf16", "fp16", "fp32")
             for n_rep, head_dim in ((1, 64), (4, 128), (8, 80), (2, 256))]
    failed = compile_kernels(cases)
    assert not failed, failed


@pytest.mark.gpu
def test_a_gpu_runner_s_decode_rows_read_in_place_as_the_gathered_ones(tmp_path):
    """On a GPU a runner's decode rows go through the kernel (its cache's `paged_attend`), graphed and
    not: three sessions at different lengths decode as a runner whose rows attend over gathered keys."""
    from cakemp.compute.runner import BlockRunner, Request
    from cakemp.op import Op
    from tests.support.checkpoints import make_checkpoint
    from tests.support.tolerance import assert_close

    path = make_checkpoint(tmp_path, "gemma3")  # windows of 4 beside full layers
    layers = [f"model.layers.{i}" for i in range(3)]
    graphed, eager, gathered = (BlockRunner.load(path, layers, "cuda", torch.float32, graph_batch=batch)
                                for batch in (4, None, None))
    assert graphed.cache.paged_attend is eager.cache.paged_attend is paged_attention.attend  # its trial passed
    gathered.cache.paged_attend = None
    hidden, lengths = graphed.config.hidden_size, {1: 3, 2: 40, 3: 255}
    generator = torch.Generator().manual_seed(0)
    for session, T in lengths.items():
        x = torch.randn(1, T, hidden, generator=generator).cuda()
        for runner in (graphed, eager, gathered):
            runner.run(session, x, [Op(i, 0, i) for i in range(3)])
    for _ in range(3):
        requests = [Request(s, torch.randn(1, 1, hidden, generator=generator).cuda(), [Op(i, lengths[s], i) for i in range(3)])
                    for s in lengths]
        expected = gathered.run_batch(requests)
        for runner in (graphed, eager):
            for mine, theirs in zip(runner.run_batch(requests), expected, strict=True):
                assert_close(mine, theirs)
        for s in lengths:
            lengths[s] += 1
    assert graphed.graphs.made
