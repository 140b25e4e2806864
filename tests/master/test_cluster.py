"""The master's zero-config half: Cake's layer assignment, and `cakemp generate --discover` against a live
node, alone and beside a host forging discovery replies."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from tokenizers import Tokenizer

from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import estimated_layer_bytes
from cakemp.checkpoint.resident import PerDevice
from cakemp.cli import cli
from cakemp.demo.synthetic import write_checkpoint
from cakemp.master.cluster import assign_layers, layer_bytes, max_layers
from cakemp.master.discovery import MAX_ADDRESSES, MAX_CLAIMS, DiscoveredWorker, discover
from cakemp.wire.discovery import Announcement, GpuInfo, cluster_hash, decode_probe, encode_announcement
from tests.support.checkpoints import make_checkpoint
from tests.support.int4_checkpoints import random_gptq
from tests.support.node import ZeroConfigNode
from tests.support.quantized import GptqSpec, gptq_checkpoints, gptq_shaped, mlx_checkpoint, needs_gptqmodel, needs_mlx

transformers = pytest.importorskip("transformers")

GIB = 1 << 30
PROMPT = "Once upon a time"
STEPS = 8


def worker(name: str, *gpus: tuple[str, int, float]) -> DiscoveredWorker:
    return DiscoveredWorker("10.0.0.1", (Announcement("h", name, 10128, tuple(GpuInfo(*g) for g in gpus)),))


def test_layers_go_by_tflops_fastest_first_in_contiguous_runs_and_the_master_keeps_the_rest():
    """32 layers, master 10 TFLOPS, workers 30 and 20: round(50/60 x 32) = 27 to the workers, 16 then 11."""
    slow, fast = worker("slow", ("A", 80 * GIB, 20.0)), worker("fast", ("B", 80 * GIB, 30.0))
    (first, a), (second, b) = assign_layers([slow, fast], 32, 10.0, PerDevice(1 << 20, 1 << 20))
    assert (first.name, second.name) == ("fast", "slow")
    assert a == tuple(f"model.layers.{i}" for i in range(0, 16)) and b == tuple(f"model.layers.{i}" for i in range(16, 27))


def test_a_worker_gets_no_more_layers_than_its_memory_holds():
    """A 24 GiB CUDA device keeps max(5 %, 768 MiB) and holds 11 layers of 2 GiB; a CPU keeps 20 %."""
    small = worker("small", ("RTX", 24 * GIB, 1000.0))
    assert max_layers(small.claims[0].gpus, PerDevice(GIB, 2 * GIB)) == 11
    assert max_layers((GpuInfo("CPU (x86_64)", 10 * GIB, 2.0),), PerDevice(GIB, 2 * GIB)) == 8
    ((_, layers),) = assign_layers([small], 40, 1.0, PerDevice(GIB, 2 * GIB))
    assert len(layers) == 11


def test_an_address_named_by_different_replies_is_weighed_by_the_least_any_claims():
    """Its own reply says 20 TFLOPS on 24 GiB, a forged one 1000 on 80 GiB: weighed as 20 TFLOPS and 11 layers of 2 GiB."""
    own = Announcement("h", "gpu-box", 10128, (GpuInfo("RTX", 24 * GIB, 20.0),))
    forged = Announcement("h", "aaa-spoof", 10128, (GpuInfo("H200", 80 * GIB, 1000.0),) * 8)
    for claims in ((own, forged), (forged, own)):
        contested = DiscoveredWorker("10.0.0.1", claims)
        assert contested.tflops == 20.0
        ((_, layers),) = assign_layers([contested], 40, 20.0, PerDevice(2 * GIB, 2 * GIB))
        assert len(layers) == 11


def test_without_tflops_the_workers_split_half_the_layers():
    a, b = worker("a", ("A", 80 * GIB, 0.0)), worker("b", ("B", 80 * GIB, 0.0))
    assert [len(layers) for _, layers in assign_layers([a, b], 9, 0.0, PerDevice(0, 0))] == [2, 2]


def values_per_layer(plain, prefix="model.layers"):
    """The oracle: how many values one layer of the plain (HF-layout, dequantized) checkpoint has."""
    config = ModelConfig.from_dir(plain)
    with safe_open(plain / "model.safetensors", framework="pt") as f:
        total = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys() if name.startswith(prefix + "."))
    return total // config.num_hidden_layers


def held_and_on_disk(path, itemsize):
    """(layer_bytes on a GPU computing in f16 or f32, which dequantizes every matrix; Cake's estimate
    from the bytes on disk) of a quantized checkpoint."""
    config = ModelConfig.from_dir(path)
    held = layer_bytes(path, {2: "f16", 4: "f32"}[itemsize]).cuda
    return held, estimated_layer_bytes(path, config.num_hidden_layers, config.layer_prefix)


@needs_mlx
def test_an_mlx_layer_is_sized_as_the_node_holds_it_dequantized(tmp_path):
    """A 4-bit MLX Llama (mx.quantize's codes): a layer counts every value of its dequantized matrices
    at the compute dtype's size, as the reference checkpoint (mx.dequantize's matrices) has them:
    well over 3 times the bytes on disk in f16, the master's former estimate."""
    path, reference = mlx_checkpoint(tmp_path, "llama", bits=4, group_size=32)
    for itemsize in (2, 4):
        held, on_disk = held_and_on_disk(path, itemsize)
        assert held == values_per_layer(reference) * itemsize
        print(f"MLX 4-bit, {itemsize}-byte dtype: held / on disk = {held / on_disk:.2f}")
    assert held_and_on_disk(path, 2)[0] > 3 * held_and_on_disk(path, 2)[1]


