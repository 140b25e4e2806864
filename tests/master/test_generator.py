"""The Python Cake master against HF transformers' own `generate`, alone and through a real node.

The node (`cakemp run --gpus cpu:2`, started once for the module) serves model.layers.1-3 and
model.layers.5 of the synthetic 6-layer checkpoint; the master keeps layers 0 and 4. So each
step runs a local layer, a Batch over the node's two devices, a local layer, and a second Batch.
"""

import asyncio
import json
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from tokenizers import Tokenizer

from cakemp.cli import DEFAULT_SYSTEM_PROMPT, cli
from cakemp.demo.local_node import LocalNode, free_port
from cakemp.demo.synthetic import write_checkpoint
from cakemp.errors import RemoteWorkerError, WorkerUnreachable
from cakemp.master.generator import Generation, Generator, layer_hosts, plan_runs
from cakemp.master.sampler import SamplingParams
from cakemp.master.step_loop import LayerRun
from cakemp.model.weights.int4 import Int4Weight
from cakemp.topology import Topology
from tests.master.chat_templates import CHATML, with_template
from tests.support.checkpoints import make_checkpoint
from tests.support.int4_checkpoints import random_gptq

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
PROMPT = "Once upon a time"
STEPS = 20
NODE_LAYERS = ["model.layers.1-3", "model.layers.5"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic")
    write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def chat_model(checkpoint, tmp_path_factory):
    """The synthetic checkpoint with a ChatML template in chat_template.jinja (same weights)."""
    return with_template(checkpoint, tmp_path_factory.mktemp("chat") / "ckpt", CHATML, in_jinja_file=True)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def hf_greedy(model, prompt_tokens, steps):
    """HF's own greedy continuation of `prompt_tokens` (EOS included when it comes)."""
    ids = torch.tensor([list(prompt_tokens)])
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, attention_mask=torch.ones_like(ids))
    return tuple(out[0, ids.shape[1]:].tolist())


def topology_for(path, layers_by_host):
    path.write_text(yaml.safe_dump({f"node{i}": {"host": host, "layers": layers}
                                    for i, (host, layers) in enumerate(layers_by_host.items())}))
    return path


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    """A running node and the topology naming it."""
    work = tmp_path_factory.mktemp("node")
    port = free_port()
    topology = topology_for(work / "topology.yml", {f"127.0.0.1:{port}": NODE_LAYERS})
    node = LocalNode(name="node0", model_dir=checkpoint, topology=topology, port=port, gpus="cpu:2", dtype="f32",
                     log_path=work / "node.log")
    node.start()
    try:
        run(node.wait_ready())
        yield node, topology
    finally:
        assert node.stop() == 0


def generate(checkpoint, topology, prompt=PROMPT, steps=STEPS, sampling=GREEDY, **kwargs):
    async def go():
        async with await Generator.open(checkpoint, topology, dtype="f32") as generator:
            return await generator.generate(prompt, steps, sampling, **kwargs)

    return run(go())


def test_plan_groups_consecutive_layers_of_one_host():
    """Each maximal run of consecutive layers on one host, or here, becomes one LayerRun."""
    names = [f"model.layers.{i}" for i in range(7)]
    hosts = {names[1]: "a:1", names[2]: "a:1", names[3]: "b:1", names[5]: "a:1", names[6]: "a:1"}
    assert plan_runs(names, hosts) == (
        LayerRun(None, ((names[0], 0),)),
        LayerRun("a:1", ((names[1], 1), (names[2], 2))),
        LayerRun("b:1", ((names[3], 3),)),
        LayerRun(None, ((names[4], 4),)),
        LayerRun("a:1", ((names[5], 5), (names[6], 6))),
    )


