"""The bytes a matrix takes once a device holds it, by the path it takes there, from a checkpoint's
headers alone and without torch: one rule for a node's own count before it loads (its fit check,
compute/loading.LoadPlan.nbytes, through model/weights/int4.py's and int8.py's shapes) and for
the zero-config master's sizing of each device of a worker (master/cluster.py).

A quantized matrix is kept for a kernel (`KeptForm`, from its format's stored shapes:
checkpoint/quantization.py's `kept_form`) where the device kind uses that kernel
(`device_kernels`), and is otherwise dequantized into the compute dtype:

| path                       | resident bytes of an [N, K] matrix                                     |
|----------------------------|------------------------------------------------------------------------|
| kept int4, groups of g     | N K / 2 codes, 4 N K / g bf16 scales and zeros (+ 8 K: act-order's input order) |
| kept int8, one scale a row | N K codes, 10 N: f32 scale and correction, the kernel's bf16 unit scale |
| kept fp8, 128x128 blocks   | N K e4m3 codes, 4 (N/128) L f32 block scales, L = K/128 rounded up to 4 |
| dequantized, or plain      | N K times the compute dtype's size                                      |

| device kind | kept kernels                                        |
|-------------|-----------------------------------------------------|
| cpu         | int4 and int8, in any compute dtype                  |
| cuda        | fp8; int4 when computing in bf16 (the kernel's activations); int8 never |
| any, `--dequantize-4bit` | none                                    |

What the master cannot know from a worker's announcement, and so counts as the default: whether
the worker runs with `--dequantize-4bit` (the flag is not announced; such a worker is given as many
layers as one that keeps them, up to 4 times what it holds), and whether torch's kernels work on
its build (a node tries them: model/weights/int4.kernel_works, and for FP8 cuBLAS's block-scaled matmul
and then the Triton kernel, model/weights/fp8.gemm: a GPU older than Ada has neither, and holds its
FP8 matrices dequantized, twice the bytes counted in bf16), and whether a CPU worker computing in
f32 batches steps (`--max-batch` over 1, the default), so that it also keeps each plain f32 matrix
packed for MKL beside it (model/weights/packed.py: at least as many bytes again). Its other simplifications: an
act-order input order per matrix (a node keeps one per fused
weight), and matrices a node fuses (q/k/v) that take different kernels or group sizes, which a node
then dequantizes, counted as kept.
"""

from __future__ import annotations

from typing import NamedTuple

INT4 = "int4"
INT8 = "int8"
FP8 = "fp8"
FP8_BLOCK = 128  # the one scale block a kept FP8 matrix takes: 128x128 of the weight, 1x128 of the activation
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's int4 kernels take
INT4_ROW_TILE = 16  # CUDA's int4 layout takes the outputs in tiles of 8, the CPU's packing in 16 (a router of 8 experts in neither)
_BF16 = 2
_F32 = 4
_ORDER_ITEM = 8  # act-order's input order: int64


class KeptForm(NamedTuple):
    """A quantized [rows, cols] matrix as one of torch's kept kernels takes it, from its stored shapes."""

    kernel: str  # INT4, INT8 or FP8
    rows: int
    cols: int
    group_size: int  # inputs per scale: INT8's is all of a row, FP8's its blocks' 128
    ordered: bool = False  # act-order: its columns held in group order, the input order kept beside

    @property
    def nbytes(self) -> int:
        if self.kernel == INT8:
            return int8_bytes(self.rows, self.cols)
        if self.kernel == FP8:
            return fp8_bytes(self.rows, self.cols)
        return int4_bytes(self.rows, self.cols, self.group_size) + (order_bytes(self.cols) if self.ordered else 0)


def int4_bytes(rows: int, cols: int, group_size: int) -> int:
    """A kept int4 matrix's codes (two a byte) and its bf16 scale and zero per group and output."""
    return rows * cols // 2 + cols // group_size * rows * 2 * _BF16


def int8_bytes(rows: int, cols: int) -> int:
    """A kept int8 matrix's codes and, per output, its f32 scale and correction and the kernel's bf16 unit scale."""
    return rows * cols + rows * (2 * _F32 + _BF16)


def fp8_bytes(rows: int, cols: int) -> int:
    """A kept FP8 matrix's e4m3 codes and its f32 scale per 128x128 block, each row of the scale grid
    padded to a multiple of 4 (the layout cuBLAS's block-scaled matmul takes; the Triton kernel reads a view)."""
    padded = -(-(cols // FP8_BLOCK) // 4) * 4  # K/128 rounded up to 4
    return rows * cols + rows // FP8_BLOCK * padded * _F32


def fp8_unfit_reason(rows: int, cols: int, block: tuple[int, int]) -> str | None:
    """Why the FP8 matmuls cannot take an [rows, cols] e4m3 matrix scaled in `block`s, or None."""
    if tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        return f"FP8 scale blocks of {block[0]}x{block[1]} (the FP8 matmul takes {FP8_BLOCK}x{FP8_BLOCK})"
    if rows % FP8_BLOCK or cols % FP8_BLOCK:
        return f"an FP8 matrix of {rows}x{cols}, no whole number of {FP8_BLOCK}x{FP8_BLOCK} blocks"
    return None


def order_bytes(cols: int) -> int:
    """An act-order weight's input order: one int64 per input."""
    return cols * _ORDER_ITEM


def int4_unfit_reason(rows: int, cols: int, group_size: int) -> str | None:
    """Why torch's int4 kernels cannot take an [rows, cols] weight in groups of `group_size`, or None."""
    if group_size not in INT4_GROUP_SIZES:
        return f"groups of {group_size} inputs (torch's int4 matmul takes {', '.join(map(str, INT4_GROUP_SIZES))})"
    if cols % group_size:
        return f"{cols} inputs are no whole number of {group_size}-input groups"
    if rows % INT4_ROW_TILE:
        return f"{rows} outputs are no multiple of {INT4_ROW_TILE}"
    return None


def device_kernels(kind: str, bf16: bool, dequantize: bool = False) -> frozenset[str]:
    """The kernels a device of `kind` ("cpu", "cuda") keeps quantized matrices for, computing in bf16
    or not, unless told to dequantize them all (`--dequantize-4bit`); the table above."""
    if dequantize:
        return frozenset()
    if kind == "cpu":
        return frozenset({INT4, INT8})
    if kind != "cuda":
        return frozenset()
    return frozenset({FP8, INT4}) if bf16 else frozenset({FP8})


class PerDevice(NamedTuple):
    """A size in bytes on each device kind (one layer's, say), as `device_kernels` keeps its matrices."""

    cpu: int
    cuda: int

    def on(self, is_cpu: bool) -> int:
        return self.cpu if is_cpu else self.cuda
