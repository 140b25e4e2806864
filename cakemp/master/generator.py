"""Text generation as Cake's master does it, over workers reached through `WorkerClient`.

The master holds the embeddings, final norm and lm_head (`Head`) and the tokenizer. For each
decoder layer it asks the topology who serves it: a layer named by no node runs here, in
cakemp's own blocks; a remote layer gets its own connection, as Cake opens one per remote
layer and says Hello on each. Each step walks the layers in order and sends every maximal run
of consecutive layers on one worker as one `Batch`, on the connection of the run's first
layer (docs/models.md, Grouping layers into a Batch). The prompt is one prefill at position 0, then one token per step;
after the last step every connection gets `Goodbye`, which clears the workers' caches so the
next generation prefills afresh (a worker that keeps retired prefixes answers the rows it kept
for the same prefix). A generation ends at `max_tokens`, at an end token (`chat.end_token_ids`),
or once the caller sets its `halt` event (a stop string, a client gone): after the step in
flight, so the connections stay in step with the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
from tokenizers import Tokenizer

from cakemp.checkpoint.files import DIRECTORY, GGUF, Container
from cakemp.compute.runner import BlockRunner
from cakemp.compute.tensors import compute_dtype, from_raw, to_raw
from cakemp.errors import CakempError, CheckpointError, ConfigError
from cakemp.master.address import dial
from cakemp.master.chat import ChatTemplate, end_token_ids
from cakemp.master.client import WorkerClient
from cakemp.master.gguf_tokenizer import gguf_chat_template, gguf_eos_ids, gguf_tokenizer
from cakemp.master.sampler import Sampler, SamplingParams
from cakemp.model.head import Head
from cakemp.model.weights.gguf import GgufCheckpoint
from cakemp.model.weights.readers import open_checkpoint
from cakemp.model.weights.safetensors import Checkpoint
from cakemp.model.weights.source import WeightSource
from cakemp.op import Op
from cakemp.topology import Topology
from cakemp.wire import DType, LayerOp, Revision

# The local runner's one session: generations run one after another on a Generator.
_SESSION = 0


@dataclass(frozen=True)
class LayerRun:
    """Consecutive layers computed in one place: `host` ("host:port"), or here when None."""

    host: str | None
    layers: tuple[tuple[str, int], ...]  # (layer name, block index), in model order


@dataclass(frozen=True)
class RemoteCall:
    """One Batch round trip as the master saw it (kept on request: the demo replays them)."""

    host: str
    ops: tuple[LayerOp, ...]
    x: torch.Tensor  # [1, T, H] sent
    y: torch.Tensor  # [1, T, H] received


@dataclass(frozen=True)
class Generation:
    """What one `generate` produced, and how fast."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]  # generated ids, the EOS that ended it included
    text: str  # the generated text, EOS excluded
    latencies: tuple[float, ...]  # seconds per generated token; the first one includes the prefill
    stopped_at_eos: bool
    halted: bool = False  # ended because the caller set `halt`

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


@dataclass(frozen=True)
class Dialer:
    """How the master reaches its workers: the cluster's key, the protocol revision, the connect timeout."""

    cluster_key: str | None = None
    revision: Revision = Revision.V2
    timeout: float = 10.0

    async def connect(self, runs: Sequence[LayerRun]) -> dict[int, WorkerClient]:
        """A connection per remote layer (block index → it), each said Hello, one after another in layer
        order as Cake connects; none is left open when one fails."""
        clients: dict[int, WorkerClient] = {}
        try:
            for run in runs:
                if run.host is None:
                    continue
                for _, index in run.layers:
                    clients[index] = await dial(run.host, cluster_key=self.cluster_key, revision=self.revision,
                                                timeout=self.timeout)
                    await clients[index].hello()
        except BaseException:
            for client in clients.values():
                await client.close()
            raise
        return clients


