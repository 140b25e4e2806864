import os

# Triton's interpreter runs Triton kernels on a CPU (tests/model/test_fp8_gemm.py). It is chosen when
# Triton is imported, which torch._dynamo does early (torch.utils._triton), so it is set here, before
# torch; a machine with an NVIDIA driver compiles the kernels for its GPU instead.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist each worker computes on one thread: the suite's workers already fill the cores,
# and two workers' thread pools on the same cores spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama checkpoint (tests/support/checkpoints.py), one per test module; modules that need
    another define their own `checkpoint`."""
    from tests.support.checkpoints import make_checkpoint  # transformers: imported only by the modules that use it

    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")
