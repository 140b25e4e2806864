"""cakemp's Triton kernels compiled as a GPU's process compiles them: Triton's own compiler and ptxas,
for sm_90 (an H200), as far as the GPU's binary, with no GPU needed, in a process of its own. The tests'
process runs Triton's interpreter (tests/conftest.py), whose patched language a compile there trips
over; a GPU's process never has it. The kernels: the block-scaled FP8 matmul
(cakemp/model/weights/fp8_gemm.py) and the paged decode attention (cakemp/model/paged_attention.py)."""

from __future__ import annotations

import os
import subprocess
import sys

# Compiles each case on argv, "fp8:rows:dtype" (the FP8 matmul's tile shape for that many rows, its output
# dtype) or "paged:dtype:n_rep:head_dim"; prints each that fails, and why.
_COMPILE = """
import sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from cakemp.model import paged_attention
from cakemp.model.weights import fp8, fp8_gemm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fp8_case(rows, out):
    block_m, block_n = fp8_gemm.tiles(int(rows))
    pointers = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": f"*{out}"}
    return fp8_gemm._kernel, pointers, {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": fp8.BLOCK}, "e4m3"


def paged_case(dtype, n_rep, head_dim):
    pointers = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "tables_ptr": "*i64",
                "positions_ptr": "*i64", "o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dtype}", "scale": "fp32"}
    partial, merge = paged_attention.constants(int(n_rep), int(head_dim), DTYPES[dtype])
    return ((paged_attention._partial, pointers, partial, ""), (paged_attention._merge, pointers, merge, ""))


for case in sys.argv[1:]:
    name, *fields = case.split(":")
    for kernel, pointers, constants, in_ptx in ((fp8_case(*fields),) if name == "fp8" else paged_case(*fields)):
        signature = {arg: pointers.get(arg, "constexpr" if arg in constants else "i32") for arg in kernel.arg_names}
        try:
            compiled = compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"] and in_ptx in compiled.asm["ptx"], f"no {in_ptx} in its PTX"
        except Exception as e:
            print(case, kernel.__name__, type(e).__name__, str(e).splitlines()[-1] if str(e) else "")
"""


def require_nvidia_backend() -> None:
    """Skip the calling test where this Triton cannot compile for NVIDIA GPUs."""
    import pytest
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")


def compile_kernels(cases: list[str], env: dict[str, str] | None = None) -> str:
    """Compile each case ("fp8:rows:dtype", e.g. "fp8:1:bf16"; "paged:dtype:n_rep:head_dim") in a fresh process with `env` (this
    process's, less TRITON_INTERPRET, where None): what failed and why, one line each ("" when all compiled)."""
    if env is None:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, *cases], env=env, capture_output=True, text=True,
                          timeout=300)
    return done.stdout + (done.stderr[-2000:] if done.returncode else "")