@pytest.mark.parametrize("desc_act", [False, True])
def test_a_gptq_layer_is_sized_as_the_node_holds_it_dequantized(tmp_path, desc_act):
    """A 4-bit GPTQ Llama (parts in GPTQ's layout, act-order's g_idx or not): a layer counts its
    dequantized matrices' values at the compute dtype's size, as the plain checkpoint has them."""
    spec = GptqSpec("llama", bits=4, group_size=32, desc_act=desc_act)
    path = gptq_shaped(tmp_path, "llama", spec)
    held, on_disk = held_and_on_disk(path, 2)
    assert held == values_per_layer(tmp_path / "plain" / "llama-0") * 2
    assert held > 3 * on_disk


@needs_gptqmodel
def test_a_gptqmodel_packed_layer_is_sized_as_its_reference(tmp_path):
    """The same, for a checkpoint GPTQModel packed, against its dequantized reference."""
    (path, reference), = gptq_checkpoints(tmp_path, {"llama": GptqSpec("llama")}).values()
    assert held_and_on_disk(path, 4)[0] == values_per_layer(reference) * 4


def test_a_cpu_worker_is_given_more_layers_of_a_4_bit_checkpoint_than_at_dequantized_bytes(tmp_path):
    """A 4-bit GPTQ Llama in groups of 32, computed in f32: a CPU worker keeps its matrices int4
    (0.5 byte a value and a bf16 scale and zero per 32), a GPU dequantizes them (f32 is not the
    int4 kernel's bf16), so a CPU of the memory that holds 2 dequantized layers holds more, at the
    bytes the oracle counts from the matrices' shapes."""
    plain = make_checkpoint(tmp_path / "plain", "llama")
    path = random_gptq(tmp_path / "gptq", plain, 32)
    config = ModelConfig.from_dir(path)
    held = layer_bytes(path, "f32")
    matrices = {name: shape for name, shape in plain_shapes(plain).items() if len(shape) == 2}
    rest = sum(math.prod(shape) for shape in plain_shapes(plain).values()) * 4 - sum(
        math.prod(shape) * 4 for shape in matrices.values())
    int4_bytes = sum(rows * cols // 2 + rows * cols // 32 * 4 for rows, cols in matrices.values())
    assert held.cuda == values_per_layer(plain) * 4
    assert held.cpu == (int4_bytes + rest) // config.num_hidden_layers
    cpu = worker("cpu", ("CPU (x86_64)", int(2.5 * held.cuda / 0.8), 1.0))
    gpu = worker("gpu", ("RTX", int(2.5 * held.cuda) + (768 << 20), 1.0))
    assert max_layers(gpu.claims[0].gpus, held) == 2
    ((_, layers),) = assign_layers([cpu], config.num_hidden_layers, 0.0, held)
    assert len(layers) > 2, len(layers)


def plain_shapes(plain):
    """The layers' tensors of a plain checkpoint, name -> shape."""
    with safe_open(plain / "model.safetensors", framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys() if name.startswith("model.layers.")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic")
    write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def hf_text(checkpoint):
    """HF's greedy continuation of the prompt, as `cakemp generate` prints it."""
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(PROMPT).ids])
    out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, attention_mask=torch.ones_like(ids))
    return PROMPT + tokenizer.decode(out[0, ids.shape[1]:].tolist()) + "\n"


