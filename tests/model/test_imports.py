"""Import rules: the model code and the runner import no zmq, no asyncio, no transformers."""

import subprocess
import sys

CODE = """
import sys
forbidden = ("zmq", "asyncio", "transformers")
import torch, safetensors.torch  # torch itself imports asyncio: that is the baseline
baseline = {m for m in forbidden if m in sys.modules}
import cakemp.model.block, cakemp.model.weights.safetensors, cakemp.compute.runner
print(" ".join(m for m in forbidden if m in sys.modules and m not in baseline))
"""


def test_model_and_runner_import_no_zmq_asyncio_or_transformers():
    """In a fresh interpreter, cakemp.model and the runner add none of zmq, asyncio, transformers to what torch loads."""
    added = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    assert added.split() == []
