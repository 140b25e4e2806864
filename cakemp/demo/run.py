"""`cakemp demo`: the whole path on one machine, with no download and no arguments.

It builds (once, cached) a small synthetic Llama checkpoint, starts a real node (`cakemp run`,
two CPU device processes or every GPU) on a loopback port with a cluster key, and generates
through it as a Cake master would, keeping one layer on the master so that each token takes a
Batch spanning the node's two devices, a local layer, then a second Batch. Every hidden state
the node returned is then checked against the same layers run in this process by one
BlockRunner, and the node is shut down.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import torch
import yaml

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute.runner import BlockRunner
from cakemp.compute.tensors import compute_dtype
from cakemp.demo.local_node import LocalNode, NodeFailed, free_port
from cakemp.demo.synthetic import DEMO, demo_checkpoint, demo_dir
from cakemp.errors import NodeFault
from cakemp.master.generator import Generator
from cakemp.master.sampler import SamplingParams
from cakemp.master.step_loop import RemoteCall
from cakemp.topology import Topology

PROMPT = "Once upon a time"
MAX_TOKENS = 32
# The node computes in other processes, possibly with another thread count, so GEMMs may sum in
# another order: allow a few ulps of the activations' magnitude, no more.
TOLERANCE = {"f32": 1e-4, "f16": 1e-2}


async def run_demo(out: TextIO = sys.stdout) -> None:
    """Run the demo, writing its story to `out`; raises a CakempError when a step fails."""
    story = _Story(out)
    gpus, dtype, device = ("all", "f16", "cuda") if torch.cuda.is_available() else ("cpu:2", "f32", "cpu")
    story.say("cakemp demo: the model's weights are synthetic (seeded random numbers), so its text is gibberish.")
    model_dir, config = _checkpoint(story)
    n = config.num_hidden_layers
    # The node serves every layer but the second to last, which the master keeps.
    kept = n - 2
    node_entries = [f"{config.layer_prefix}.0-{kept - 1}", config.layer_name(n - 1)]
    node_layers = [config.layer_name(i) for i in range(n) if i != kept]
    with tempfile.TemporaryDirectory(prefix="cakemp-demo-") as work:
        port = free_port()
        topology_path = Path(work) / "topology.yml"
        topology_path.write_text(
            yaml.safe_dump({"demo": {"host": f"127.0.0.1:{port}", "description": "cakemp demo node",
                                     "layers": node_entries}})
        )  # fmt: skip
        key = secrets.token_hex(16)
        node = LocalNode(
            name="demo", model_dir=model_dir, topology=topology_path, port=port, gpus=gpus, dtype=dtype,
            log_path=Path(work) / "node.log", cluster_key=key,
        )  # fmt: skip
        start = time.perf_counter()
        node.start()
        try:
            info = await node.wait_ready()
            story.say(
                f"node        cakemp run --gpus {gpus} --dtype {dtype} on {node.address} (cluster key set): "
                f"ready in {time.perf_counter() - start:.1f} s, serving {', '.join(node_entries)}"
            )
            story.say(f"            it answers Hello with version {info.version}, {info.device}, {info.dtype}")
            generator = Generator.open(model_dir, Topology.load(topology_path), dtype=dtype, device=device, cluster_key=key)
            trace = await _generate(story, await generator, config.layer_name(kept))
            difference = _check(model_dir, node_layers, trace, device, dtype)
            story.say(
                f"check       {len(trace)} hidden states from the node equal one in-process BlockRunner "
                f"over the same layers (max |difference| {difference:.1e}, allowed {TOLERANCE[dtype]:.0e})"
            )
        finally:
            status = node.stop()
        if status != 0:
            raise NodeFailed(f"the node exited with status {status} on SIGTERM{node.log_tail()}")
        story.say("shutdown    Goodbye sent on every connection, node stopped cleanly (exit status 0)")
        story.say('next        a node of your own on this checkpoint: README.md, "Your own node" '
                  "(cakemp demo --checkpoint prints its directory)")


class _Story:
    """The demo's output: whole lines, and generated text as it streams."""

    def __init__(self, out: TextIO):
        self._out = out

    def say(self, line: str = "") -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def stream(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()


def _checkpoint(story: _Story) -> tuple[Path, ModelConfig]:
    """The synthetic checkpoint (built once, then reused) and its config."""
    cached = demo_dir(DEMO).is_dir()
    start = time.perf_counter()
    model_dir = demo_checkpoint(DEMO)
    built = "reused" if cached else f"built in {time.perf_counter() - start:.1f} s"
    config = ModelConfig.from_dir(model_dir)
    story.say(
        f"checkpoint  {model_dir} ({built}): Llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads on {config.num_key_value_heads} KV heads"
    )
    return model_dir, config


async def _generate(story: _Story, generator: Generator, kept_layer: str) -> list[RemoteCall]:
    """Generate MAX_TOKENS through the node, telling the story; every Batch the node answered."""
    trace: list[RemoteCall] = []
    async with generator as gen:
        batches = sum(run.host is not None for run in gen.runs)
        story.say(
            f"master      embeddings, final norm, lm_head and {kept_layer} here; "
            f"{len(gen.pool.hosts)} connections, {batches} Batch round trips per token"
        )
        story.say(f"generating  {MAX_TOKENS} tokens, temperature 1.0, seeded:")
        story.say()
        story.stream(PROMPT)
        generation = await gen.generate(PROMPT, MAX_TOKENS, SamplingParams(), on_text=story.stream, trace=trace)
        story.say()
        story.say()
        for line in generation.summary().splitlines():
            story.say(f"figures     {line}")
    return trace


class HiddenStateMismatch(NodeFault):
    """The node's hidden states differ from a single-process run of the same layers (the demo's check)."""


def _check(model_dir: Path, layers: list[str], trace: list[RemoteCall], device: str, dtype: str) -> float:
    """Replay every Batch of `trace` through one in-process runner; the largest difference seen."""
    runner = BlockRunner.load(model_dir, layers, device, compute_dtype(dtype))
    worst = 0.0
    for call in trace:
        expected = runner.run(0, call.x.to(runner.device, runner.dtype), runner.ops(call.ops))
        worst = max(worst, float((expected.float() - call.y.float()).abs().max()))
    if worst > TOLERANCE[dtype]:
        raise HiddenStateMismatch(
            f"the node's hidden states differ from a single-process run by up to {worst:.3g} "
            f"(allowed {TOLERANCE[dtype]:g})"
        )
    return worst
