"""Quantized matrices kept quantized for a kernel (int4.py, int8.py, fp8.py): what every kept form
answers, so that the readers (source.py) and the loaders never ask which form a weight takes.

A form's shape (`Int4Shape`, `Int8Shape`, `Fp8Shape`: known from a checkpoint's headers) names its
`kernel`, its `nbytes` and its input `order` (act-order's gather, or None), and says why matrices
cannot be fused into one weight (`fuse_reason`); its parts (`Int4Parts`, `Int8Parts`, `Fp8Codes`)
stack along the outputs (`cat`) and become the weight that multiplies (`kept`), whose `matmul`
model/linear.py calls.

| kept form | kernel                                               | devices                      |
|-----------|------------------------------------------------------|------------------------------|
| int4      | torch's int4 weight-only matmul (tinygemm)           | CPU; CUDA computing in bf16  |
| int8      | torch's int8 weight-only matmul                      | CPU                          |
| fp8       | cuBLAS's block-scaled scaled_mm, else a Triton kernel | CUDA where either works      |
"""

from __future__ import annotations

from cakemp import log
from cakemp.model.weights import fp8, int4, int8

KeptShape = int4.Int4Shape | int8.Int8Shape | fp8.Fp8Shape
KeptParts = int4.Int4Parts | int8.Int8Parts | fp8.Fp8Codes
KeptWeight = int4.Int4Weight | int8.Int8Weight | fp8.Fp8Weight

_logged: set[str] = set()


def fuse_reason(shapes: list[KeptShape]) -> str | None:
    """Why matrices fused into one weight cannot be kept together (one kernel, and its own rule), or None."""
    if len({shape.kernel for shape in shapes}) != 1:
        return f"matrices fused together kept for different kernels ({', '.join(s.kernel for s in shapes)})"
    if not int4.same_order([shape.order for shape in shapes]):
        return "GPTQ act-order matrices fused together with different input orders"
    return shapes[0].fuse_reason(shapes)


def resident_bytes(shapes: list[KeptShape]) -> int:
    """What the one kept weight of these matrices fused holds: each one's bytes, and their one input order."""
    order = shapes[0].order
    return sum(shape.nbytes for shape in shapes) + (0 if order is None else order.nbytes)


def weight(parts: list[KeptParts]) -> KeptWeight:
    """The matrices fused along the outputs into one weight their kernel multiplies by."""
    return parts[0].cat(parts).kept()


def dequantized(reason: str) -> None:
    """Log, once per process and reason, why a quantized matrix is dequantized instead of kept quantized."""
    if reason not in _logged:
        _logged.add(reason)
        log.get_logger().info("quantized weight dequantized, not kept quantized", reason=reason)
