"""Text generation as Cake's master does it, over workers reached through `WorkerClient`.

The master holds the embeddings, final norm and lm_head (`Head`) and the tokenizer. For each
decoder layer it asks the topology who serves it: a layer named by no node runs here, in
cakemp's own blocks; a remote layer gets its own connection, as Cake opens one per remote
layer and says Hello on each. Each step walks the layers in order and sends every maximal run
of consecutive layers on one worker as one `Batch`, on the connection of the run's first
layer (docs/models.md, Grouping layers into a Batch). A prompt is prefilled from position 0 (in
chunks of `step_loop.PROMPT_CHUNK` tokens), then one token per step; once a generation ends its
connections say `Goodbye`, which clears the workers' caches so the next generation prefills
afresh (a worker that keeps retired prefixes answers the rows it kept for the same prefix, to a
request of the same isolation key: connections.py). A generation ends at `max_tokens`, at an
end token (`chat.end_token_ids`), or once the caller sets its `halt` event (a stop string, a
client gone): after the step in flight, so the connections stay in step with the workers.

Several generations run at once, up to `max_concurrent`, each on its own connections, stepped
together (step_loop.py); `cakemp generate` runs one on the same machinery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from tokenizers import Tokenizer

from cakemp.checkpoint.files import DIRECTORY, GGUF, Container
from cakemp.compute.runner import BlockRunner
from cakemp.compute.tensors import compute_dtype
from cakemp.errors import CheckpointError, ConfigError
from cakemp.master.chat import ChatTemplate, end_token_ids
from cakemp.master.connections import ConnectionPool, Dialer
from cakemp.master.detokenizer import Detokenizer
from cakemp.master.gguf_tokenizer import gguf_chat_template, gguf_eos_ids, gguf_tokenizer
from cakemp.master.sampler import Sampler, SamplingParams
from cakemp.master.step_loop import LayerRun, RemoteCall, SequenceState, StepLoop
from cakemp.model.head import Head
from cakemp.model.weights.gguf import GgufCheckpoint
from cakemp.model.weights.readers import open_checkpoint
from cakemp.model.weights.safetensors import Checkpoint
from cakemp.model.weights.source import WeightSource
from cakemp.topology import Topology
from cakemp.wire import DType, Revision


@dataclass(frozen=True)
class Generation:
    """What one `generate` produced, and how fast."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]  # generated ids, the EOS that ended it included
    text: str  # the generated text, EOS excluded
    latencies: tuple[float, ...]  # seconds per generated token; the first one includes the prefill
    stopped_at_eos: bool
    halted: bool = False  # ended because the caller set `halt`
    waited: float = 0.0  # seconds it waited for a place among the concurrent generations, before the latencies

    @property
    def decode_latencies(self) -> tuple[float, ...]:
        return self.latencies[1:]

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took (0 when none)."""
        spent = sum(self.decode_latencies)
        return len(self.decode_latencies) / spent if spent > 0 else 0.0

    def summary(self) -> str:
        """Two lines of figures: prefill, then decode latency per token and throughput."""
        first = f"prompt {len(self.prompt_tokens)} tokens, first token after {self.latencies[0] * 1e3:.1f} ms"
        decode = self.decode_latencies
        if not decode:
            return first
        mean = sum(decode) / len(decode)
        return (
            f"{first}\n{len(decode)} more tokens: {mean * 1e3:.1f} ms/token "
            f"(median {median(decode) * 1e3:.1f}, max {max(decode) * 1e3:.1f}), {self.tokens_per_s:.1f} tokens/s"
        )


def plan_runs(layer_names: Sequence[str], hosts: dict[str, str]) -> tuple[LayerRun, ...]:
    """Group the model's layers, in order, into maximal runs on one host (`hosts`: layer → host)."""
    runs: list[LayerRun] = []
    for index, name in enumerate(layer_names):
        host = hosts.get(name)
        if runs and runs[-1].host == host:
            runs[-1] = LayerRun(host, runs[-1].layers + ((name, index),))
        else:
            runs.append(LayerRun(host, ((name, index),)))
    return tuple(runs)


def layer_hosts(topology: Topology) -> dict[str, str]:
    """Layer name → the host of the node that serves it; the first node naming a layer wins."""
    hosts: dict[str, str] = {}
    for _, node in topology.nodes:
        for layer in node.layers:
            hosts.setdefault(layer, node.host)
    return hosts


