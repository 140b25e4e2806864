"""Import rules: the model code and the runner import no zmq, no asyncio, no transformers, and a CPU
runner serving its layers no torch._dynamo."""

import subprocess
import sys

from tests.support.checkpoints import make_checkpoint

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


SERVE_ON_CPU = """
import sys
import torch
from cakemp.compute.runner import BlockRunner
runner = BlockRunner.load(sys.argv[1], ["model.layers.0", "model.layers.1"], "cpu", torch.float32)
ops = lambda at: runner.ops([(layer, at, i) for i, layer in enumerate(runner.layers)])
runner.run(0, torch.randn(1, 4, runner.config.hidden_size), ops(0))
runner.run(0, torch.randn(1, 3, runner.config.hidden_size), ops(4))  # a chunk after earlier positions
runner.run(0, torch.randn(1, 1, runner.config.hidden_size), ops(7))
print("torch._dynamo" in sys.modules)
"""


def test_a_cpu_runner_loads_and_serves_without_importing_torch_dynamo(tmp_path):
    """torch._dynamo takes about a second to import (torch.nn.attention.bias imports it): a CPU device
    loading its layers and running a prompt, a chunk after it and a decode step never imports it, so
    every device start and restart is that much faster."""
    checkpoint = make_checkpoint(tmp_path, "llama")
    imported = subprocess.run([sys.executable, "-c", SERVE_ON_CPU, str(checkpoint)], capture_output=True, text=True,
                              check=True).stdout
    assert imported.split() == ["False"]