def test_layer_hosts_takes_the_first_node_naming_a_layer():
    """A layer listed by two nodes goes to the one written first, and ranges are expanded."""
    topology = Topology.parse("a: {host: 'h1:1', layers: ['model.layers.0-1']}\nb: {host: 'h2:2', layers: ['model.layers.1-2']}")
    assert layer_hosts(topology) == {"model.layers.0": "h1:1", "model.layers.1": "h1:1", "model.layers.2": "h2:2"}


def test_all_local_greedy_equals_transformers_generate(checkpoint, hf_model):
    """With no worker, the master's greedy tokens are HF generate's."""
    generation = generate(checkpoint, Topology(()))
    assert generation.tokens == hf_greedy(hf_model, generation.prompt_tokens, STEPS)


def test_greedy_through_the_pool_equals_transformers_generate(checkpoint, hf_model, node):
    """Through a cpu:2 node serving part of the layers, greedy tokens are HF generate's."""
    _, topology = node
    trace = []
    generation = generate(checkpoint, Topology.load(topology), trace=trace)
    assert generation.tokens == hf_greedy(hf_model, generation.prompt_tokens, STEPS)
    # Two Batches per step, the prefill carrying the whole prompt, then one token at a time.
    assert len(trace) == 2 * len(generation.tokens)
    assert [call.ops[0].layer for call in trace[:2]] == ["model.layers.1", "model.layers.5"]
    assert trace[0].x.shape[1] == len(generation.prompt_tokens) and trace[2].x.shape[1] == 1
    assert trace[2].ops[0].index_pos == len(generation.prompt_tokens)


