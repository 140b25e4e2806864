"""Gated DeltaNet: Qwen3.5's linear-attention token mixer, and the delta rule it runs.

Per value head the layer keeps a matrix state S: [D_k, D_v] instead of a growing KV cache.
Token t (after a causal depthwise convolution over the last K inputs and SiLU) gives an
L2-normalised key k_t and query q_t, a value v_t, a decay exp(g_t) in (0, 1) and a write
strength beta_t in (0, 1):

    S   <- exp(g_t) * S
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T      # the delta rule: write only the correction
    o_t  = S^T q_t

A decode step does exactly that (`recurrent_step`). A prompt runs the same recurrence in
chunks of CHUNK tokens (`chunked_delta_rule`): inside a chunk the writes are condensed by a
triangular solve (the WY / UT representation of the Gated DeltaNet paper) into a few
matmuls, and only the chunks are visited in order.

What a session keeps between requests, both f32 (`LinearState`): the last K - 1 inputs of the
convolution, so a prompt sent in several chunks convolves across their boundary (Cake at the
seed zero-pads there), and S.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.layout import LINEAR_CONV
from cakemp.model.linear import linear

CHUNK = 64  # tokens per chunk of the parallel prefill form (flash-linear-attention's and HF's choice)
L2_EPS = 1e-6  # inside the square root of q and k's L2 norm, as HF and flash-linear-attention


@dataclass(frozen=True)
class LinearState:
    """One linear-attention layer's memory of one session, in f32."""

    conv: torch.Tensor  # [B, C, K-1]: the convolution's last K - 1 inputs (pre-activation q|k|v)
    recurrent: torch.Tensor  # [B, H_v, D_k, D_v]: S per value head


