"""Tiny GPTQ and MLX-affine checkpoints, each beside its reference: the same checkpoint in HF's
plain layout holding the oracle's dequantization of every quantized weight.

    path, reference = mlx_checkpoint(tmp_path, "qwen3_5_moe", bits=4, group_size=32)
    HFLayers(reference, [1, 2, 3], torch.float32)     # what a node serving `path` must compute

Both start from tests/support/checkpoints.py's random checkpoints. The quantized tensors are written by
the formats' own implementations, never by this project's formula: mx.quantize for MLX (the
reference is mx.dequantize), GPTQModel's packing for GPTQ (the reference its dequantize_weight,
tests/support/gptq_oracle.py). Oracles that are not installed skip the tests that need them.

MLX checkpoints are laid out as mlx-lm converts a model: every matrix whose width the group
size divides is quantized (routers and Qwen3.5's shared-expert gate at 8 bits with group 64,
as mlx-lm's Qwen3.5 predicate writes them into config.json), the rest and the norms stored in
bf16; for Qwen3.5, tensors under "language_model.model.", the experts stacked under
`mlp.switch_mlp`, the (1 + w) norms stored with their 1 added, the convolution as [C, K, 1],
no multi-token-prediction head and no vision tower. GPTQ checkpoints keep everything GPTQ does
not quantize in f16; `quantized` picks the matrices that are (Qwen's MoE releases quantize the
experts and keep attention and the router in 16 bits).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import make_checkpoint, write_tensors

HAVE_MLX = importlib.util.find_spec("mlx") is not None
HAVE_GPTQMODEL = importlib.util.find_spec("gptqmodel") is not None
needs_mlx = pytest.mark.skipif(not HAVE_MLX, reason="mlx (the MLX affine oracle) is not installed")
needs_gptqmodel = pytest.mark.skipif(not HAVE_GPTQMODEL, reason="gptqmodel (the GPTQ oracle) is not installed")

ORACLE = Path(__file__).with_name("gptq_oracle.py")
# mlx-lm's Qwen3.5 quant predicate: these modules at 8 bits, group 64, whatever the rest.
MLX_EIGHT_BIT = ("mlp.gate", "shared_expert_gate")
# Norms mlx-lm's Qwen3.5 conversion stores as 1 + w.
MLX_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                     ".q_norm.weight", ".k_norm.weight")


def layer_matrix(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's projection or expert matrix (what GPTQ quantizes by default)."""
    return ".layers." in name and name.endswith(".weight") and tensor.dim() == 2 and "norm" not in name \
        and not name.endswith("mlp.gate.weight") and "shared_expert_gate" not in name


def experts_only(name: str, tensor: torch.Tensor) -> bool:
    """Qwen's GPTQ MoE releases: only the routed experts are quantized."""
    return layer_matrix(name, tensor) and ".mlp.experts." in name


@dataclass(frozen=True)
class GptqSpec:
    """One GPTQ checkpoint: its family, the quantization config and which matrices are quantized."""

    family: str
    bits: int = 4
    group_size: int = 32
    desc_act: bool = False
    sym: bool = True
    v1: bool = True
    experts_only: bool = False
    overrides: tuple[tuple[str, object], ...] = ()  # config overrides for make_checkpoint

    def config(self) -> dict:
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": "gptq" if self.v1 else "gptq_v2", "damp_percent": 0.01}


