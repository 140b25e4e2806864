"""The compute dtypes a node can run its layers in, by their `--dtype` names, with the wire tag of
each: the floating types a hidden state can have on Cake's wire (docs/protocol.md, Tensors and dtypes). Torch-free, for
the CLI, the front and the compute layer alike."""

from __future__ import annotations

from cakemp.wire import DType

COMPUTE_DTYPES = {"f16": DType.F16, "bf16": DType.BF16, "f32": DType.F32}