class GatedDeltaNet:
    """The projections, convolution, delta rule, gated norm and output projection of one layer.

    in_proj_qkv, in_proj_z, in_proj_b and in_proj_a are stored fused as one [C + V + 2 H_v, H]
    matrix (one GEMM per step instead of four).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        la = config.linear_attention
        self.key_heads, self.key_dim = la.key_heads, la.key_head_dim
        self.value_heads, self.value_dim = la.value_heads, la.value_head_dim
        self.channels = la.conv_channels  # C
        self.kernel = la.conv_kernel  # K
        self.eps = config.rms_norm_eps
        self.w_in = weights["w_in"]  # [C + V + 2 H_v, H], V = H_v * D_v
        self.conv = weights["conv"].float().view(self.channels, 1, self.kernel)  # [C, 1, K] f32
        # g = -exp(A_log) * softplus(a + dt_bias): both vectors [H_v] in f32, as HF computes g.
        self.neg_a = -weights["A_log"].float().exp()
        self.dt_bias = weights["dt_bias"].float()
        self.norm = weights["norm"].float()  # [D_v]: the gated norm's plain weight (no 1 + w)
        self.w_out = weights["w_out"]  # [H, V]

    @staticmethod
    def weight_groups() -> dict[str, list[str]]:
        return {
            "w_in": [f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")],
            "conv": [LINEAR_CONV],
            "A_log": ["linear_attn.A_log"],
            "dt_bias": ["linear_attn.dt_bias"],
            "norm": ["linear_attn.norm.weight"],
            "w_out": ["linear_attn.out_proj.weight"],
        }

    @staticmethod
    def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        la, H = config.linear_attention, config.hidden_size
        V = la.value_heads * la.value_head_dim
        return {
            "w_in": (la.conv_channels + V + 2 * la.value_heads, H),
            "conv": (la.conv_channels, 1, la.conv_kernel),
            "A_log": (la.value_heads,),
            "dt_bias": (la.value_heads,),
            "norm": (la.value_head_dim,),
            "w_out": (H, V),
        }

    def __call__(
        self, h: torch.Tensor, segments: Sequence[tuple[int, LinearState | None]]
    ) -> tuple[torch.Tensor, list[LinearState]]:
        """h: [1, N, H] (normed), the tokens of len(segments) requests one after another;
        segments[i] = (its token count, the state it continues, None: from zeros).
        Returns ([1, N, H], each request's state after its tokens).

        The input and output projections run once over all N tokens. Requests that each
        continue with one token (decode steps) run their convolution and recurrent step as one
        batch, each its own row; any other request runs its own. The given states are only
        read: the caller decides when the new ones replace them (a request that fails part-way
        must not leave a half-advanced state).
        """
        projected = linear(h, self.w_in)  # [1, N, C + V + 2 H_v]
        if len(segments) > 1 and all(T == 1 and state is not None for T, state in segments):
            # Row i of the batch is request i: [N, 1, P] against the states stacked along dim 0.
            stacked = LinearState(torch.cat([state.conv for _, state in segments]),
                                  torch.cat([state.recurrent for _, state in segments]))
            out, state = self._mix(projected.transpose(0, 1), stacked)  # out: [N, 1, V]
            # Cloned apart: a view would pin the whole batch's state for as long as any one session keeps its row.
            states = [LinearState(conv.clone(), recurrent.clone())
                      for conv, recurrent in zip(state.conv.split(1), state.recurrent.split(1), strict=True)]
            out = out.transpose(0, 1)  # [1, N, V]
        else:
            outs, states, first = [], [], 0
            for T, state in segments:
                out, state = self._mix(projected[:, first : first + T], state)
                outs.append(out)
                states.append(state)
                first += T
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [1, N, V]
        return linear(out.to(h.dtype), self.w_out), states

    def _mix(self, projected: torch.Tensor, state: LinearState | None) -> tuple[torch.Tensor, LinearState]:
        """projected: [B, T, C + V + 2 H_v], B requests of T tokens each continuing its row of
        `state` (None: zeros) -> (the gated, normed output [B, T, V] in f32, the state after)."""
        B, T, _ = projected.shape
        H_v, D_k, D_v = self.value_heads, self.key_dim, self.value_dim
        V = H_v * D_v
        mixed, z, b, a = projected.split_with_sizes([self.channels, V, H_v, H_v], dim=-1)

        # Causal depthwise convolution over [the last K-1 inputs | these T], in f32.
        conv_in = mixed.transpose(1, 2).float()  # [B, C, T]
        if state is None:
            past = conv_in.new_zeros(B, self.channels, self.kernel - 1)
        else:
            past = state.conv
        window = torch.cat((past, conv_in), dim=-1)  # [B, C, K-1+T]
        new_conv = window[:, :, T:].clone()  # the last K-1 inputs, not a view pinning the window
        mixed = F.silu(F.conv1d(window, self.conv, groups=self.channels))  # [B, C, T]

        q, k, v = mixed.transpose(1, 2).split_with_sizes([self.key_heads * D_k, self.key_heads * D_k, V], dim=-1)
        q = q.reshape(B, T, self.key_heads, D_k)
        k = k.reshape(B, T, self.key_heads, D_k)
        # Each key head serves value_heads // key_heads consecutive value heads.
        if self.key_heads != H_v:
            q = q.repeat_interleave(H_v // self.key_heads, dim=2)
            k = k.repeat_interleave(H_v // self.key_heads, dim=2)
        q = _l2_normalized(q) * D_k**-0.5  # [B, T, H_v, D_k]
        k = _l2_normalized(k)
        v = v.reshape(B, T, H_v, D_v)
        beta = torch.sigmoid(b.float())  # [B, T, H_v]
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)  # [B, T, H_v], log decay <= 0

        # [B, H_v, T, D] for the rule.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
        initial = None if state is None else state.recurrent
        if T == 1 and initial is not None:
            out, recurrent = recurrent_step(q, k, v, g, beta, initial)
        else:
            out, recurrent = chunked_delta_rule(q, k, v, g, beta, initial)

        # Gated RMSNorm per value head (plain weight), in f32.
        out = out.transpose(1, 2)  # [B, T, H_v, D_v] f32
        out = F.rms_norm(out, (D_v,), self.norm, self.eps) * F.silu(z.float().view(B, T, H_v, D_v))
        return out.reshape(B, T, V), LinearState(new_conv, recurrent)


def _l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def recurrent_step(q, k, v, g, beta, state):
    """One token: q, k: [B, H, 1, D_k], v: [B, H, 1, D_v], g, beta: [B, H, 1], state: [B, H, D_k, D_v].

    Returns (o: [B, H, 1, D_v], the new state). S is read once for both S^T k and S^T q (one
    batched matmul) and written once: with d = exp(g), the decayed state's reads are d * (S^T k)
    and q^T S' = d * (q^T S) + (q . k) delta, so S' itself need not be read again.
    """
    decay = g.exp()[..., None]  # [B, H, 1, 1]
    reads = torch.cat((k, q), dim=2) @ state  # [B, H, 2, D_v]: k^T S and q^T S
    k_read, q_read = reads[:, :, :1] * decay, reads[:, :, 1:] * decay
    delta = (v - k_read) * beta[..., None]  # [B, H, 1, D_v]
    new_state = (state * decay).addcmul_(k.transpose(-1, -2), delta)  # d S + k delta^T (rank one)
    out = q_read + (q * k).sum(-1, keepdim=True) * delta
    return out, new_state


def chunked_delta_rule(q, k, v, g, beta, state):
    """T tokens: q, k: [B, H, T, D_k], v: [B, H, T, D_v], g, beta: [B, H, T]; state None (zeros)
    or [B, H, D_k, D_v]. Returns (o: [B, H, T, D_v], the state after the T tokens), f32.

    Within a chunk with cumulative log decay c_t = g_1 + ... + g_t, the delta rule's writes
    u_t (the corrections beta_t (v_t - S_{t-1}^T k_t)) satisfy a unit lower-triangular system
    (I + A) u = beta * v - (beta * exp(c) * k) S_0, with A[i, j] = beta_i exp(c_i - c_j) k_i . k_j
    for j < i; one triangular solve gives both parts. Then
        o_t  = exp(c_t) q_t^T S_0 + sum_{j <= t} exp(c_t - c_j) (q_t . k_j) u_j
        S_C  = exp(c_C) S_0 + sum_j exp(c_C - c_j) k_j u_j^T.
    """
    B, H, T, D_k = k.shape
    D_v = v.shape[-1]
    pad = -T % CHUNK  # zero keys, values and log decays past the end: they change nothing
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // CHUNK
    q, k, v = (t.reshape(B, H, n, CHUNK, t.shape[-1]) for t in (q, k, v))
    c = g.reshape(B, H, n, CHUNK).cumsum(-1)  # [B, H, n, L]
    beta = beta.reshape(B, H, n, CHUNK, 1)

    # decay[i, j] = exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, n, L, L]
    k_beta = k * beta
    # I + A, A the strict lower part. It is inverted (a triangular solve against the identity,
    # L right-hand sides) and the inverse applied to both right-hand sides at once (u's part
    # from the values, and the weights of S_0 in it): on CPU that is ~4x faster than solving
    # for the D_v + D_k columns directly, whose batched solve dominated the whole prefill.
    eye = torch.eye(CHUNK, dtype=k.dtype, device=k.device)
    on_or_above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).triu()
    system = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(on_or_above, 0) + eye
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False)
    rhs = torch.cat((v * beta, k_beta * c.exp()[..., None]), dim=-1)  # [B, H, n, L, D_v + D_k]
    solved = inverse @ rhs
    u_values, u_state = solved.split_with_sizes([D_v, D_k], dim=-1)
    attend = q @ k.transpose(-1, -2) * decay  # [B, H, n, L, L], zero above the diagonal
    q_decayed = q * c.exp()[..., None]  # reads of S_0
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]  # each key's write, decayed to the chunk's end
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]

    S = k.new_zeros(B, H, D_k, D_v) if state is None else state
    out = torch.empty(B, H, n, CHUNK, D_v, dtype=k.dtype, device=k.device)
    for i in range(n):
        u = u_values[:, :, i] - u_state[:, :, i] @ S  # [B, H, L, D_v]
        out[:, :, i] = q_decayed[:, :, i] @ S + attend[:, :, i] @ u
        S = S * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(B, H, n * CHUNK, D_v)[:, :, :T], S