def test_cakemp_generate_prints_transformers_greedy_text(checkpoint, hf_model, node):
    """`cakemp generate` greedy prints the prompt then HF's greedy continuation, and its figures."""
    _, topology = node
    result = CliRunner().invoke(cli, [
        "generate", "--model", str(checkpoint), "--topology", str(topology), "--prompt", PROMPT,
        "--max-tokens", str(STEPS), "--temperature", "0", "--repeat-penalty", "1", "--dtype", "f32",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    expected = hf_greedy(hf_model, tokenizer.encode(PROMPT).ids, STEPS)
    assert result.stdout == PROMPT + tokenizer.decode(list(expected)) + "\n"
    assert "tokens/s" in result.stderr and "ms/token" in result.stderr


def cli_generate(model, *args):
    """`cakemp generate` greedy on `model`, f32, for STEPS tokens; its result."""
    result = CliRunner().invoke(cli, [
        "generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", str(STEPS), "--temperature", "0",
        "--repeat-penalty", "1", "--dtype", "f32", *args,
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result


def test_cakemp_generate_answers_the_chat_templates_prompt(chat_model, hf_model, node):
    """Without --raw, `cakemp generate` prompts with apply_chat_template's ids for Cake's default system
    prompt and the prompt, and prints only HF's greedy answer to them, up to its end token."""
    _, topology = node
    result = cli_generate(chat_model, "--topology", str(topology))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": PROMPT}]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = [t for t in hf_greedy(hf_model, ids, STEPS) if t != hf_tokenizer.eos_token_id]
    tokenizer = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    assert result.stdout == tokenizer.decode(expected) + "\n"
    assert "the prompt goes raw" not in result.stderr


def test_raw_and_a_checkpoint_without_template_send_the_prompt_as_it_is(checkpoint, chat_model):
    """--raw on the chat checkpoint prints what the template-less checkpoint prints (which says so)."""
    raw = cli_generate(chat_model, "--raw")
    plain = cli_generate(checkpoint)
    assert raw.stdout == plain.stdout and raw.stdout.startswith(PROMPT)
    assert "the prompt goes raw" in plain.stderr and "the prompt goes raw" not in raw.stderr


def test_sampling_is_reproducible_and_streamed(checkpoint, node):
    """Two seeded generations on one Generator agree, and the streamed pieces add up to the text."""
    _, topology = node
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=3)

    async def twice():
        async with await Generator.open(checkpoint, Topology.load(topology), dtype="f32") as generator:
            pieces = []
            first = await generator.generate(PROMPT, 16, sampling, on_text=pieces.append)
            second = await generator.generate(PROMPT, 16, sampling)
            return first, second, pieces

    first, second, pieces = run(twice())
    assert first.tokens == second.tokens
    assert "".join(pieces) == first.text == second.text
    assert len(pieces) > 1


@pytest.mark.parametrize("listed_in", ["config.json", "generation_config.json"])
def test_generation_stops_at_eos(checkpoint, tmp_path, listed_in):
    """A token listed as EOS in config.json, or in generation_config.json, ends the generation and is left
    out of the text."""
    free_run = generate(checkpoint, Topology(()))
    k = next(i for i, t in enumerate(free_run.tokens) if i > 0 and t not in free_run.tokens[:i])
    for path in checkpoint.iterdir():
        (tmp_path / path.name).symlink_to(path)
    config = json.loads((checkpoint / listed_in).read_text()) if listed_in == "config.json" else {}
    (tmp_path / listed_in).unlink(missing_ok=True)
    (tmp_path / listed_in).write_text(json.dumps({**config, "eos_token_id": [999, free_run.tokens[k]]}))
    stopped = generate(tmp_path, Topology(()))
    assert stopped.tokens == free_run.tokens[: k + 1]
    assert stopped.stopped_at_eos and not free_run.stopped_at_eos
    assert len(free_run.tokens) == STEPS


def test_worker_error_fails_the_generation_and_keeps_the_connection(checkpoint, node, tmp_path):
    """A layer the node does not serve gets RemoteWorkerError, again on retry, since the connection stays usable."""
    running, _ = node
    topology = topology_for(tmp_path / "wrong.yml", {running.address: ["model.layers.0-3"]})

    async def twice():
        async with await Generator.open(checkpoint, Topology.load(topology), dtype="f32") as generator:
            errors = []
            for _ in range(2):
                with pytest.raises(RemoteWorkerError) as caught:
                    await generator.generate(PROMPT, 4, GREEDY)
                errors.append(str(caught.value))
            return errors

    errors = run(twice())
    assert all("model.layers.0" in e for e in errors), errors


def test_an_unreachable_worker_fails_the_open(checkpoint, tmp_path):
    """A topology naming a port nothing listens on raises WorkerUnreachable when the master opens."""
    topology = topology_for(tmp_path / "down.yml", {f"127.0.0.1:{free_port()}": ["model.layers.2"]})
    with pytest.raises(WorkerUnreachable, match="Connection refused"):
        generate(checkpoint, Topology.load(topology))


def test_summary_reports_first_token_latency_and_decode_rate():
    """The figures split the prefill from the decode steps and give tokens/s over the decode."""
    generation = Generation((1, 2, 3), (4, 5, 6), "abc", (0.5, 0.1, 0.3), stopped_at_eos=False)
    assert generation.tokens_per_s == pytest.approx(5.0)
    assert generation.summary() == (
        "prompt 3 tokens, first token after 500.0 ms\n"
        "2 more tokens: 200.0 ms/token (median 200.0, max 300.0), 5.0 tokens/s"
    )


@pytest.mark.parametrize("keep_int4", [True, False])
def test_the_master_s_own_layers_keep_4_bit_weights_int4_unless_told_to_dequantize(checkpoint, tmp_path, keep_int4):
    """A GPTQ Llama (the synthetic checkpoint's tokenizer beside it), every layer run by the master: its
    4-bit matrices stay int4 by default and are dequantized with keep_int4=False (`--dequantize-4bit`,
    CAKEMP_DEQUANTIZE_4BIT)."""
    path = random_gptq(tmp_path / "gptq", make_checkpoint(tmp_path / "plain", "llama"), 32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, path / name)

    async def go():
        async with await Generator.open(path, Topology(()), dtype="f32", keep_int4=keep_int4) as generator:
            return generator.runner.blocks[0].w_qkv

    assert isinstance(run(go()), Int4Weight) == keep_int4