def generate(checkpoint, node: ZeroConfigNode, targets: str, *flags: str):
    """`cakemp generate --discover targets` over the node's discovery port, greedy, in f32."""
    return CliRunner().invoke(cli, [
        "generate", "--model", str(checkpoint), "--discover", targets, "--discovery-port", str(node.discovery_port),
        "--cluster-key", ZeroConfigNode.KEY, "--prompt", PROMPT, "--max-tokens", str(STEPS), "--temperature", "0",
        "--repeat-penalty", "1", "--dtype", "f32", *flags,
    ])  # fmt: skip


def test_cakemp_generate_discovers_sets_up_and_generates_hfs_greedy_text(checkpoint, hf_text, tmp_path):
    """`cakemp generate --discover` finds a waiting zero-config node, gives it the first half of the
    layers (equal TFLOPS), pushes them, and prints HF's greedy continuation."""
    node = ZeroConfigNode(tmp_path)
    try:
        result = generate(checkpoint, node, "127.0.0.1", "--min-workers", "1")
        assert result.exit_code == 0, result.output
        assert f"worker at 127.0.0.1:{node.port}: model.layers.0..model.layers.2 (3 layers)" in result.stderr
        assert result.stdout == hf_text
    finally:
        assert node.stop() == 0


# --------------------------------------------------------------------------- forged discovery replies

SPOOF_HOST = "127.0.0.2"  # another host on the master's LAN (loopback holds all of 127/8)
# What would win every layer if believed: 48 GPUs of 141 GB and 1000 TFLOPS each (a reply under Cake's 4096 bytes).
HUGE = tuple(GpuInfo("NVIDIA H200", 141 << 30, 1000.0) for _ in range(48))


def forged(name: str, port: int) -> Announcement:
    return Announcement(cluster_hash(ZeroConfigNode.KEY), name, port, HUGE, "CUDA", "gpu-farm", "linux")


@contextmanager
def spoofer(discovery_port: int, replies: list[tuple[str, Announcement]]):
    """A host at SPOOF_HOST that hears the master's probes (as anyone on its LAN does) and answers each
    with every (source host, announcement) of `replies`: from its own address, or from 127.0.0.1, the
    real node's host (a forged source address). It has no key: the probe names the cluster's hash."""
    hearing = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    hearing.bind((SPOOF_HOST, discovery_port))
    hearing.settimeout(0.2)
    sources = {host: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for host, _ in replies}
    for host, sock in sources.items():
        sock.bind((host, 0))
    done = threading.Event()

    def answer():
        while not done.is_set():
            try:
                probe, master = hearing.recvfrom(4096)
            except TimeoutError:
                continue
            assert decode_probe(probe) == cluster_hash(ZeroConfigNode.KEY)
            for host, announcement in replies:
                sources[host].sendto(encode_announcement(announcement), master)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        for sock in (hearing, *sources.values()):
            sock.close()


