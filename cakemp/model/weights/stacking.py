"""One weight made of several stored tensors stacked along dim 0 (q/k/v, gate/up, experts), as
both checkpoint readers (model/weights/safetensors.py, model/weights/gguf.py) build it in Reader.load (source.py)."""

from __future__ import annotations

import torch

from cakemp.errors import CheckpointError


def stack_rows(members: list[str], sources: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
               plus_one: bool = False) -> torch.Tensor:
    """`sources` (the tensors named `members`, on any device, in any dtype) concatenated along dim 0
    into one `dtype` tensor on `device`, allocated once and filled by one copy_ each, which casts on
    the way. `plus_one`: a (1 + w) norm stored as w, made 1 + w here in f32 and kept f32."""
    if len({t.shape[1:] for t in sources}) > 1:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(members, sources))
        raise CheckpointError(f"tensors that should stack along dim 0 do not: {shapes}")
    shape = (sum(t.shape[0] for t in sources), *sources[0].shape[1:])
    out = torch.empty(shape, dtype=torch.float32 if plus_one else dtype, device=device)
    row = 0
    for t in sources:
        if plus_one:
            t = t.to(device=device, dtype=torch.float32) + 1
        if t.device != device and t.dtype != dtype:
            t = t.to(device)  # cast on the accelerator, not in torch's slow CPU cast
        out[row : row + t.shape[0]].copy_(t)
        row += t.shape[0]
    return out
