"""A device process whose GPU faults: spawned by tests/device/test_process.py (a module of its own,
so that the child imports nothing heavier than cakemp)."""

from cakemp.device import process


def main(spec, parent_pipe, parent_pid, *rest):
    """process.main in a child whose every forward raises what torch raises after an illegal memory
    access while computing (a stand-in: the real fault needs a GPU and a faulty kernel)."""
    from cakemp.compute.runner import BlockRunner

    def illegal_access(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    BlockRunner._run = illegal_access
    process.main(spec, parent_pipe, parent_pid, *rest)
