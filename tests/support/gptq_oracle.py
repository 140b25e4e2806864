"""GPTQModel as the GPTQ oracle, run as its own process: `python tests/support/gptq_oracle.py jobs.json`.

GPTQModel patches transformers and safetensors when imported, so the tests never import it
into their own process: tests/support/quantized.py writes the float weights and a job list, this
script packs them with GPTQModel's TorchLinear (`pack_original`, the packing its quantizer
saves with), converts the zero points to checkpoint_format v1 with GPTQModel's own
v2-to-v1 conversion where asked, and dequantizes with TorchLinear's `dequantize_weight` (the
scales widened to f32 first, so the reference is the exact product, not rounded to f16).

Each job: {"weights": in.safetensors (name "P.weight" -> f32 [out, in]), "packed":
out.safetensors (P.qweight, P.qzeros, P.scales, P.g_idx), "dequantized": ref.safetensors (P.weight
f32), "bits", "group_size", "desc_act", "sym", "v1", "seed"}.

The scales and zero points are the test's choice (round-to-nearest over each group's min and
max; symmetric: zero point 2^(bits-1)); with asymmetric groups some zero points are forced to
0 and to 2^bits - 1, the values v1's stored-minus-1 makes awkward.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file


def main(jobs_file: str) -> None:
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

    for job in json.loads(open(jobs_file).read()):
        generator = torch.Generator().manual_seed(job["seed"])
        packed, dequantized = {}, {}
        for name, weight in load_file(job["weights"]).items():
            module = name.removesuffix(".weight")
            out_features, in_features = weight.shape
            bits, size = job["bits"], job["group_size"]
            g_idx = groups(in_features, size, job["desc_act"], generator)
            scales, zeros = scales_and_zeros(weight, g_idx, bits, job["sym"], generator)
            layer = TorchLinear(bits=bits, group_size=size, sym=job["sym"], desc_act=job["desc_act"],
                                in_features=in_features, out_features=out_features, bias=False,
                                pack_dtype=torch.int32)
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = weight.clone()
            layer.pack_original(linear, scales.t(), zeros.t(), g_idx)  # [out, groups] each
            v2_zeros = layer.qzeros.clone()
            scales_f16 = layer.scales.clone()
            layer.scales = layer.scales.float()
            dequantized[name] = layer.dequantize_weight().t().contiguous().float()  # [out, in]
            if job["v1"]:
                convert_gptq_v2_to_v1_format_module(layer, SimpleNamespace(bits=bits, pack_dtype=torch.int32))
                stored = layer.qzeros.clone()
                convert_gptq_v1_to_v2_format_module(layer, bits, torch.int32)  # GPTQModel reads v1 back
                assert torch.equal(layer.qzeros, v2_zeros), f"{name}: GPTQModel's v1 round trip changed qzeros"
                layer.qzeros = stored
            packed |= {f"{module}.qweight": layer.qweight, f"{module}.qzeros": layer.qzeros,
                       f"{module}.scales": scales_f16, f"{module}.g_idx": layer.g_idx.to(torch.int32)}
        save_file({k: v.contiguous() for k, v in packed.items()}, job["packed"])
        save_file(dequantized, job["dequantized"])


def groups(in_features: int, group_size: int, desc_act: bool, generator: torch.Generator) -> torch.Tensor:
    """Each input's group: in order, or (act-order) in a random order of the inputs."""
    size = in_features if group_size == -1 else group_size
    order = torch.randperm(in_features, generator=generator) if desc_act else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).to(torch.int32)
    return g_idx


def scales_and_zeros(weight: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[groups, out] scales (f16 values) and integer zero points of each group's inputs."""
    maxq = 2**bits - 1
    count = int(g_idx.max()) + 1
    low = torch.stack([weight[:, g_idx == g].amin(dim=1) for g in range(count)])  # [groups, out]
    high = torch.stack([weight[:, g_idx == g].amax(dim=1) for g in range(count)])
    if sym:
        scales = torch.maximum(low.abs(), high.abs()) * 2 / maxq
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        scales = (high - low) / maxq
        zeros = torch.round(-low / scales).clamp(0, maxq)
        extremes = torch.rand(zeros.shape, generator=generator)
        zeros[extremes < 0.1] = 0
        zeros[extremes > 0.9] = maxq
    return scales.half().float(), zeros


if __name__ == "__main__":
    main(sys.argv[1])
