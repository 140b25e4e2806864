"""Text generation as Cake's master does it, over workers reached through `WorkerClient`.

The master holds the embeddings, final norm and lm_head (`Head`) and the tokenizer. For each
decoder layer it asks the topology who serves it: a layer named by no node runs here, in
cakemp's own blocks; a remote layer gets its own connection, as Cake opens one per remote
layer and says Hello on each. Each step walks the layers in order and sends every maximal run
of consecutive layers on one worker as one `Batch`, on the connection of the run's first
layer (spec cake-model §5.2). The prompt is one prefill at position 0, then one token per step;
after the last step every connection gets `Goodbye`, which clears the workers' caches so the
next generation prefills afresh.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
from tokenizers import Tokenizer

from cakemp.compute.runner import BlockRunner
from cakemp.compute.tensors import compute_dtype, from_raw, to_raw
from cakemp.errors import CakempError, CheckpointError, ConfigError
from cakemp.master.address import dial
from cakemp.master.client import WorkerClient
from cakemp.master.gguf_tokenizer import gguf_eos_ids, gguf_tokenizer
from cakemp.master.sampler import Sampler, SamplingParams
from cakemp.checkpoint.config import ModelConfig
from cakemp.checkpoint.files import is_gguf
from cakemp.checkpoint.gguf import GgufFile
from cakemp.model.head import Head
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
    ) -> Generator:
        """Load the master's weights and local layers, then connect to every remote layer."""
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        torch_dtype = compute_dtype(dtype)
        tokenizer, eos_ids = _vocabulary(model_dir)
        head = Head.load(model_dir, config, device, torch_dtype)
        names = [config.layer_name(i) for i in range(config.num_hidden_layers)]
        runs = plan_runs(names, layer_hosts(topology))
        local = [name for run in runs if run.host is None for name, _ in run.layers]
        runner = BlockRunner.load(model_dir, local, device, torch_dtype) if local else None
        clients: dict[int, WorkerClient] = {}
        try:
            # Cake connects to the remote layers one after another, in layer order.
            for run in runs:
                if run.host is None:
                    continue
                for _, index in run.layers:
                    client = await dial(run.host, cluster_key=cluster_key, revision=revision, timeout=timeout)
                    clients[index] = client
                    await client.hello()
        except BaseException:
            for client in clients.values():
                await client.close()
            raise
        return cls(head, tokenizer, runner, runs, clients, eos_ids, DType[dtype.upper()])

    async def __aenter__(self) -> Generator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection (the workers free their sessions)."""
        for client in self.clients.values():
            await client.close()

    async def generate(
        self,
        prompt: str,
        max_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        on_text: Callable[[str], None] | None = None,
        trace: list[RemoteCall] | None = None,
    ) -> Generation:
        """Generate up to `max_tokens` tokens after `prompt`, stopping early at EOS.

        The prompt is encoded with the tokenizer's own special tokens (BOS where it adds one).
        `on_text` gets the text as it grows; `trace`, when given, receives every Batch round trip.
        """
        if max_tokens < 1:
            raise ConfigError(f"max tokens must be at least 1, got {max_tokens}")
        prompt_tokens = tuple(self.tokenizer.encode(prompt).ids)
        if not prompt_tokens:
            raise ConfigError("the prompt encodes to no tokens")
        sampler = Sampler(sampling)
        tokens: list[int] = []
        latencies: list[float] = []
        shown = ""  # the text handed to on_text so far
        index_pos = 0
        feed = list(prompt_tokens)
        try:
            while len(tokens) < max_tokens:
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
        return Generation(prompt_tokens, tuple(tokens), text, tuple(latencies), stopped)

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


def _vocabulary(model: Path) -> tuple[Tokenizer, frozenset[int]]:
    """The tokenizer and the ids that end a generation: a GGUF file's metadata, or a checkpoint
    directory's tokenizer.json and config.json."""
    if is_gguf(model):
        gguf = GgufFile(model)
        return gguf_tokenizer(gguf), gguf_eos_ids(gguf)
    return _tokenizer(model / "tokenizer.json"), _eos_ids(model)


def _tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises plain Exception for a bad file
        raise CheckpointError(f"{path} is not a usable tokenizer: {exc}") from None


def _eos_ids(model_dir: Path) -> frozenset[int]:
    """The ids that end a generation: config.json's `eos_token_id` (one id or a list)."""
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
