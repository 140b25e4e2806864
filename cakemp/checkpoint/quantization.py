"""How a checkpoint's weights are quantized, read from its config.json: the one table of stored
weight forms (METHODS, a row each) and `parse`, which picks the row. No torch: the front refuses a
form here, before any device starts.

Each form is a module of its own, torch-free (checkpoint/fp8.py, gptq.py, mlx.py: its frozen
config, whose `parts` names the stored tensors of a weight as a `Parts`, checkpoint/stored.py: their
names, the shape rule of the matrix they make, and `kept_form`, which kept kernel takes it and so
its resident bytes, checkpoint/resident.py), and its torch side (model/weights/fp8.py, gptq.py,
mlx.py: how it dequantizes, and its kept parts), which its row names by path. So the readers and
the sizing never ask which form a weight is, and a new form is one file and one row
(tests/model/test_new_form.py shows one).

| form       | config.json                                            | a weight `P.weight` is stored as          |
|------------|--------------------------------------------------------|-------------------------------------------|
| FP8        | quantization_config: quant_method "fp8", weight_block_size | P.weight (e4m3), P.weight_scale_inv   |
| GPTQ       | quantization_config: quant_method "gptq", bits, group_size, desc_act, sym, checkpoint_format | P.qweight, P.qzeros, P.scales (P.g_idx) |
| MLX affine | quantization (mlx-lm copies it to quantization_config): bits, group_size, mode, per-module overrides | P.weight (u32), P.scales, P.biases |

In a quantized checkpoint only some weights are quantized (FP8 releases keep norms in 16 bits,
GPTQ releases attention, routers or shared experts; mlx-lm skips matrices whose width its group
size does not divide): a weight is read quantized exactly when its quantized parts are stored.

Anything else is refused by name (a CheckpointError, exit 78), never loaded as if plain: AWQ,
bitsandbytes, compressed-tensors and the rest, and what each form's module refuses.
"""
from __future__ import annotations

from typing import Any

from cakemp.checkpoint import fp8, gptq, mlx
from cakemp.checkpoint.fp8 import Fp8, Fp8Parts
from cakemp.checkpoint.gptq import GPTQ_BITS, Gptq, GptqParts
from cakemp.checkpoint.mlx import MLX_BITS, MLX_GROUP_SIZES, MlxAffine, MlxParts, norms_carry_one
from cakemp.checkpoint.stored import Method, Parts, Quantization, Shape, named_by
from cakemp.checkpoint.values import mapping, shown

__all__ = ["GPTQ_BITS", "METHODS", "MLX_BITS", "MLX_GROUP_SIZES", "Fp8", "Fp8Parts", "Gptq", "GptqParts", "Method",
           "MlxAffine", "MlxParts", "Parts", "Quantization", "Shape", "named_by", "norms_carry_one", "parse"]

# One row per stored form, each declared in its module, tried in order (MLX first: its own key wins
# over the quantization_config it copies).
METHODS: tuple[Method, ...] = (mlx.METHOD, fp8.METHOD, gptq.METHOD)


def parse(d: dict[str, Any]) -> Quantization | None:
    """The quantization a (text model's) config.json declares, or None: the first METHODS row whose
    settings it holds; ValueError naming what is refused."""
    for method in METHODS:
        settings = method.settings(d)
        if settings is not None:
            return method.parse(settings)
    quant = mapping("quantization_config", d.get("quantization_config") or None)
    if not quant:
        return None
    raise ValueError(f"quantization {shown(quant.get('quant_method'))} is not supported "
                     f"(only {', '.join(method.name for method in METHODS)})")
