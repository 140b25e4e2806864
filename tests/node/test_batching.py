"""Several Cake masters decoding at once through `cakemp run --gpus cpu:1`: the device batches
their steps, and each session still gets what it would get alone.

"Alone" is an in-process BlockRunner on the same checkpoint, fed each session's requests one
at a time; a batched step may round differently from unbatched ones, so results are compared
within tests/support/tolerance.py's f32 bound, never bit for bit.

To put requests into one step without depending on timing, `together` stops the device
process (SIGSTOP) while the front hands it every request of the round, and continues it once
the front counts them all as sent (`cakemp_device_requests_waiting`): the device then finds
them all waiting at once. Tests share the module's two nodes (a Llama one, and a Qwen3.5 one for
the linear-attention layers) and each opens its own connections.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import pytest
import torch

from cakemp.compute.runner import BlockRunner
from cakemp.errors import RemoteWorkerError
from cakemp.front.router import chunk_bounds
from cakemp.master.client import WorkerClient
from tests.support.checkpoints import HFLayers, make_checkpoint
from tests.support.master import from_raw, to_raw
from tests.support.node import RunningNode, Samples, quiescent, scrape, wait_waiting, write_topology
from tests.support.tolerance import assert_close

HIDDEN = 64
LAYERS = [0, 1, 2, 3]
DEVICE = "cpu:0"
PREFILL_CHUNK = 16  # --prefill-chunk: tokens per prompt chunk and prefill tokens per step
MAX_BATCH = 4  # --max-batch: fewer than some tests' sessions, so that steps are cut at it
MAX_CONTEXT = 128
LLAMA_PREFIX = "model.layers"
HYBRID_PREFIX = "model.language_model.layers"  # Qwen3.5's text layers, beside its vision tower
FULL_RUN = tuple((layer, layer) for layer in LAYERS)  # (layer, block_idx) as Cake's master sends them


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def start_node(checkpoint, tmp_path_factory, prefix: str) -> RunningNode:
    """An f32 node serving layers 0-3 of `checkpoint` on one CPU device process."""
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", [f"{prefix}.0-3"])
    return RunningNode(checkpoint, topology, "--gpus", "cpu:1", "--dtype", "f32", "--cpu-threads", "1",
                       "--prefill-chunk", str(PREFILL_CHUNK), "--max-batch", str(MAX_BATCH),
                       "--max-context", str(MAX_CONTEXT),
                       "--metrics-address", "127.0.0.1:0")


def alone_runner(checkpoint, prefix: str) -> BlockRunner:
    """The same layers in this process: each session's requests computed alone, one at a time.

    Its f32 matrices are packed for MKL's GEMM as the node's are (with --max-batch above 1):
    packed and plain products round differently for a lone request as much as for a batch, by
    up to 3.6e-6 after a few Qwen3.5 steps (more on ill-conditioned inputs), and what is
    compared here is the node's batched steps with the same computation alone.
    """
    return BlockRunner.load(checkpoint, [f"{prefix}.{i}" for i in LAYERS], "cpu", torch.float32,
                            max_context=MAX_CONTEXT, pack_weights=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The reference runner on one torch thread, as the node's device process (--cpu-threads 1):
    on a busy machine two threads over these tiny matrices mostly wait for each other (a decode
    step of the tiny model takes ~90 ms on two threads here, ~1 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    """The Llama node."""
    running = start_node(checkpoint, tmp_path_factory, LLAMA_PREFIX)
    yield running
    assert running.stop() == 0


@pytest.fixture
def reference(checkpoint) -> BlockRunner:
    return alone_runner(checkpoint, LLAMA_PREFIX)


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint: layers 0-2 linear attention (Gated DeltaNet), layer 3 full attention."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3_5")


@pytest.fixture(scope="module")
def hybrid_node(hybrid_checkpoint, tmp_path_factory):
    running = start_node(hybrid_checkpoint, tmp_path_factory, HYBRID_PREFIX)
    yield running
    assert running.stop() == 0


@dataclass
class Session:
    """One master's connection, the layer run it sends ((layer, block_idx) pairs in order), its
    next position, and its session number on the reference runner."""

    client: WorkerClient
    layer_run: tuple[tuple[int, int], ...]
    number: int
    prefix: str = LLAMA_PREFIX  # the family's layer prefix
    position: int = 0

    def ops(self, index_pos: int) -> list[tuple[str, int, int]]:
        return [(f"{self.prefix}.{layer}", index_pos, block_idx) for layer, block_idx in self.layer_run]

    async def send(self, x: torch.Tensor, index_pos: int | None = None) -> torch.Tensor:
        """x [1, T, H] through the node at `index_pos` (default: the session's next position) -> [1, T, H]."""
        at = self.position if index_pos is None else index_pos
        return from_raw(await self.client.batch(to_raw(x), self.ops(at)))

    def alone(self, reference: BlockRunner, x: torch.Tensor) -> torch.Tensor:
        """x computed by the reference runner at the session's next position, which then moves on.

        A prompt longer than PREFILL_CHUNK goes in the chunks the front cuts it into: cut at
        another place a linear-attention layer rounds differently (a 20-token Qwen3.5 prompt
        as 10 + 10 tokens ends 2.4e-6 from it whole), and the comparison is with
        what the node computes for the request alone, not with another cut.
        """
        parts = [reference.run(self.number, x[:, start:end], reference.ops(self.ops(self.position + start)))
                 for start, end in chunk_bounds(x.shape[1], PREFILL_CHUNK)]
        self.position += x.shape[1]
        return torch.cat(parts, dim=1)


async def connect(node: RunningNode, runs: Sequence[tuple[tuple[int, int], ...]],
                  prefix: str = LLAMA_PREFIX) -> list[Session]:
    sessions = []
    for number, layer_run in enumerate(runs):
        client = await WorkerClient.connect("127.0.0.1", node.port)
        await client.hello()
        sessions.append(Session(client, layer_run, number, prefix))
    return sessions


async def close(sessions: Sequence[Session]) -> None:
    await asyncio.gather(*(s.client.close() for s in sessions))


async def together(node: RunningNode, calls: Sequence[Awaitable], reaching: int | None = None) -> list:
    """Start `calls` while the device process is stopped, and continue it once the front has sent
    it the first request of `reaching` of them (default: all); each call's result or exception."""
    pid, port = node.device_pid(0), node.metrics_port()
    os.kill(pid, signal.SIGSTOP)
    try:
        tasks = [asyncio.ensure_future(call) for call in calls]
        await asyncio.to_thread(wait_waiting, port, DEVICE, len(tasks) if reaching is None else reaching)
    finally:
        os.kill(pid, signal.SIGCONT)
    return await asyncio.gather(*tasks, return_exceptions=True)


async def lockstep(node: RunningNode, reference: BlockRunner, sessions: Sequence[Session],
                   xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One request per session (x [1, T, H] each), sent `together` so that the device takes them
    in one step (or as few as its token budget allows); each answer equals that session's
    request computed alone. The answers."""
    answers = await together(node, [s.send(x) for s, x in zip(sessions, xs)])
    for session, x, answer in zip(sessions, xs, answers):
        if isinstance(answer, BaseException):
            raise answer
        assert_close(answer, session.alone(reference, x))
    return answers


def device_stat(metrics: Samples, name: str, le: float | None = None) -> float:
    """The device's sample `name` (0 before it has one); of a histogram bucket, the one up to `le`."""
    for (sample, labels), value in metrics.items():
        labels = dict(labels)
        if sample == name and labels.pop("device", None) == DEVICE and \
                (labels == {} if le is None else float(labels.get("le", "nan")) == le):
            return value
    return 0.0


def tokens(generator: torch.Generator, count: int) -> torch.Tensor:
    return torch.randn(1, count, HIDDEN, generator=generator)


def test_concurrent_decodes_match_each_session_alone(node, reference, checkpoint):
    """Four sessions with the same run prefill together, then decode six steps together: every
    answer equals that session's request computed alone, and the first session's also HF's
    layers (an oracle that shares no code with the node)."""
    generator = torch.Generator().manual_seed(1)
    hf = HFLayers(checkpoint, LAYERS, torch.float32)

    async def main():
        sessions = await connect(node, [FULL_RUN] * 4)
        for lengths in [(2, 3, 4, 5)] + [(1, 1, 1, 1)] * 6:  # prompts, then six decode steps
            xs = [tokens(generator, length) for length in lengths]
            position = sessions[0].position
            answers = await lockstep(node, reference, sessions, xs)
            assert_close(answers[0], hf(xs[0], position))
        await close(sessions)

    run(main())


def test_sessions_at_different_positions_share_steps(node, reference):
    """Sessions at positions 3 and 40 (a prompt of several chunks), and a third sending 4-token
    chunks, take steps together: each is answered as alone, its positions its own."""
    generator = torch.Generator().manual_seed(2)

    async def main():
        short, long, chunked = await connect(node, [FULL_RUN] * 3)
        await lockstep(node, reference, [short, long], [tokens(generator, 3), tokens(generator, 40)])
        assert (short.position, long.position) == (3, 40)
        for _ in range(4):
            await lockstep(node, reference, [short, long, chunked],
                           [tokens(generator, 1), tokens(generator, 1), tokens(generator, 4)])
        await close([short, long, chunked])

    run(main())


def test_different_layer_runs_in_the_same_steps(node, reference):
    """Runs over different layers, in different orders and with KV slots other than the layer
    index, two of them alike, step together; each matches its own run computed alone."""
    runs = [
        FULL_RUN,
        FULL_RUN,
        ((1, 1), (2, 2)),  # the middle of the node's layers
        ((0, 3), (1, 2), (2, 1), (3, 0)),  # block_idx reversed
        ((3, 0), (2, 1)),  # layers in reverse order
        ((2, 2),),  # one layer
    ]
    generator = torch.Generator().manual_seed(3)

    async def main():
        sessions = await connect(node, runs)
        await lockstep(node, reference, sessions, [tokens(generator, 1 + i) for i in range(len(sessions))])
        for _ in range(4):
            await lockstep(node, reference, sessions, [tokens(generator, 1) for _ in sessions])
        await close(sessions)

    run(main())


def test_a_long_prompt_arriving_among_decodes(node, reference):
    """A 50-token prompt sent in the same step as three sessions' decodes, which go on decoding
    while it is computed: all answers match, and the prompt's session then decodes from position
    50. The prompt is not computed in one step: cut into four chunks of 12-13 tokens, and with
    --prefill-chunk 16 prefill tokens per step it takes four steps, none of more than 16 + 3 tokens."""
    generator = torch.Generator().manual_seed(4)
    port = node.metrics_port()

    async def main():
        *decoding, prompted = await connect(node, [FULL_RUN] * 4)
        await lockstep(node, reference, decoding, [tokens(generator, 5) for _ in decoding])
        # Drawn before anything runs, so what each session sends does not depend on the interleaving.
        steps = {s.number: [tokens(generator, 1) for _ in range(6)] for s in decoding}
        prompt = tokens(generator, 50)

        async def decode(session: Session) -> None:
            for x in steps[session.number]:
                answer = await session.send(x)
                assert_close(answer, session.alone(reference, x))

        before = await asyncio.to_thread(scrape, port)
        answers = await together(node, [*(decode(s) for s in decoding), prompted.send(prompt)])
        after = await asyncio.to_thread(scrape, port)
        for answer in answers[:-1]:
            if answer is not None:
                raise answer
        assert_close(answers[-1], prompted.alone(reference, prompt))
        assert [s.position for s in decoding] == [11, 11, 11]
        await lockstep(node, reference, [*decoding, prompted], [tokens(generator, 1) for _ in range(4)])
        assert prompted.position == 51
        await close([*decoding, prompted])
        return before, after

    before, after = run(main())
    ran = {name: device_stat(after, name, le) - device_stat(before, name, le)
           for name, le in (("cakemp_device_step_tokens_sum", None), ("cakemp_device_step_tokens_count", None),
                            ("cakemp_device_step_tokens_bucket", 32))}
    assert ran["cakemp_device_step_tokens_sum"] == 3 * 6 + 50
    assert ran["cakemp_device_step_tokens_count"] >= 4
    assert ran["cakemp_device_step_tokens_bucket"] == ran["cakemp_device_step_tokens_count"]  # every step <= 32 tokens


def test_a_prompt_alone_on_the_device_runs_in_large_pieces(node, reference):
    """With no other session on the node, a 50-token prompt is not cut to --prefill-chunk (16: four
    steps): at most its first piece is (before the device has measured its rate), the rest runs in
    one step; the same again after a Goodbye runs in one step. Both answers match the prompt
    computed whole."""
    generator = torch.Generator().manual_seed(8)
    port = node.metrics_port()
    prompts = [tokens(generator, 50) for _ in range(2)]

    async def main():
        quiescent(port)
        (session,) = await connect(node, [FULL_RUN])
        steps = []
        for x in prompts:
            before = await asyncio.to_thread(scrape, port)
            answer = await session.send(x, 0)
            after = await asyncio.to_thread(scrape, port)
            steps.append([device_stat(after, name) - device_stat(before, name)
                          for name in ("cakemp_device_step_tokens_count", "cakemp_device_step_tokens_sum")])
            reference.free_session(0)
            assert_close(answer, reference.run(0, x, reference.ops(session.ops(0))))
            await session.client.goodbye()
        await close([session])
        return steps

    (first_steps, first_tokens), (second_steps, second_tokens) = run(main())
    assert first_steps <= 2 and second_steps == 1 and first_tokens == second_tokens == 50


def test_a_bad_request_in_a_step_fails_alone(node, reference):
    """In one step, a session skipping positions gets WorkerError while two good sessions are
    answered (and a request the front refuses, naming a layer not served here, does not hold the
    step up); the failed sessions then continue correctly in the next step."""
    generator = torch.Generator().manual_seed(5)

    async def main():
        good, other, skipping, stranger = await connect(node, [FULL_RUN, FULL_RUN, FULL_RUN, ((9, 1),)])
        await lockstep(node, reference, [good, other, skipping], [tokens(generator, 3) for _ in range(3)])
        xs = [tokens(generator, 1) for _ in range(4)]
        answers = await together(node, [good.send(xs[0]), other.send(xs[1]), skipping.send(xs[2], index_pos=5),
                                        stranger.send(xs[3])], reaching=3)
        assert isinstance(answers[2], RemoteWorkerError) and "does not follow the 3 positions" in str(answers[2])
        assert isinstance(answers[3], RemoteWorkerError) and "model.layers.9" in str(answers[3])
        for session, x, answer in zip((good, other), xs, answers):
            assert_close(answer, session.alone(reference, x))
        stranger.layer_run = ((1, 1),)
        await lockstep(node, reference, [good, other, skipping, stranger], [tokens(generator, 1) for _ in range(4)])
        assert [s.position for s in (good, other, skipping, stranger)] == [5, 5, 4, 1]
        await close([good, other, skipping, stranger])

    run(main())


def test_linear_attention_layers_step_together(hybrid_node, hybrid_checkpoint):
    """Qwen3.5 sessions, whose linear-attention layers carry a recurrent state per session, step
    together: a 20-token prompt (two chunks) among shorter ones, then decodes, over runs of all
    four layers, of linear layers only, and of a linear layer on another slot with the attention
    layer; each matches its session alone, also when one session starts a new prompt at position
    0 in a step of the others' decodes. A request that would rewind one session's recurrent state
    fails alone in its step, and that session goes on from where it was."""
    reference = alone_runner(hybrid_checkpoint, HYBRID_PREFIX)
    runs = [FULL_RUN, FULL_RUN, ((0, 0), (1, 1)), ((1, 2), (3, 3))]
    generator = torch.Generator().manual_seed(7)

    async def main():
        sessions = await connect(hybrid_node, runs, HYBRID_PREFIX)
        rewinding, *others = sessions
        await lockstep(hybrid_node, reference, sessions, [tokens(generator, n) for n in (20, 3, 5, 7)])
        for _ in range(2):
            await lockstep(hybrid_node, reference, sessions, [tokens(generator, 1) for _ in sessions])
        sessions[1].position = 0  # a new prompt without Goodbye: its state starts afresh beside continuing ones
        await lockstep(hybrid_node, reference, sessions, [tokens(generator, 4 if s is sessions[1] else 1) for s in sessions])
        xs = [tokens(generator, 1) for _ in sessions]
        answers = await together(hybrid_node, [rewinding.send(xs[0], index_pos=10),
                                               *(s.send(x) for s, x in zip(others, xs[1:]))])
        assert isinstance(answers[0], RemoteWorkerError) and "cannot be rewound" in str(answers[0])
        for session, x, answer in zip(others, xs[1:], answers[1:]):
            assert_close(answer, session.alone(reference, x))
        await lockstep(hybrid_node, reference, sessions, [tokens(generator, 1) for _ in sessions])
        assert [s.position for s in sessions] == [24, 6, 10, 12]
        await close(sessions)

    run(main())


def test_steps_ran_several_requests_and_are_counted(node, reference):
    """Eight rounds of six sessions' decodes sent together: the device's batch-size histogram
    counts every request once, in fewer steps than requests (some ran several) but never more than
    four a step (--max-batch 4), so at least two steps a round; its tokens-per-step histogram
    counts every token, and the current-batch gauge says idle once all are answered."""
    generator = torch.Generator().manual_seed(6)
    port = node.metrics_port()
    rounds = 8
    quiescent(port)  # earlier tests' connections ended on the device: only these requests run in between

    async def main():
        sessions = await connect(node, [FULL_RUN] * 6)
        await lockstep(node, reference, sessions, [tokens(generator, 2) for _ in sessions])
        before = await asyncio.to_thread(scrape, port)
        for _ in range(rounds):
            await lockstep(node, reference, sessions, [tokens(generator, 1) for _ in sessions])
        after = await asyncio.to_thread(scrape, port)
        await close(sessions)
        return before, after

    before, after = run(main())
    ran = {name: device_stat(after, name) - device_stat(before, name)
           for name in ("cakemp_device_batch_size_sum", "cakemp_device_batch_size_count",
                        "cakemp_device_step_tokens_sum", "cakemp_device_step_tokens_count")}
    requests = rounds * 6
    assert ran["cakemp_device_batch_size_sum"] == requests
    assert ran["cakemp_device_step_tokens_sum"] == requests  # one token each
    steps = ran["cakemp_device_batch_size_count"]
    assert steps == ran["cakemp_device_step_tokens_count"]
    assert 2 * rounds <= steps < requests
    up_to_max = device_stat(after, "cakemp_device_batch_size_bucket", MAX_BATCH) - \
        device_stat(before, "cakemp_device_batch_size_bucket", MAX_BATCH)
    assert up_to_max == steps  # no step ran more than --max-batch
    assert ("cakemp_device_batch_requests", (("device", DEVICE),)) in after
    assert device_stat(after, "cakemp_device_batch_requests") == 0  # every request answered: idle
