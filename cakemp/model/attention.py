"""Attention of T new queries over a KV buffer, each call shaped so that a fused SDPA kernel takes it.

SDPA falls back to its math kernel, which materialises f32 [heads, T, S] scores, whenever no
fused kernel accepts the call: flash takes no mask and no f32, the memory-efficient kernel
takes no GQA. So each call shape is built for the kernels that exist:

| call shape                  | how it is called                                   | CUDA kernel              |
|-----------------------------|----------------------------------------------------|--------------------------|
| decode (T == 1)             | the n_rep query heads of a kv head as n_rep query  | flash (f16/bf16),        |
|                             | rows of it, over the window's keys; no mask        | efficient (f32)          |
| prefill, full causal        | lower-right causal, no mask tensor; GQA passed     | flash (f16/bf16),        |
|                             | through where flash takes it, else K/V expanded    | efficient (f32)          |
| prefill, sliding window     | window-sized query chunks, each over its <= 2W - 1 | efficient (flash, as     |
|                             | keys with a band mask; K/V expanded (a chunk the   | causal, where the window |
|                             | window does not cut is plain causal)               | cuts nothing)            |

A windowed prefill thus never holds more than [window, 2 * window] of mask and scores at a
time, whatever the prompt length. cuDNN attention is switched off on CUDA (`use_fused_kernels`):
SDPA tries it first on sm90, and it builds an execution graph per sequence length, i.e. at
every decode step. `backends_used` says which kernel really ran for a call: the choice is
verified (tests, tools/gpu_check.py), not assumed. (On a CPU, which has no fused lower-right
kernel, a causal prefill after earlier positions passes its [T, S] mask: what torch's causal
bias would materialise there.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

# The aten op each SDPA backend runs as (what the profiler records), by backend name.
_BACKEND_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_efficient_attention_forward": "efficient",  # lower-right causal calls it directly
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
}


def use_fused_kernels() -> None:
    """Process-wide, on a CUDA device: keep cuDNN attention out of SDPA's choice (see the module
    docstring), and import `causal_lower_right`'s module now, at the device's start, not at its first
    chunked prefill (it imports torch._dynamo: about a second)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    from torch.nn.attention import bias  # noqa: F401  (the import is the point)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, scale: float
) -> torch.Tensor:
    """q: [B, H_q, T, D] at positions start..start+T-1; k, v: [B, H_kv, >= start+T, D], rows
    [0, start+T) valid -> [B, H_q, T, D].

    Query position p sees keys [p - window + 1, p] (or [0, p] when `window` is None).
    """
    B, H_q, T, D = q.shape
    H_kv = k.shape[1]
    end = start + T
    if T == 1:
        # Query head j reads kv head j // n_rep, so the n_rep query heads of a kv head become
        # n_rep query rows of it: every kernel takes that (no GQA flag, no mask), and each K/V
        # row is read once (enable_gqa repeats K/V: 3x slower at 4k context on CPU).
        first = 0 if window is None else max(0, end - window)
        out = F.scaled_dot_product_attention(q.view(B, H_kv, H_q // H_kv, D), k[:, :, first:end], v[:, :, first:end],
                                             scale=scale)  # [B, H_kv, n_rep, D]
        return out.reshape(B, H_q, 1, D)
    if window is None:
        return _causal(q, k[:, :, :end], v[:, :, :end], scale)
    out = q.new_empty(B, H_q, T, D)
    # Chunks of `window` queries: chunk [c0, c1) sees keys [c0 - window + 1, c1), a band.
    for c0 in range(start, end, window):
        c1 = min(c0 + window, end)
        first = max(0, c0 - window + 1)
        q_chunk = q[:, :, c0 - start : c1 - start]
        if c1 - window <= first:  # the window cuts no key here (a prompt within the window): plain causal
            out[:, :, c0 - start : c1 - start] = _causal(q_chunk, k[:, :, first:c1], v[:, :, first:c1], scale)
            continue
        q_pos = torch.arange(c0, c1, device=q.device)[:, None]  # [C, 1]
        k_pos = torch.arange(first, c1, device=q.device)[None, :]  # [1, S_c]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [C, S_c]
        keys, values, gqa = _kv_heads_for(q_chunk, k[:, :, first:c1], v[:, :, first:c1], flash_possible=False)
        out[:, :, c0 - start : c1 - start] = F.scaled_dot_product_attention(
            q_chunk, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out


def seen_keys(keys: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """keys: [S] positions (or [d, S], each row's own), positions: [d] each decode row's own -> [d, S] bool:
    the keys each row sees (to its own position; within the last `window` of them where there is one)."""
    position = positions[:, None]  # [d, 1]
    seen = keys <= position
    if window is not None:
        seen &= keys > position - window
    return seen


def bias(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """seen: a bool mask -> the same mask as SDPA adds it to the scores, in `dtype`: 0 where seen, -inf
    elsewhere (what SDPA makes of a bool mask at every call; made once, a step's layers share it)."""
    return torch.full(seen.shape, float("-inf"), dtype=dtype, device=seen.device).masked_fill_(seen, 0.0)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode rows of several requests in one call: q: [B, H_q, D], request b's one query; k, v:
    [B, H_kv, S, D], its keys padded to the longest; visible: [B, S], which keys it sees (bool, or
    `bias`'s additive mask) -> [B, H_q, D].

    As `attend`'s decode: the n_rep query heads of a kv head become n_rep query rows of it, so each
    K/V row is read once and no GQA flag is needed; the mask takes the padding and the window
    (CUDA: the memory-efficient kernel; a CPU: its flash kernel).
    """
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(B, H_kv, H_q // H_kv, D), k, v, attn_mask=visible[:, None, None, :],
                                         scale=scale)  # [B, H_kv, n_rep, D]
    return out.reshape(B, H_q, D)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention with the diagonal aligned to the last key (the cache may hold earlier
    positions: chunked prefill).

    From position 0 (T == S) that is SDPA's own is_causal. After earlier positions, on CUDA,
    causal_lower_right: it materialises no mask where a fused kernel takes the call, and lets kernels
    skip masked blocks. On a CPU no fused kernel takes a lower-right causal call (torch materialises
    its mask there), so the [T, S] mask is built here, and a CPU device never imports
    torch.nn.attention.bias, whose import of torch._dynamo would cost its start about a second.
    """
    T, S = q.shape[2], k.shape[2]
    k, v, gqa = _kv_heads_for(q, k, v, flash_possible=True)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right  # imported at the device's start (use_fused_kernels)

        mask = causal_lower_right(T, S)
    else:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # query i sees keys <= S - T + i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _kv_heads_for(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash_possible: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for a call with H_q query heads over H_kv kv heads.

    On CUDA only flash takes GQA; where flash cannot take the call (a mask, f32, an odd head
    size) K/V are expanded to H_q heads ([B, H_q, S, D], transient) so that the
    memory-efficient kernel can. CPU kernels take GQA as it is.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return k, v, False
    if q.device.type != "cuda":
        return k, v, True
    if flash_possible and can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)):
        return k, v, True
    return _repeat_heads(k, n_rep), _repeat_heads(v, n_rep), False


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D], head j being kv head j // n_rep."""
    B, H_kv, S, D = x.shape
    return x[:, :, None].expand(B, H_kv, n_rep, S, D).reshape(B, H_kv * n_rep, S, D)


def backends_used(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, scale: float
) -> tuple[str, ...]:
    """The SDPA backends `attend` ran for this call, in order (one per SDPA call it made):
    "flash", "efficient", "cudnn", "math" or "flash-cpu", as the profiler recorded their ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attend(q, k, v, start, window, scale)
    # Nested records (an SDPA op calling another) keep only the outermost backend op.
    names = []
    outer_end = -1.0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        backend = _BACKEND_OPS.get(event.name)
        if backend is None or event.time_range.start < outer_end:
            continue
        names.append(backend)
        outer_end = event.time_range.end
    return tuple(names)