def gptq_checkpoints(tmp_path: Path, specs: dict[str, GptqSpec]) -> dict[str, tuple[Path, Path]]:
    """name -> (GPTQ checkpoint, reference) for each spec, packed by one run of the GPTQModel oracle."""
    jobs, plans = [], {}
    for name, spec in specs.items():
        plain = make_checkpoint(tmp_path / name / "plain", spec.family, **dict(spec.overrides))
        tensors = load_file(plain / "model.safetensors")
        pick = experts_only if spec.experts_only else layer_matrix
        chosen = {n: t for n, t in tensors.items() if pick(n, t)}
        work = tmp_path / name / "oracle"
        work.mkdir(parents=True)
        save_file(chosen, work / "weights.safetensors")
        jobs.append({"weights": str(work / "weights.safetensors"), "packed": str(work / "packed.safetensors"),
                     "dequantized": str(work / "dequantized.safetensors"), "seed": len(jobs),
                     **{k: v for k, v in asdict(spec).items() if k in ("bits", "group_size", "desc_act", "sym", "v1")}})
        plans[name] = (plain, tensors, work)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    result = subprocess.run([sys.executable, str(ORACLE), str(tmp_path / "jobs.json")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = {}
    for name, (plain, tensors, work) in plans.items():
        packed, dequantized = load_file(work / "packed.safetensors"), load_file(work / "dequantized.safetensors")
        # Unquantized tensors in f16, as GPTQ checkpoints keep them; the reference holds the same values.
        kept = {n: t.half() for n, t in tensors.items() if n not in dequantized}
        quantized_config = {"quantization_config": specs[name].config()}
        out[name] = (_write_like(plain, tmp_path / name / "gptq", kept | packed, quantized_config),
                     _write_like(plain, tmp_path / name / "reference", {n: t.float() for n, t in kept.items()} | dequantized))
    return out


def gptq_part_shapes(out_features: int, in_features: int, bits: int, group_size: int,
                     desc_act: bool) -> dict[str, tuple[int, ...]]:
    """The stored parts of a GPTQ [out, in] matrix and their shapes, as GPTQ's packers lay them out
    (AutoGPTQ's and GPTQModel's QuantLinear buffers): suffix -> shape."""
    groups = -(-in_features // (in_features if group_size == -1 else group_size))
    shapes = {"qweight": (-(-in_features * bits // 32), out_features),
              "qzeros": (groups, -(-out_features * bits // 32)), "scales": (groups, out_features)}
    return shapes | ({"g_idx": (in_features,)} if desc_act else {})


def gptq_shaped(tmp_path: Path, family: str, spec: GptqSpec, shapes: dict[str, tuple[int, int]] | None = None) -> Path:
    """A GPTQ checkpoint of `family` whose quantized parts have GPTQ's shapes and zeros for codes (for
    what a checkpoint's shapes decide: sizes, refusals; no oracle needed). `shapes`: modules whose
    matrix is claimed to be another [out, in] than the plain checkpoint's."""
    plain = make_checkpoint(tmp_path / "plain", family, **dict(spec.overrides))
    tensors = load_file(plain / "model.safetensors")
    stored = {}
    for name, tensor in tensors.items():
        if not layer_matrix(name, tensor):
            stored[name] = tensor.half()
            continue
        module = name.removesuffix(".weight")
        out_features, in_features = (shapes or {}).get(module, tuple(tensor.shape))
        for part, shape in gptq_part_shapes(out_features, in_features, spec.bits, spec.group_size,
                                            spec.desc_act).items():
            stored[f"{module}.{part}"] = (torch.ones(shape, dtype=torch.float16) if part == "scales"
                                          else torch.zeros(shape, dtype=torch.int32))
    return _write_like(plain, tmp_path / "gptq", stored, {"quantization_config": spec.config()})


def mlx_checkpoint(tmp_path: Path, family: str, *, bits: int = 4, group_size: int = 64, shards: int = 1,
                   **overrides) -> tuple[Path, Path]:
    """(an mlx-lm-style MLX affine checkpoint of `family`, its reference)."""
    import mlx.core as mx

    plain = make_checkpoint(tmp_path / "plain", family, **overrides)
    tensors = {n: t.bfloat16() for n, t in load_file(plain / "model.safetensors").items()}
    # The reference starts as the plain checkpoint, rounded to bf16 as the MLX one stores it.
    stored, reference = {}, {n: t.float() for n, t in tensors.items()}
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine"}
    qwen3_5 = family in ("qwen3_5", "qwen3_5_moe")
    for mlx_name, (tensor, back) in _mlx_lm_layout(tensors, qwen3_5).items():
        module = mlx_name.removesuffix(".weight")
        params = (8, 64) if qwen3_5 and module.endswith(MLX_EIGHT_BIT) else (bits, group_size)
        if not _mlx_quantizable(mlx_name, tensor, params[1]):
            stored[mlx_name] = tensor
            reference |= back(tensor.float())
            continue
        if params != (bits, group_size):
            quantization[module] = {"group_size": params[1], "bits": params[0]}
        q, scales, biases = mx.quantize(mx.array(tensor.float().numpy()).astype(mx.bfloat16), group_size=params[1],
                                        bits=params[0])
        stored[mlx_name] = torch.from_numpy(_numpy(q))
        stored[module + ".scales"], stored[module + ".biases"] = (torch.from_numpy(_numpy(t.astype(mx.float32))).bfloat16()
                                                                  for t in (scales, biases))
        exact = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=params[1], bits=params[0])
        reference |= back(torch.from_numpy(_numpy(exact)))
    mlx_config = {"quantization": quantization, "quantization_config": quantization}
    return (_write_like(plain, tmp_path / "mlx", stored, mlx_config, shards),
            _write_like(plain, tmp_path / "reference", _join_gate_up(reference)))


def _mlx_quantizable(name: str, tensor: torch.Tensor, group_size: int) -> bool:
    """What mlx-lm's nn.quantize turns quantized: Linear, Embedding and SwitchLinear weights whose
    width the group size divides (never norms or the convolution)."""
    return name.endswith(".weight") and tensor.dim() in (2, 3) and "norm" not in name and "conv1d" not in name \
        and tensor.shape[-1] % group_size == 0


Back = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def _mlx_lm_layout(tensors: dict[str, torch.Tensor], qwen3_5: bool) -> dict[str, tuple[torch.Tensor, Back]]:
    """mlx name -> (the tensor as mlx-lm's sanitize stores it, the map from its (dequantized) value
    back to the HF tensors it came from). Per-expert matrices (Qwen3-MoE hub files) are stacked
    under switch_mlp; for Qwen3.5: no mtp or vision tensors, "model.language_model" ->
    "language_model.model", fused experts split into switch_mlp gate/up/down (gate and up come
    back marked "#gate"/"#up", joined by _join_gate_up), norms + 1, conv1d [C, 1, K] -> [C, K, 1]."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        if qwen3_5 and name.startswith(("mtp.", "model.visual.")):
            continue
        layer, marker, tail = name.partition(".mlp.experts.")
        if marker and tail[0].isdigit():  # "{j}.gate_proj.weight"
            index, _, projection = tail.partition(".")
            experts.setdefault(f"{layer}.mlp.switch_mlp.{projection}", {})[int(index)] = tensor
            continue
        mlx_name = name.replace("model.language_model.", "language_model.model.") if qwen3_5 else name
        if qwen3_5 and name == "lm_head.weight":
            mlx_name = "language_model.lm_head.weight"
        if tail == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)  # [E, I, H] each
            base = mlx_name.removesuffix("experts.gate_up_proj") + "switch_mlp."
            out[base + "gate_proj.weight"] = (gate, lambda t, n=name: {n + "#gate": t})
            out[base + "up_proj.weight"] = (up, lambda t, n=name: {n + "#up": t})
        elif tail == "down_proj":
            out[mlx_name.removesuffix("experts.down_proj") + "switch_mlp.down_proj.weight"] = (tensor, lambda t, n=name: {n: t})
        elif qwen3_5 and name.endswith(MLX_SHIFTED_NORMS) and tensor.dim() == 1:
            # The reference is the stored 1 + w less 1: exact, for 1 + w in [0.5, 2].
            out[mlx_name] = ((tensor.float() + 1).bfloat16(), lambda t, n=name: {n: t - 1})
        elif qwen3_5 and name.endswith("conv1d.weight"):
            out[mlx_name] = (tensor.transpose(1, 2).contiguous(), lambda t, n=name: {n: t.transpose(1, 2).contiguous()})
        else:
            out[mlx_name] = (tensor, lambda t, n=name: {n: t})
    for stacked, by_expert in experts.items():
        layer, _, projection = stacked.partition(".mlp.switch_mlp.")
        out[stacked] = (torch.stack([by_expert[j] for j in range(len(by_expert))]),
                        lambda t, layer=layer, p=projection: {f"{layer}.mlp.experts.{j}.{p}": t[j] for j in range(len(t))})
    return out


def _join_gate_up(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The split gate and up halves (marked "#gate", "#up") joined back into HF's gate_up_proj."""
    out = {n: t for n, t in reference.items() if "#" not in n}
    for name in {n.partition("#")[0] for n in reference if "#" in n}:
        out[name] = torch.cat([reference[name + "#gate"], reference[name + "#up"]], dim=1)
    return out


def _numpy(array):
    import numpy as np

    return np.array(array)


def _write_like(plain: Path, path: Path, tensors: dict[str, torch.Tensor], config_keys: dict | None = None,
                shards: int = 1) -> Path:
    """A checkpoint directory at `path`: `plain`'s config.json (plus `config_keys`) and `tensors`."""
    path.mkdir(parents=True)
    config = json.loads((plain / "config.json").read_text()) | (config_keys or {})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (plain / extra).exists():
            shutil.copy(plain / extra, path / extra)
    layers = text_config_layers(config)
    write_tensors(path, tensors, layers, shards)
    return path


def text_config_layers(config: dict) -> int:
    return (config.get("text_config") or config)["num_hidden_layers"]

