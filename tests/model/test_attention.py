"""Attention per call shape: the masked computation's result, bounded memory for windows, and the kernel that ran."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from cakemp.model import attention

H_Q, H_KV, D = 4, 2, 16
SCALE = 1 / math.sqrt(D)


def qkv(T: int, S: int, dtype=torch.float32, device="cpu", seed=0):
    """q: [1, H_q, T, D]; k, v: [1, H_kv, S, D]."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, D, generator=generator) for heads, n in ((H_Q, T), (H_KV, S), (H_KV, S)))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def masked(q, k, v, start, window):
    """The definition in f64: softmax over keys [p - window + 1, p] of query position p, kv head j // n_rep."""
    T = q.shape[2]
    end = start + T
    n_rep = q.shape[1] // k.shape[1]
    keys = k[:, :, :end].double().repeat_interleave(n_rep, dim=1)
    values = v[:, :, :end].double().repeat_interleave(n_rep, dim=1)
    q_pos = torch.arange(start, end, device=q.device)[:, None]
    k_pos = torch.arange(end, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = (q.double() @ keys.transpose(-1, -2) * SCALE).masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ values


# (start, T, window): prefill from 0 and after cached positions, prompts shorter than, equal to,
# and many times the window, a last chunk that is partial, and decode inside and past the window.
SHAPES = [
    (0, 40, None), (7, 33, None), (0, 1, None), (39, 1, None),
    (0, 5, 8), (0, 8, 8), (0, 40, 8), (3, 37, 8), (13, 27, 8), (39, 1, 8), (4, 1, 8), (0, 40, 1),
]


@pytest.mark.parametrize("start, T, window", SHAPES)
def test_attend_equals_the_masked_computation(start, T, window):
    """Chunked windows, lower-right causal and decode rows all give the masked softmax's result."""
    q, k, v = qkv(T, 48)
    out = attention.attend(q, k, v, start, window, SCALE)
    assert out.shape == (1, H_Q, T, D)
    assert (out.double() - masked(q, k, v, start, window)).abs().max() <= 1e-5


def peak_bytes_beyond_output(fn) -> int:
    """Peak bytes the CPU allocator held during `fn()` beyond its result, from torch's memory profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    # An op's self usage is what it allocated net of what it freed itself, mostly its temporaries
    # freed as it returns: taken at each op's end, in order, they trace the live bytes.
    for event in sorted(prof.events(), key=lambda e: e.time_range.end):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak - out.numel() * out.element_size()


def test_window_prefill_memory_grows_with_the_window_not_the_prompt():
    """Beyond its output, a windowed prefill holds the same bytes for a 4096-token prompt as for a
    256-token one, more for a wider window, while one masked call grows with the prompt squared."""
    def chunked(T, window):
        q, k, v = qkv(T, T)
        return peak_bytes_beyond_output(lambda: attention.attend(q, k, v, 0, window, SCALE))

    def one_masked_call(T, window):
        q, k, v = qkv(T, T)
        positions = torch.arange(T)
        mask = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - window)
        return peak_bytes_beyond_output(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True))

    short, long = chunked(256, 32), chunked(4096, 32)
    assert long == short
    assert chunked(4096, 128) > 2 * long
    # The masked call's [T, T] mask alone is 16 MiB of f32 at 4096 tokens.
    assert one_masked_call(4096, 32) > 4096 * 4096 * 4 > 100 * long


@pytest.mark.parametrize("start, T, window", [(0, 40, None), (7, 33, None), (39, 1, None), (0, 40, 8), (39, 1, 8)])
def test_cpu_calls_run_the_cpu_flash_kernel(start, T, window):
    """On CPU every call shape runs SDPA's flash kernel, one call per window chunk, never math."""
    q, k, v = qkv(T, 48)
    chunks = 1 if window is None or T == 1 else -(-T // window)
    assert attention.backends_used(q, k, v, start, window, SCALE) == ("flash-cpu",) * chunks


def test_backends_used_sees_the_math_kernel():
    """The report is read from what ran: with only the math kernel allowed, it says math."""
    q, k, v = qkv(8, 8)
    with sdpa_kernel([SDPBackend.MATH]):
        assert attention.backends_used(q, k, v, 0, None, SCALE) == ("math",)


# Each call shape the block makes, in every dtype a GPU computes in, with the math kernel
# disabled: SDPA raises if no fused kernel takes a call. Decode runs at two neighbouring lengths.
CUDA_SHAPES = [(0, 512, None), (100, 412, None), (0, 1, None), (511, 1, None), (512, 1, None),
               (0, 512, 128), (100, 412, 128), (511, 1, 128), (512, 1, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("start, T, window", CUDA_SHAPES)
def test_cuda_call_shapes_run_fused_kernels(start, T, window, dtype):
    """No call shape needs the math kernel on CUDA, and each still equals the masked computation."""
    attention.use_fused_kernels()
    q, k, v = qkv(T, 640, dtype, "cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        used = attention.backends_used(q, k, v, start, window, SCALE)
        out = attention.attend(q, k, v, start, window, SCALE)
    assert used and set(used) <= {"flash", "efficient"}
    tolerance = 1e-5 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps
    assert (out.double() - masked(q, k, v, start, window)).abs().max() <= tolerance
