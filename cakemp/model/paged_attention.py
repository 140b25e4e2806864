"""A step's decode rows attending over their own blocks of a KV pool, in place: a Triton kernel.

The portable path (model/attention.attend_rows, fed by kv_cache.Pool.gather) first copies every
row's blocks into a [rows, H_kv, S, D] buffer padded to the longest row of its group (rows reading alike
numbers of blocks: compute/paged_step.py; in a GPU's fixed-shape step, every row to the graph's width, a
power of two), then has SDPA read that copy through a mask. A decode step is
bound by memory: the KV it reads is, past short contexts, most of the step's bytes after the
weights. The copy reads the KV once, writes it once more and SDPA reads it again, padding included:
three to five times the bytes that attention needs. This kernel reads each row's keys and values
where they lie in the pool, through its block table, up to its own position and no further.

Each program computes one row's query heads of one kv head (the n_rep query heads that read kv head
h, as attend_rows' call shape groups them) over one split of the key positions: keys in tiles of
TILE positions, each key's pool row looked up in the row's block table, scores in f32 and a running
(max, sum) softmax, as flash attention computes it. Splitting the keys keeps a GPU's cores busy when
few rows have long contexts (one session at 8k positions: 8 kv heads x 32 splits, not 8 programs);
the splits' partial results, each with its log-sum-exp, are merged by a second kernel (two launches
a layer, where the gathered way's copies, mask and SDPA make about six).

Nothing in it reads a value back to the host or depends on one for its launch (the splits are fixed
by the key width the caller names, the loop bounds are read on the GPU), so a CUDA graph captures
it as it is (compute/decode_graph.py). Rounding: queries, keys and values are read into f32, the
scores, the softmax and every sum are f32, and the output is rounded once to the step's dtype. The
dots of an f32 step are f32 ("ieee"); a bf16 / f16 step's run on TF32 tensor cores, which hold its
queries, keys and values exactly and keep 10 bits of each probability's mantissa in its product with V
(truncated, by up to 2^-10 relatively; SDPA's fused kernels round them to the step's dtype, 7 bits for bf16).

A GPU device uses it once `trial` has run it there beside the portable path and they matched
(compute/paged_step.in_place_attention). Triton's interpreter (TRITON_INTERPRET=1) runs it on a CPU,
where the tests check it against an f64 evaluation of the same attention; tests/support/triton_compile.py
compiles it for sm_90. A CPU device never calls it (Triton compiles for GPUs only): its steps keep the
portable path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakemp.model import attention

BLOCK = 16  # positions per block of the pool: kv_cache.BLOCK's (model/ cannot import compute/)
_BLOCK = tl.constexpr(BLOCK)  # as the kernel reads it (the compiler reads a global only as a constexpr)
SPLIT_KEYS = 256  # key positions per program at least: a split of a row's keys
MAX_SPLITS = 64  # past 16,384 positions the splits widen instead (a short row in a wide graph: most are idle)
_QUERY_ROWS = 16  # tl.dot's least rows: a kv head's n_rep query heads padded to this


@triton.jit
def _seen(positions_ptr, b, window, reach):
    """Row b's keys [first, end): to its own position, the last `window` of them where there is one (0: none),
    and before `reach`, the key positions the caller named (which every row's position should be within)."""
    end = tl.load(positions_ptr + b) + 1
    return tl.where(window > 0, tl.maximum(end - window, 0), 0), tl.minimum(end, reach)


# What varies from step to step (a graph's bucket sets q's strides, a context's growth the tables' width and
# the splits) compiles no new variant: Triton would specialise each integer on being 1 or a multiple of 16, and
# each pointer on its alignment (a layer's positions and tables are views at any offset of the step's).
@triton.jit(do_not_specialize=["stride_qb", "stride_qh", "stride_tb", "window", "reach", "split_keys"],
            do_not_specialize_on_alignment=["q_ptr", "tables_ptr", "positions_ptr"])
def _partial(q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, o_ptr, lse_ptr,
             stride_qb, stride_qh, stride_kb, stride_kr, stride_kh, stride_tb, window, scale, reach, split_keys,
             N_REP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr,
             PRECISION: tl.constexpr):
    # q: [B, H_q, D]; k, v: [blocks, BLOCK, H_kv, D]; tables: [B, W] block ids; positions: [B];
    # o: [B, H_kv, splits, N_REP, D] f32, each split's softmax-weighted V; lse: [B, H_kv, splits, N_REP] f32.
    # A split holding none of its row's keys (past its end, before its window) writes nothing: _merge skips it.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    first, end = _seen(positions_ptr, b, window, reach)
    lo = tl.maximum(first, split * split_keys)
    hi = tl.minimum(end, (split + 1) * split_keys)
    rows = tl.arange(0, ROWS)  # [R]: query head h * N_REP + row
    dims = tl.arange(0, D_PAD)
    row_ok = rows < N_REP
    dim_ok = dims < D
    q = tl.load(q_ptr + b * stride_qb + (h * N_REP + rows)[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [R, D]
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, D_PAD), dtype=tl.float32)
    for start in range(lo - lo % TILE, hi, TILE):  # every tile holds a key of [lo, hi)
        keys = start + tl.arange(0, TILE)  # [T]
        seen = (keys >= lo) & (keys < hi)
        block = tl.load(tables_ptr + b * stride_tb + keys // _BLOCK, mask=seen, other=0)
        at = block * stride_kb + (keys % _BLOCK) * stride_kr + h * stride_kh  # [T]: each key's row of head h
        kv_mask = seen[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(seen[None, :], scores * scale, float("-inf"))  # [R, T]
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    at = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + split) * N_REP  # lse's [b, h, split, 0]
    some = rows < tl.where(lo < hi, N_REP, 0)  # the rows to store: none where the split holds no key
    total = tl.maximum(total, 1.0)  # (a split that saw a key sums exp(0) for its largest score: >= 1 already)
    tl.store(o_ptr + (at + rows)[:, None] * D + dims[None, :], acc / total[:, None], mask=some[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + at + rows, m + tl.log(total), mask=some)


@triton.jit(do_not_specialize=["stride_ob", "stride_oh", "splits", "window", "reach", "split_keys"],
            do_not_specialize_on_alignment=["positions_ptr"])
def _merge(o_ptr, lse_ptr, out_ptr, positions_ptr, stride_ob, stride_oh, splits, window, reach, split_keys,
           N_REP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    # o: [B, H_kv, splits, N_REP, D] f32, lse: [B, H_kv, splits, N_REP] f32 -> out: [B, H_q, D]: the splits
    # holding the row's keys, each's softmax weighted by its share of the whole, exp(lse - the largest lse),
    # rounded once to out's dtype (a GPU rounds to nearest; Triton's interpreter truncates).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    first, end = _seen(positions_ptr, b, window, reach)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < N_REP
    mask = row_ok[:, None] & (dims < D)[None, :]
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, D_PAD), dtype=tl.float32)
    for split in range(first // split_keys, (end - 1) // split_keys + 1):
        at = ((b * tl.num_programs(1) + h) * splits + split) * N_REP + rows
        lse = tl.load(lse_ptr + at, mask=row_ok, other=0.0)
        o = tl.load(o_ptr + at[:, None] * D + dims[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        weight = tl.exp(lse - m_new)
        total = total * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * o
        m = m_new
    tl.store(out_ptr + b * stride_ob + (h * N_REP + rows)[:, None] * stride_oh + dims[None, :],
             (acc / tl.where(total > 0, total, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def constants(n_rep: int, head_dim: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """The compile-time arguments of `_partial` and of `_merge` for kv heads of `n_rep` query heads each, of
    `head_dim`, in `dtype`: tiles of keys narrower for wide heads (a tile of keys and one of values are held
    in f32), f32 dots in f32 ("ieee"), a half dtype's in TF32."""
    shape = dict(N_REP=n_rep, ROWS=max(_QUERY_ROWS, triton.next_power_of_2(n_rep)), D=head_dim,
                 D_PAD=triton.next_power_of_2(max(head_dim, 16)))
    # An f32 step's dots run on the CUDA cores, a [16, D] x [D, TILE] product in registers: 16 keys a tile.
    wide = shape["D_PAD"] > (64 if dtype == torch.float32 else 128)
    return shape | dict(TILE=16 if wide else 32, PRECISION="ieee" if dtype == torch.float32 else "tf32"), shape


def splits_for(keys: int) -> tuple[int, int]:
    """(splits, the key positions each holds) of rows reaching `keys` positions: SPLIT_KEYS each, up to
    MAX_SPLITS of them, wider beyond."""
    width = SPLIT_KEYS * max(1, -(-keys // (SPLIT_KEYS * MAX_SPLITS)))
    return max(1, -(-keys // width)), width


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
           positions: torch.Tensor, window: int | None, scale: float, keys: int) -> torch.Tensor:
    """q: [B, H_q, D], one decode row per request; k_pool, v_pool: [blocks, BLOCK, H_kv, D]; tables: [B, W]
    int64, each row's blocks (its keys at positions [0, W * BLOCK)); positions: [B] int64, each row's own
    position: it sees its keys up to it (the last `window` of them where there is one) -> [B, H_q, D].

    `keys`: the key positions the rows may reach, at most W * BLOCK (a step's furthest row's, rounded up
    as the caller likes: fixed for a graph); it sets the splits. A row past it would see only its keys before
    it, and nothing past it is read (ValueError where it passes the tables' positions)."""
    B, H_q, D = q.shape
    H_kv = k_pool.shape[2]
    n_rep = H_q // H_kv
    _check(q, k_pool, v_pool, tables, positions, keys)
    if q.stride(2) != 1:
        q = q.contiguous()
    splits, split_keys = splits_for(keys)
    o = torch.empty(B, H_kv, splits, n_rep, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H_kv, splits, n_rep, dtype=torch.float32, device=q.device)
    partial, merge = constants(n_rep, D, q.dtype)
    _partial[(B, H_kv, splits)](
        q, k_pool, v_pool, tables, positions, o, lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), tables.stride(0),
        window or 0, scale, keys, split_keys, **partial)
    out = torch.empty(B, H_q, D, dtype=q.dtype, device=q.device)
    _merge[(B, H_kv)](o, lse, out, positions, out.stride(0), out.stride(1), splits, window or 0, keys, split_keys,
                      **merge)
    return out


def _check(q, k_pool, v_pool, tables, positions, keys: int) -> None:
    """ValueError where the call breaks what the kernel assumes of its tensors (read from shapes and
    strides only: nothing waits for the GPU)."""
    if not (k_pool.shape == v_pool.shape and k_pool.stride() == v_pool.stride() and k_pool.stride(3) == 1
            and k_pool.shape[1] == BLOCK and k_pool.shape[3] == q.shape[2] and q.shape[1] % k_pool.shape[2] == 0):
        raise ValueError(f"pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)} do not fit queries {tuple(q.shape)}")
    if tables.dtype != torch.int64 or positions.dtype != torch.int64 or tables.stride(1) != 1 or \
            positions.stride(0) != 1 or len(tables) != len(q) or len(positions) != len(q):
        raise ValueError(f"tables {tables.dtype} {tuple(tables.shape)} and positions {positions.dtype} "
                         f"{tuple(positions.shape)}: one int64 row each of {len(q)} rows, contiguous")
    if keys > tables.shape[1] * BLOCK:
        raise ValueError(f"keys {keys} past the tables' {tables.shape[1] * BLOCK} positions")


def trial(device: torch.device, dtype: torch.dtype, n_rep: int, head_dim: int) -> None:
    """Run the kernel on `device` for a layer of `n_rep` query heads a kv head of `head_dim`, in `dtype`, beside
    the portable way (attend_rows over the same keys, gathered): two rows over scattered blocks, across
    splits, with and without a window. RuntimeError where they differ past the dtype's rounding (any
    failure to compile or run it raises too): the caller then keeps the portable way."""
    generator = torch.Generator().manual_seed(0)
    H_kv, width = 2, 40  # blocks a table: 640 positions, three splits
    k_pool, v_pool = (torch.randn(width * 2 + 2, BLOCK, H_kv, head_dim, generator=generator).to(device, dtype)
                      for _ in range(2))
    tables = torch.stack([torch.randperm(width * 2, generator=generator)[:width] + 2 for _ in range(2)]).to(device)
    positions = torch.tensor([5, 600], device=device)
    q = torch.randn(2, H_kv * n_rep, head_dim, generator=generator).to(device, dtype)
    keys = torch.arange(width * BLOCK, device=device)
    k, v = (pool[tables].flatten(1, 2).transpose(1, 2).float() for pool in (k_pool, v_pool))  # [2, H_kv, S, D]
    for window in (None, 300):
        seen = attention.seen_keys(keys, positions, window)
        expected = attention.attend_rows(q.float(), k, v, seen, head_dim**-0.5)  # the same values, in f32
        got = attend(q, k_pool, v_pool, tables, positions, window, head_dim**-0.5, width * BLOCK).float()
        # The output's rounding to `dtype` (and the reference's, twice over), the sums' order over its keys in
        # f32 and, for a half dtype, TF32's truncated probabilities (2^-10). A key missed or too many is far more.
        tolerance = 4 * torch.finfo(dtype).eps * expected.abs().max().item() + \
            (len(keys) * 2.0**-24 + (2.0**-10 if dtype != torch.float32 else 0.0)) * v.abs().max().item()
        error = (got - expected).abs().max().item()
        if not error <= tolerance:  # (not an assert: `python -O` would drop the check)
            raise RuntimeError(f"the kernel differs from the portable way by {error:.3g} (window {window})")
