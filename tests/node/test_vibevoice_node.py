"""`cakemp run --model-type audio-model` serving VibeVoice's language-model layers, over TCP, as
Cake's VibeVoice master drives them: one connection per remote layer, one SingleOp per layer and
step, block_idx the layer's number in its own stack, no Batch and no Goodbye.

Two nodes, each started once for this module:
* the Realtime 0.5B's shape in f32: base language model layers 0-1 and TTS language model
  layers 0-2 (two stacks that both number their layers and blocks from 0) on two CPU devices;
  each stack matches transformers' Qwen2DecoderLayer stack of the same weights to the f32 parity
  bound, and one connection interleaving both stacks' SingleOps gets exactly what each stack
  gets alone (their KV caches kept apart);
* the 1.5B's shape with decoder_config's torch_dtype bfloat16 and bf16 weights, run with the
  default --dtype: it computes in bf16, as Cake's worker does, and answers the F16 its master
  sends in F16 (where Cake's worker errors on the mismatch).
A checkpoint of the other model type is refused at start (exit 78).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from cakemp.master.client import WorkerClient
from cakemp.wire import DType
from tests.support.checkpoints import HFLayers, make_checkpoint, make_vibevoice_checkpoint
from tests.support.master import from_raw, to_raw
from tests.support.node import RunningNode, write_topology
from tests.support.tolerance import F32_REL, half_bound, rel_error

BASE, TTS = "model.language_model.layers", "model.tts_language_model.layers"
REALTIME_LAYERS = (2, 3)  # base language model, TTS language model
EXIT_CONFIG = 78


@pytest.fixture(scope="module")
def realtime(tmp_path_factory):
    """(node, {stack prefix: its Qwen2 oracle checkpoint}) for the Realtime shape in f32."""
    path, oracles = make_vibevoice_checkpoint(tmp_path_factory.mktemp("realtime"), "vibevoice_streaming",
                                              REALTIME_LAYERS)
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml",
                              [f"{BASE}.0-1", f"{TTS}.0-2"])
    node = RunningNode(path, topology, "--model-type", "audio-model", "--gpus", "cpu:2", "--dtype", "f32")
    yield node, oracles
    assert node.stop() == 0


@pytest.fixture(scope="module")
def declared_bf16(tmp_path_factory):
    """(node, its Qwen2 oracle checkpoint) for the 1.5B shape, bf16 by its decoder_config."""
    path, oracles = make_vibevoice_checkpoint(tmp_path_factory.mktemp("vv15"), "vibevoice", (3,),
                                              torch_dtype="bfloat16", dtype=torch.bfloat16)
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", [f"{BASE}.0-2"])
    node = RunningNode(path, topology, "--model-type", "audio-model", "--gpus", "cpu")
    yield node, oracles[BASE]
    assert node.stop() == 0


async def layer_clients(port: int, names: list[str]) -> dict[str, WorkerClient]:
    """One Hello'd connection per layer, as Cake's VibeVoice master opens them."""
    clients = {}
    for name in names:
        clients[name] = await WorkerClient.connect("127.0.0.1", port)
        await clients[name].hello()
    return clients


async def through_stack(clients: dict[str, WorkerClient] | WorkerClient, prefix: str, count: int,
                        x: torch.Tensor, index_pos: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x through layers 0..count-1 of stack `prefix`, a SingleOp each (block_idx its number in the stack)."""
    raw = to_raw(x, dtype)
    for i in range(count):
        client = clients if isinstance(clients, WorkerClient) else clients[f"{prefix}.{i}"]
        raw = await client.single_op(f"{prefix}.{i}", raw, index_pos, i)
    return from_raw(raw)


