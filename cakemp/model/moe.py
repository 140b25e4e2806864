"""A sparse MoE feed-forward (Qwen3-MoE, Qwen3.5-MoE): a router picks top_k experts per token.

    probs = softmax(router(h))                   # in f32
    w, e  = top_k(probs)                         # renormalised to sum 1 when configured
    out   = sum_k w_k * expert_{e_k}(h)          # each expert a GatedMlp
          (+ sigmoid(shared_gate(h)) * shared_expert(h), Qwen3.5-MoE)

Tokens are grouped by expert: the (token, slot) pairs are sorted by expert once, and each
expert that was picked runs one GEMM pair over all its tokens; the Python loop is over the
experts hit, never over tokens. A decode step therefore reads only its top_k experts' weights.

Experts are held stacked ([E, 2I, H] and [E, H, I]); checkpoints store them either that way
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`: transformers 5 and the official
Qwen3.5-MoE files), stacked with gate and up apart (`mlp.switch_mlp.{gate,up,down}_proj.weight`,
[E, I, H] and [E, H, I]: mlx-lm's conversions, joined here at load) or one set per expert
(`mlp.experts.{j}.{gate,up,down}_proj.weight`: the Qwen3-MoE hub files), which loading stacks.

The experts are an ExpertStore (model/weights/experts.py): resident, as loaded, or offloaded
(`--expert-offload`: the weights hold "experts", a store reading each expert on demand, from
`expert_reads`, which says where expert j lies in each of these layouts). The store is asked for
a step's experts right after the router, before the shared expert, so that reading the offloaded
ones overlaps it; the held ones may come first, each expert's rows are its own either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cakemp.checkpoint.config import ModelConfig
from cakemp.model.linear import linear
from cakemp.model.mlp import GatedMlp
from cakemp.model.weights.experts import ExpertRead, ExpertStore, ResidentExperts

FUSED_GATE_UP = "mlp.experts.gate_up_proj"
FUSED_DOWN = "mlp.experts.down_proj"
SWITCH = "mlp.switch_mlp.{}_proj.weight"  # mlx-lm's stacked experts: gate, up, down
# Weights viewed as [E, rows, cols]: loaded as plain tensors even where other FP8 matrices stay FP8.
STACKED = frozenset({"experts_gate_up", "experts_gate", "experts_up", "experts_down"})


class SparseMoe:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        moe = config.moe
        E, I, H = moe.experts, moe.intermediate_size, config.hidden_size
        self.top_k = moe.top_k
        self.activation = config.activation
        self.renormalize = moe.renormalize
        self.router = weights["router"]  # [E, H]
        self.experts: ExpertStore
        if "experts" in weights:  # offloaded: read on demand
            self.experts = weights["experts"]
        elif "experts_gate" in weights:  # mlx-lm's layout: gate and up stacked apart, [E, I, H] each
            self.experts = ResidentExperts(torch.cat([weights["experts_gate"], weights["experts_up"]], dim=1),
                                           weights["experts_down"].view(E, H, I))
        else:
            self.experts = ResidentExperts(weights["experts_gate_up"].view(E, 2 * I, H),
                                           weights["experts_down"].view(E, H, I))
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = GatedMlp(weights["shared_gate_up"], weights["shared_down"], self.activation)
            self.shared_gate = weights["shared_gate"]  # [1, H]

    @staticmethod
    def weight_groups(config: ModelConfig, stored: Callable[[str], bool]) -> dict[str, list[str]]:
        """`stored(name)`: whether the layer's checkpoint holds `name` (relative to the layer)."""
        E = config.moe.experts
        if stored(FUSED_GATE_UP):
            groups = {"experts_gate_up": [FUSED_GATE_UP], "experts_down": [FUSED_DOWN]}
        elif stored(SWITCH.format("gate")):
            groups = {f"experts_{p}": [SWITCH.format(p)] for p in ("gate", "up", "down")}
        else:
            groups = {
                "experts_gate_up": [f"mlp.experts.{j}.{p}_proj.weight" for j in range(E) for p in ("gate", "up")],
                "experts_down": [f"mlp.experts.{j}.down_proj.weight" for j in range(E)],
            }
        groups["router"] = ["mlp.gate.weight"]
        if config.moe.shared_intermediate_size:
            groups["shared_gate_up"] = ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"]
            groups["shared_down"] = ["mlp.shared_expert.down_proj.weight"]
            groups["shared_gate"] = ["mlp.shared_expert_gate.weight"]
        return groups

    @staticmethod
    def expert_reads(config: ModelConfig, stored: Callable[[str], bool]) -> ExpertRead:
        """Where expert j lies, for reading it alone: its gate/up and down names (relative to the
        layer) and, where they are stacked [E, ...], the matrix j of each (else None)."""
        if stored(FUSED_GATE_UP):
            return lambda j: ({"gate_up": [FUSED_GATE_UP], "down": [FUSED_DOWN]}, j)
        if stored(SWITCH.format("gate")):
            return lambda j: ({"gate_up": [SWITCH.format("gate"), SWITCH.format("up")], "down": [SWITCH.format("down")]}, j)
        return lambda j: ({"gate_up": [f"mlp.experts.{j}.gate_proj.weight", f"mlp.experts.{j}.up_proj.weight"],
                           "down": [f"mlp.experts.{j}.down_proj.weight"]}, None)

    @staticmethod
    def weight_shapes(config: ModelConfig, stored: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
        moe, H = config.moe, config.hidden_size
        E, I, S = moe.experts, moe.intermediate_size, moe.shared_intermediate_size
        stacked = stored(FUSED_GATE_UP) or stored(SWITCH.format("gate"))
        return {
            "experts_gate_up": (E, 2 * I, H) if stacked else (E * 2 * I, H),
            "experts_gate": (E, I, H),
            "experts_up": (E, I, H),
            "experts_down": (E, H, I) if stacked else (E * H, I),
            "router": (E, H),
            "shared_gate_up": (2 * S, H),
            "shared_down": (H, S),
            "shared_gate": (1, H),
        }

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [B, T, H] -> [B, T, H]."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])  # [N, H]
        probs = F.softmax(linear(x, self.router), dim=-1, dtype=torch.float32)  # [N, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        # Group the N * k (token, slot) pairs by expert: after a stable sort, expert e's pairs
        # are one contiguous run of `counts[e]`.
        flat = experts.reshape(-1)  # [N k]
        order = flat.argsort(stable=True)
        tokens = order // self.top_k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.experts.count).tolist()
        starts = [0, *itertools.accumulate(counts)]
        routed = x[tokens]  # [N k, H]
        # The router has chosen: offloaded experts not held start their reads (a GPU's copies) now,
        # to overlap the shared expert and the held experts' products computed meanwhile.
        fetched = self.experts.fetch([expert for expert, count in enumerate(counts) if count])
        shared = None
        if self.shared is not None:
            shared = torch.sigmoid(linear(x, self.shared_gate)) * self.shared(x)  # [N, H]
        outputs = {expert: GatedMlp(*pair, self.activation)(routed[starts[expert]:starts[expert + 1]])
                   for expert, pair in fetched}
        mixed = torch.cat([outputs[expert] for expert in sorted(outputs)]) * weights.reshape(-1)[order, None]  # [N k, H]
        out = torch.zeros_like(x).index_add_(0, tokens, mixed)
        if shared is not None:
            out = out + shared
        return out.view(shape)
