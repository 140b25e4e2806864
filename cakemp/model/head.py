"""The two ends of a model that a Cake master keeps: token embeddings, and final norm + lm_head.

Cake never shards these (docs/models.md, What the master keeps): the master embeds the tokens, sends the hidden
states through the decoder layers, normalises the last position and projects it onto the
vocabulary. A tied checkpoint reuses the embedding matrix as lm_head. Gemma 3 scales the
embeddings by sqrt(H) (rounded to the dtype, as transformers does); Gemma 3 and Qwen3.5 store
their final norm as (1 + w). Quantized embeddings and lm_head (GPTQ, MLX) are dequantized as
the layers' weights are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from cakemp.checkpoint.config import FAMILIES, ModelConfig
from cakemp.model.block import rms_norm
from cakemp.model.weights.readers import open_checkpoint
from cakemp.model.weights.source import WeightSource

LM_HEAD = "lm_head.weight"


class Head:
    """Embeddings [V, H], final norm weight [H] and lm_head [V, H], on one device in one dtype."""

    def __init__(
        self, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float, embed_scale: float = 1.0
    ):
        self.embed_weight = embed
        self.norm_weight = norm
        self.lm_head_weight = lm_head
        self.eps = eps
        self.embed_scale = embed_scale

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @classmethod
    def load(
        cls, model_dir: str | Path, config: ModelConfig, device: torch.device | str, dtype: torch.dtype
    ) -> Head:
        """Read the three tensors (two when tied) from the checkpoint at `model_dir`, cast to `dtype`."""
        return cls.from_checkpoint(open_checkpoint(model_dir, config), device, dtype)

    @classmethod
    def from_checkpoint(cls, checkpoint: WeightSource, device: torch.device | str, dtype: torch.dtype) -> Head:
        """Read the three tensors (two when tied) from an open checkpoint, cast to `dtype`.

        They sit beside the decoder layers (`model.` or Qwen3.5's `model.language_model.`); a
        (1 + w) family's final norm gets its 1 added as its layers' norms do.
        """
        config = checkpoint.config
        tied = config.tie_word_embeddings
        model = config.layer_prefix.rpartition(".")[0]  # "model.layers" -> "model"
        embed, norm = f"{model}.embed_tokens.weight", f"{model}.norm.weight"
        # mlx-lm's Qwen3.5 conversions keep lm_head beside their "language_model.model".
        outer = model.rpartition(".")[0]
        head = f"{outer}.{LM_HEAD}" if outer and checkpoint.has(f"{outer}.{LM_HEAD}") else LM_HEAD
        names = [embed, norm] if tied else [embed, norm, head]
        plus_one = frozenset({norm}) if checkpoint.norms_need_one else frozenset()
        tensors = checkpoint.load({name: [name] for name in names}, torch.device(device), dtype, plus_one=plus_one)
        lm_head = tensors[embed] if tied else tensors[head]
        scaled = FAMILIES[config.family].embed_scale
        return cls(tensors[embed], tensors[norm], lm_head, config.rms_norm_eps, config.hidden_size**0.5 if scaled else 1.0)

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Token ids [T] -> hidden states [1, T, H]."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        embedded = F.embedding(ids, self.embed_weight)
        if self.embed_scale != 1.0:
            embedded = embedded * torch.tensor(self.embed_scale, dtype=self.dtype)
        return embedded

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, T, H] -> logits [V] of the last position (the norm is per position,
        so normalising only the last one gives the same values for less work)."""
        return self.project(x[0, -1])

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Last positions [..., H] (one, or one per request of a batched step) -> logits [..., V]."""
        return F.linear(rms_norm(rows, self.norm_weight, self.eps), self.lm_head_weight)
