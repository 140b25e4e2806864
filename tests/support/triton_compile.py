"""The FP8 Triton kernel (cakemp/model/weights/fp8_gemm.py) compiled as a GPU's process compiles it:
Triton's own compiler and ptxas, for sm_90 (an H200), as far as the GPU's binary, with no GPU needed,
in a process of its own. The tests' process runs Triton's interpreter (tests/conftest.py), whose
patched language a compile there trips over; a GPU's process never has it."""

from __future__ import annotations

import os
import subprocess
import sys

# Compiles the kernel in each tile shape and output dtype on argv (rows:dtype ...); prints each that
# fails, and why.
_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from cakemp.model.weights import fp8, fp8_gemm

kernel = fp8_gemm._kernel
pointers = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
for case in sys.argv[1:]:
    rows, out = case.split(":")
    block_m, block_n = fp8_gemm.tiles(int(rows))
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": fp8.BLOCK}
    signature = {name: pointers.get(name, f"*{out}" if name == "out_ptr" else "constexpr" if name in constants
                                    else "i32") for name in kernel.arg_names}
    try:
        compiled = compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"] and "e4m3" in compiled.asm["ptx"], "no e4m3 in its PTX"
    except Exception as e:
        print(case, type(e).__name__, str(e).splitlines()[-1] if str(e) else "")
"""


def require_nvidia_backend() -> None:
    """Skip the calling test where this Triton cannot compile for NVIDIA GPUs."""
    import pytest
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")


def compile_fp8_kernel(cases: list[str], env: dict[str, str] | None = None) -> str:
    """Compile the kernel for each case ("rows:dtype", e.g. "1:bf16") in a fresh process with `env` (this
    process's, less TRITON_INTERPRET, where None): what failed and why, one line each ("" when all compiled)."""
    if env is None:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, *cases], env=env, capture_output=True, text=True,
                          timeout=300)
    return done.stdout + (done.stderr[-2000:] if done.returncode else "")