class Generator:
    """A master for one checkpoint and topology: open it, generate any number of times (up to
    `max_concurrent` at once, the rest waiting in arrival order), close it."""

    def __init__(
        self,
        head: Head,
        tokenizer: Tokenizer,
        runner: BlockRunner | None,
        runs: tuple[LayerRun, ...],
        pool: ConnectionPool,
        eos_ids: frozenset[int],
        wire_dtype: DType,
        chat: ChatTemplate | None = None,
        context_length: int | None = None,
    ) -> None:
        self.head = head
        self.tokenizer = tokenizer
        self.runner = runner
        self.runs = runs
        self.pool = pool  # a connection set per concurrent generation
        self.eos_ids = eos_ids
        self.chat = chat  # the checkpoint's chat template; None for a model without one
        self.context_length = context_length  # positions the model takes (max_position_embeddings)
        self.loop = StepLoop(head, runner, runs, pool, eos_ids, wire_dtype, self._ended)

    @classmethod
    async def open(
        cls,
        model_dir: str | Path,
        topology: Topology,
        *,
        dtype: str = "f16",
        device: str = "cpu",
        cluster_key: str | None = None,
        revision: Revision = Revision.V2,
        timeout: float = 10.0,
        keep_int4: bool = True,
        max_concurrent: int = 1,
    ) -> Generator:
        """Load the master's weights and local layers, then open `max_concurrent` connection sets to the
        remote layers (fewer if the workers admit fewer). `keep_int4`: the local layers' 4-bit matrices
        stay int4 where torch's int4 matmul takes them (BlockRunner.load)."""
        model_dir = Path(model_dir)
        checkpoint = open_checkpoint(model_dir)  # a GGUF file's header parsed once, for all three
        config = checkpoint.config
        torch_dtype = compute_dtype(dtype)
        tokenizer, end_ids, chat = _vocabulary(checkpoint)
        head = Head.from_checkpoint(checkpoint, device, torch_dtype)
        names = [config.layer_name(i) for i in range(config.num_hidden_layers)]
        runs = plan_runs(names, layer_hosts(topology))
        local = [name for run in runs if run.host is None for name, _ in run.layers]
        runner = BlockRunner.load(model_dir, local, device, torch_dtype, keep_int4=keep_int4) if local else None
        hosts = [(index, run.host) for run in runs if run.host is not None for _, index in run.layers]
        pool = ConnectionPool(Dialer(cluster_key, revision, timeout), hosts, max_concurrent)
        await pool.open()
        return cls(head, tokenizer, runner, runs, pool, end_ids, DType[dtype.upper()], chat,
                   config.max_position_embeddings)

    async def __aenter__(self) -> Generator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Let the generations in progress end, then close every connection (the workers free their sessions)."""
        await self.loop.close()
        await self.pool.close()

    @property
    def max_concurrent(self) -> int:
        """Generations that run at once: the connection sets the workers admitted."""
        return self.pool.size

    def encode(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """A prompt's token ids: text is encoded with the tokenizer's own special tokens (BOS where it
        adds one); ids (a chat template's rendering, say) are taken as they are."""
        prompt_tokens = tuple(self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt)
        if not prompt_tokens:
            raise ConfigError("the prompt encodes to no tokens")
        return prompt_tokens

    async def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        on_text: Callable[[str], None] | None = None,
        trace: list[RemoteCall] | None = None,
        halt: asyncio.Event | None = None,
        isolation: tuple[str, ...] | None = None,
        on_token_time: Callable[[float, bool], None] | None = None,
    ) -> Generation:
        """Generate up to `max_tokens` tokens after `prompt` (text or ids, see `encode`), stopping early
        at an end token, or once `halt` is set (checked before each step; a cancelled caller sets it).

        `on_text` gets the text as it grows; `trace`, when given, receives every Batch round trip.
        `isolation`: the key of the clients whose requests may reuse each other's prefixes on the
        workers (connections.py); None: no other request's. `on_token_time` is told each token's
        seconds as it is sampled, and whether it is the first (`SequenceState.on_token_time`).
        """
        if max_tokens < 1:
            raise ConfigError(f"max tokens must be at least 1, got {max_tokens}")
        prompt_tokens = self.encode(prompt)
        sequence = SequenceState(prompt_tokens, max_tokens, Sampler(sampling), Detokenizer(self.tokenizer, prompt_tokens),
                                 isolation, on_text, on_token_time, halt if halt is not None else asyncio.Event(),
                                 trace)
        self.loop.submit(sequence)
        try:
            return await asyncio.shield(sequence.done)
        except asyncio.CancelledError:
            sequence.halt.set()  # it leaves the loop at the next step
            raise

    def _ended(self, sequence: SequenceState) -> None:
        """The step loop's news of a request that left: its Generation, or what failed it."""
        done = sequence.done
        done.add_done_callback(lambda future: future.cancelled() or future.exception())  # a caller may be gone
        if sequence.failed is not None:
            done.set_exception(sequence.failed)
            return
        tail = sequence.detokenizer.flush()  # a tail that waited for a character's last byte
        if tail and sequence.on_text is not None:
            sequence.on_text(tail)
        tokens = tuple(sequence.tokens)
        stopped = bool(tokens) and tokens[-1] in self.eos_ids
        halted = not stopped and len(tokens) < sequence.max_tokens
        done.set_result(Generation(sequence.prompt, tokens, sequence.detokenizer.text, tuple(sequence.latencies),
                                   stopped, halted, sequence.waited))

def _vocabulary(checkpoint: WeightSource) -> tuple[Tokenizer, frozenset[int], ChatTemplate | None]:
    """The tokenizer, the ids that end a generation and the chat template, from where the checkpoint's
    container keeps them (one row of _VOCABULARIES each)."""
    return _VOCABULARIES[checkpoint.container](checkpoint)


def _file_vocabulary(checkpoint: GgufCheckpoint) -> tuple[Tokenizer, frozenset[int], ChatTemplate | None]:
    """A GGUF file's: its metadata, from the header the checkpoint parsed."""
    gguf = checkpoint.file
    tokenizer = gguf_tokenizer(gguf)
    return tokenizer, gguf_eos_ids(gguf), gguf_chat_template(gguf, tokenizer)


def _directory_vocabulary(checkpoint: Checkpoint) -> tuple[Tokenizer, frozenset[int], ChatTemplate | None]:
    """A checkpoint directory's: its tokenizer.json and configs."""
    model = checkpoint.dir
    tokenizer = _tokenizer(model / "tokenizer.json")
    return tokenizer, end_token_ids(model, tokenizer), ChatTemplate.load(model, tokenizer)


_VOCABULARIES: dict[Container, Callable] = {DIRECTORY: _directory_vocabulary, GGUF: _file_vocabulary}


def _tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises plain Exception for a bad file
        raise CheckpointError(f"{path} is not a usable tokenizer: {exc}") from None