def steps(seed: int) -> list[torch.Tensor]:
    """A 7-token prompt and 5 decode steps' inputs [1, T, 64]."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, T, 64, generator=generator) for T in [7] + [1] * 5]


def test_each_stack_over_a_connection_per_layer_matches_qwen2_layers(realtime):
    """Cake's master's way: the base stack then the TTS stack, each layer on its own connection,
    a prompt and 5 decode steps; each stack's replies match HF's Qwen2 layers of its weights in f32."""
    node, oracles = realtime

    async def main():
        clients = await layer_clients(node.port, [f"{BASE}.{i}" for i in range(2)] + [f"{TTS}.{i}" for i in range(3)])
        for prefix, count, seed in ((BASE, 2, 1), (TTS, 3, 2)):
            reference, position = HFLayers(oracles[prefix], list(range(count)), torch.float32), 0
            for x in steps(seed):
                ours, theirs = await through_stack(clients, prefix, count, x, position), reference(x, position)
                assert rel_error(ours, theirs) <= F32_REL, f"{prefix} at {position}"
                position += x.shape[1]
        await asyncio.gather(*(client.close() for client in clients.values()))

    asyncio.run(asyncio.wait_for(main(), 120))


def test_both_stacks_interleaved_on_one_connection_equal_each_alone(realtime):
    """One connection sends both stacks' SingleOps op by op (base 0, TTS 0, base 1, TTS 1, TTS 2),
    block_idx 0 and 1 named by both: each stack's replies equal, bit for bit, what a connection of
    its own gets, so neither stack's KV cache saw the other's rows."""
    node, _ = realtime

    async def alone(prefix: str, count: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        client = await WorkerClient.connect("127.0.0.1", node.port)
        await client.hello()
        outputs, position = [], 0
        for x in inputs:
            outputs.append(await through_stack(client, prefix, count, x, position))
            position += x.shape[1]
        await client.close()
        return outputs

    async def interleaved(base_inputs: list[torch.Tensor], tts_inputs: list[torch.Tensor]):
        client = await WorkerClient.connect("127.0.0.1", node.port)
        await client.hello()
        base_out, tts_out, position = [], [], 0
        for x_base, x_tts in zip(base_inputs, tts_inputs, strict=True):
            a, b = to_raw(x_base), to_raw(x_tts)
            for layer in range(3):
                if layer < 2:
                    a = await client.single_op(f"{BASE}.{layer}", a, position, layer)
                b = await client.single_op(f"{TTS}.{layer}", b, position, layer)
            base_out.append(from_raw(a))
            tts_out.append(from_raw(b))
            position += x_base.shape[1]
        await client.close()
        return base_out, tts_out

    async def main():
        base_inputs, tts_inputs = steps(3), steps(4)
        base_mixed, tts_mixed = await interleaved(base_inputs, tts_inputs)
        for mixed, separate in ((base_mixed, await alone(BASE, 2, base_inputs)),
                                (tts_mixed, await alone(TTS, 3, tts_inputs))):
            for step, (ours, theirs) in enumerate(zip(mixed, separate, strict=True)):
                assert torch.equal(ours, theirs), f"step {step}"

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_layer_of_one_stack_is_refused_a_block_of_the_other(realtime):
    """block_idx counts within its own stack: base layer 0 may not name block 2 (a block only the
    TTS stack has), so no request reaches another stack's cache; the connection goes on."""
    node, _ = realtime

    async def main():
        client = await WorkerClient.connect("127.0.0.1", node.port)
        await client.hello()
        x = to_raw(torch.randn(1, 2, 64))
        with pytest.raises(Exception, match="block_idx 2 of layer model.language_model.layers.0 is not a KV slot"):
            await client.single_op(f"{BASE}.0", x, 0, 2)
        assert from_raw(await client.single_op(f"{BASE}.0", x, 0, 0)).shape == (1, 2, 64)
        await client.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_f16_from_the_master_on_bf16_weights_is_computed_and_answered_in_f16(declared_bf16):
    """decoder_config's bfloat16 makes the node compute in bf16 whatever --dtype (its WorkerInfo says
    BF16), as Cake's worker does; the F16 Cake's 1.5B master sends is answered in F16, within bf16's
    bound of HF's f32 layers (Cake's worker fails each such SingleOp on the dtype mismatch)."""
    node, oracle = declared_bf16
    assert node.wait_for(lambda e: e.get("event") == "computing in the checkpoint's dtype, as Cake's audio worker does"
                         )["dtype"] == "bf16"

    async def main():
        async with await WorkerClient.connect("127.0.0.1", node.port) as client:
            assert (await client.hello()).dtype == "BF16"
        clients = await layer_clients(node.port, [f"{BASE}.{i}" for i in range(3)])
        reference, position = HFLayers(oracle, [0, 1, 2], torch.float32), 0
        for x in steps(5):
            raw = to_raw(x, torch.float16)
            for i in range(3):
                raw = await clients[f"{BASE}.{i}"].single_op(f"{BASE}.{i}", raw, position, i)
                assert raw.dtype == DType.F16 and raw.shape == (1, x.shape[1], 64)
            assert rel_error(from_raw(raw), reference(x.half().float(), position)) <= half_bound(torch.bfloat16)
            position += x.shape[1]
        await asyncio.gather(*(client.close() for client in clients.values()))

    asyncio.run(asyncio.wait_for(main(), 120))


def refused(model, model_type: str, layers: str, tmp_path) -> str:
    """`cakemp run --model-type model_type` over `layers` of `model`: it must exit 78; -> its output."""
    topology = write_topology(tmp_path / "refused.yml", [layers])
    result = subprocess.run([sys.executable, "-m", "cakemp", "run", "--name", "worker", "--model", str(model),
                             "--topology", str(topology), "--model-type", model_type, "--gpus", "cpu",
                             "--address", "127.0.0.1:0", "--log-format", "json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CONFIG, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


def test_a_checkpoint_of_the_other_model_type_is_refused_at_start(tmp_path):
    """A VibeVoice checkpoint on a text-model node, and a Qwen2 one on an audio-model node, each
    exit 78 naming the --model-type the checkpoint is served with."""
    vibevoice, _ = make_vibevoice_checkpoint(tmp_path / "vv", "vibevoice", (2,))
    qwen2 = make_checkpoint(tmp_path / "qwen2", "qwen2", num_hidden_layers=2)
    assert "served with --model-type audio-model, not text-model" in refused(vibevoice, "text-model",
                                                                            f"{BASE}.0-1", tmp_path)
    assert "served with --model-type text-model, not audio-model" in refused(qwen2, "audio-model",
                                                                            "model.layers.0-1", tmp_path)