class Generator:
    """A master for one checkpoint and topology: open it, generate any number of times, close it."""

    def __init__(
        self,
        head: Head,
        tokenizer: Tokenizer,
        runner: BlockRunner | None,
        runs: tuple[LayerRun, ...],
        clients: dict[int, WorkerClient],
        eos_ids: frozenset[int],
        wire_dtype: DType,
        chat: ChatTemplate | None = None,
        context_length: int | None = None,
        dialer: Dialer = Dialer(),
    ) -> None:
        self.head = head
        self.tokenizer = tokenizer
        self.runner = runner
        self.runs = runs
        # Each local run's layers as (index in the runner's layers, block_idx): names translated once.
        self._local = {run: [(runner.layers.index(name), index) for name, index in run.layers]
                       for run in runs if run.host is None} if runner is not None else {}
        self.clients = clients  # block index → its connection, one per remote layer
        self.eos_ids = eos_ids
        self.wire_dtype = wire_dtype
        self.chat = chat  # the checkpoint's chat template; None for a model without one
        self.context_length = context_length  # positions the model takes (max_position_embeddings)
        self.dialer = dialer

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
    ) -> Generator:
        """Load the master's weights and local layers, then connect to every remote layer. `keep_int4`:
        the local layers' 4-bit matrices stay int4 where torch's int4 matmul takes them (BlockRunner.load)."""
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
        dialer = Dialer(cluster_key, revision, timeout)
        clients = await dialer.connect(runs)
        return cls(head, tokenizer, runner, runs, clients, end_ids, DType[dtype.upper()], chat,
                   config.max_position_embeddings, dialer)

    async def __aenter__(self) -> Generator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection (the workers free their sessions)."""
        for client in self.clients.values():
            await client.close()

    async def reconnect(self) -> None:
        """Close every connection and connect afresh, as `open` did: after a connection broke (a worker
        restarted, say), so that the next generation starts on connections in step with the workers."""
        await self.close()
        self.clients = {}
        self.clients = await self.dialer.connect(self.runs)

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
    ) -> Generation:
        """Generate up to `max_tokens` tokens after `prompt` (text or ids, see `encode`), stopping early
        at an end token, or once `halt` is set (checked before each step).

        `on_text` gets the text as it grows; `trace`, when given, receives every Batch round trip.
        """
        if max_tokens < 1:
            raise ConfigError(f"max tokens must be at least 1, got {max_tokens}")
        prompt_tokens = self.encode(prompt)
        sampler = Sampler(sampling)
        tokens: list[int] = []
        latencies: list[float] = []
        shown = ""  # the text handed to on_text so far
        index_pos = 0
        feed = list(prompt_tokens)
        try:
            while len(tokens) < max_tokens and not (halt is not None and halt.is_set()):
                start = time.perf_counter()
                x = await self._forward(self.head.embed(feed), index_pos, trace)  # [1, T, H]
                token = sampler.sample(self.head.logits(x), tokens)
                latencies.append(time.perf_counter() - start)
                index_pos += len(feed)
                tokens.append(token)
                if token in self.eos_ids:
                    break
                shown = self._stream(tokens, shown, on_text)
                feed = [token]
        except BaseException:
            # Cake says Goodbye after a failed request too; a broken connection must not hide
            # the error that broke the request.
            with contextlib.suppress(CakempError, OSError):
                await self._goodbye()
            raise
        await self._goodbye()
        stopped = bool(tokens) and tokens[-1] in self.eos_ids
        text = self.tokenizer.decode(tokens[:-1] if stopped else tokens)
        if on_text is not None and text.startswith(shown) and len(text) > len(shown):
            on_text(text[len(shown):])  # a tail that waited for a character's last byte
        halted = not stopped and len(tokens) < max_tokens
        return Generation(prompt_tokens, tuple(tokens), text, tuple(latencies), stopped, halted)

    async def _forward(self, x: torch.Tensor, index_pos: int, trace: list[RemoteCall] | None) -> torch.Tensor:
        """x [1, T, H] at positions index_pos.. through every layer -> [1, T, H]."""
        for run in self.runs:
            if run.host is None:
                x = self.runner.run(_SESSION, x, [Op(local, index_pos, index) for local, index in self._local[run]])
                continue
            ops = tuple(LayerOp(name, index_pos, index) for name, index in run.layers)
            reply = await self.clients[run.layers[0][1]].batch(to_raw(x, self.wire_dtype), ops)
            y = from_raw(reply).to(self.head.device, self.head.dtype)
            if trace is not None:
                trace.append(RemoteCall(run.host, ops, x, y))
            x = y
        return x

    def _stream(self, tokens: list[int], shown: str, on_text: Callable[[str], None] | None) -> str:
        """Hand `on_text` what the text gained with the last token; the text shown so far after.

        Byte-level tokens can end inside a UTF-8 character, which decodes to U+FFFD: such a tail
        waits for the token that completes it.
        """
        text = self.tokenizer.decode(tokens)
        if text.endswith("\ufffd") or not text.startswith(shown):
            return shown
        if on_text is not None and len(text) > len(shown):
            on_text(text[len(shown):])
        return text

    async def _goodbye(self) -> None:
        """End the request as Cake does: Goodbye on every remote layer's connection, in layer order."""
        if self.runner is not None:
            self.runner.free_session(_SESSION)
        for index in sorted(self.clients):
            await self.clients[index].goodbye()


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

