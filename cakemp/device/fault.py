"""Which failures inside a device process leave its CUDA context unusable.

Most CUDA errors are "sticky": after an illegal memory access, a device-side assert or an
unspecified launch failure, every later call in that context fails too, so a process that
merely reports the error and serves on would fail every request from then on and never be
restarted. Such an error fails its request, and then the device process ends (the front's pool
restarts it, reloading its layers; its sessions are told once that their KV state is lost).
Out of memory is not sticky: that request fails, and the device serves on.
"""

from __future__ import annotations

# What CUDA's sticky errors say (cudaGetErrorString, as torch quotes it after "CUDA error: "),
# and cuBLAS's report of a kernel that faulted.
_STICKY = (
    "an illegal memory access was encountered",
    "misaligned address",
    "an illegal instruction was encountered",
    "unspecified launch failure",
    "device-side assert triggered",
    "hardware stack error",
    "uncorrectable ECC error encountered",
    "the launch timed out and was terminated",
    "unrecoverable error",
    "CUBLAS_STATUS_EXECUTION_FAILED",
)


def poisons_context(error: BaseException) -> bool:
    """Whether `error` (raised by torch on a CUDA device) leaves the process's CUDA context unusable."""
    text = str(error)
    return any(sticky in text for sticky in _STICKY)