@contextmanager
def wrong_key_worker():
    """A TCP listener at SPOOF_HOST answering the handshake with another key (its MAC wrong); yields
    its port and the list of nonces masters sent it."""
    listener = socket.create_server((SPOOF_HOST, 0))
    listener.settimeout(0.2)
    nonces: list[bytes] = []
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                nonce = conn.recv(32)
                nonces.append(nonce)
                conn.sendall(hmac.new(b"another key", nonce, hashlib.sha256).digest() + os.urandom(32))
                conn.recv(32)  # the master closes without answering

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], nonces
    finally:
        done.set()
        thread.join()
        listener.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((SPOOF_HOST, 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    running = ZeroConfigNode(tmp_path_factory.mktemp("home"))
    yield running
    assert running.stop() == 0


def layer_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.endswith(" layers)")]


def test_forged_replies_that_prove_no_key_are_dropped_and_the_real_node_gets_its_layers(checkpoint, hf_text, node):
    """Beside the real node, a host without the key answers every probe claiming 48 H200s: at a port where
    nothing listens, at one whose listener has another key, and at its own address under the real node's
    name. The master dials each, drops the three (one line naming them), gives the real node the layers
    it gets alone, and its text is HF's."""
    with wrong_key_worker() as (wrong_port, nonces):
        spoofs = [forged("aaa-spoof", closed_port()), forged("wrong-key", wrong_port), forged("worker", node.port)]
        with spoofer(node.discovery_port, [(SPOOF_HOST, spoof) for spoof in spoofs]):
            result = generate(checkpoint, node, f"127.0.0.1,{SPOOF_HOST}", "--min-workers", "4",
                              "--discovery-timeout", "60")
        assert len(nonces) == 1  # the master asked that listener for the key's proof once
    assert result.exit_code == 0, result.output
    assert layer_lines(result.stderr) == [f"worker at 127.0.0.1:{node.port}: model.layers.0..model.layers.2 (3 layers)"]
    assert ("discovery: dropped the replies of 3 addresses that did not prove the cluster key: "
            f"{SPOOF_HOST}:{spoofs[0].port} (no TCP answer)") in result.stderr, result.stderr  # all of it, when not
    assert f"{SPOOF_HOST}:{wrong_port} (no cluster-key proof)" in result.stderr
    assert f"{SPOOF_HOST}:{node.port} (no TCP answer)" in result.stderr
    assert "aaa-spoof" not in result.stderr and "wrong-key" not in result.stderr  # no reply's own text
    assert result.stdout == hf_text


def test_a_forged_reply_for_the_real_nodes_address_cannot_raise_its_weight(checkpoint, hf_text, node):
    """A reply forged from the real node's host for its port, claiming 48 H200s, proves the key there (the
    real node answers the handshake), but the capacity it claims came over UDP unauthenticated: the
    master weighs that address by the least any of its replies claims, the node's own (a CPU of 2
    TFLOPS, as the master's), so the node gets half the layers as it does alone, not all six."""
    twin = forged("aaa-twin", node.port)
    with spoofer(node.discovery_port, [("127.0.0.1", twin)]):
        # The whole window: both the node's reply and the forged one are heard.
        result = generate(checkpoint, node, f"127.0.0.1,{SPOOF_HOST}", "--discovery-timeout", "4")
    assert result.exit_code == 0, result.output
    (line,) = layer_lines(result.stderr)
    assert line.endswith(f" at 127.0.0.1:{node.port}: model.layers.0..model.layers.2 (3 layers)")
    assert f"discovery: different replies name 127.0.0.1:{node.port}: each is weighed by the least" in result.stderr
    assert result.stdout == hf_text


def test_a_flood_of_replies_keeps_a_bounded_table():
    """One host answering every probe with 200 addresses, and 20 different claims for one of them: the
    master keeps MAX_ADDRESSES addresses and MAX_CLAIMS claims for that one, so proving them costs as many
    connections at most."""
    small = (GpuInfo("CPU (x86_64)", 1 << 30, 2.0),)
    replies = [(SPOOF_HOST, replace(forged(f"spoof-{i}", 20000 + i), gpus=small)) for i in range(200)]
    replies += [(SPOOF_HOST, replace(forged(f"claim-{i}", 20000), gpus=small)) for i in range(20)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as free:
        free.bind((SPOOF_HOST, 0))
        port = free.getsockname()[1]
    with spoofer(port, replies):
        workers = asyncio.run(discover(ZeroConfigNode.KEY, [SPOOF_HOST], port=port, timeout=2))
    assert len(workers) == MAX_ADDRESSES
    assert len(workers[0].claims) == MAX_CLAIMS and all(len(w.claims) == 1 for w in workers[1:])
