"""The master's step loop: every running request advanced by one step at a time, together.

Requests join and leave at step boundaries, as continuous batching does (vLLM, SGLang). Up to the
pool's size run at once, each on its own `ConnectionSet` (connections.py); the rest wait in
arrival order. A request given a place whose set must be dialed still waits, while the pool dials
it in the background: it joins the running ones at the first step boundary after its set is
ready, and no step waits for a dial. Each step:

* gathers every running request's next input: a chunk of its prompt (at most `PROMPT_CHUNK`
  tokens, so a long prompt neither stalls the others' decode steps nor waits for them) or its
  last sampled token;
* walks the layer runs in order: a run of the master's own layers computes every request at once
  (`BlockRunner.run_batch`: one pass over the weights), in a thread, so the event loop stays free
  (torch releases the GIL); a remote run sends each request's Batch on its own connection, all at
  once, so that they land in the same step of the worker, which batches them too;
* normalises the last position of every request that ends its prompt or decodes, and projects
  them onto the vocabulary as one matrix product, then samples each with its own sampler (seed,
  temperature, top-p): in the same thread.

Where a step's time goes is summed in `StepLoop.spent` (StepTimes), a few clock reads a step:
/metrics shows it.

A request whose `halt` is set (a stop string, a client gone), that sampled an end token or its
`max_tokens`, or whose step failed, leaves before the next step: its set says Goodbye (in the
background, the others step on) and goes back to the pool; a connection that broke is closed
instead, and the pool dials afresh. A worker's own error (WorkerError) fails that request alone,
as a failed dial fails the request it was for. A waiting request whose `halt` is set leaves at
the next step boundary, or within `IDLE_CHECK_S` while none runs, its dial left to the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cakemp.compute.runner import BlockRunner, Request
from cakemp.compute.tensors import from_raw, to_raw
from cakemp.errors import RemoteWorkerError
from cakemp.master.connections import ConnectionPool, ConnectionSet
from cakemp.master.detokenizer import Detokenizer
from cakemp.master.sampler import Sampler
from cakemp.model.head import Head
from cakemp.op import Op
from cakemp.wire import DType, LayerOp

# Prompt tokens a request computes in one step at most: its prompt joins the running decodes as
# chunks. A lone request's prompt up to this long is one prefill, as before.
PROMPT_CHUNK = 256
# While no request runs, the longest the loop sleeps before it looks again for waiting requests that
# left (their `halt` is an Event nobody tells the loop of); a ready set, a Goodbye that freed a place or
# a new request wakes it at once.
IDLE_CHECK_S = 0.05


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


@dataclass
class StepTimes:
    """Seconds the step loop spent, summed over its steps. `loop` is its whole wall time while requests
    ran or waited; the others are parts of it: what is left is the event loop's own (embedding,
    detokenizing, handing work to threads and back, and the HTTP tasks that ran between)."""

    steps: int = 0
    loop: float = 0.0
    local_layers: float = 0.0  # the master's own layers, in their thread
    head: float = 0.0  # final norm, lm_head and sampling, in their thread
    workers: float = 0.0  # from sending the Batches of a remote run to its last reply


@dataclass(eq=False)
class SequenceState:
    """One request in the loop: its prompt, what it generated, where it is."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampler: Sampler
    detokenizer: Detokenizer
    key: tuple[str, ...] | None  # its isolation key (connections.py); None: it named none
    on_text: Callable[[str], None] | None = None
    # Told each token's seconds as it is sampled, and whether it is the first (then from the request's
    # arrival, its wait included; later ones from the token before): /metrics sees a stream that runs.
    on_token_time: Callable[[float, bool], None] | None = None
    halt: asyncio.Event | None = None
    trace: list[RemoteCall] | None = None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    tokens: list[int] = field(default_factory=list)  # sampled ids, an end token included
    taking: asyncio.Future[ConnectionSet] | None = None  # its set, from the pool, once it has a place
    connections: ConnectionSet | None = None  # its set, once it runs
    position: int = 0  # positions computed so far
    latencies: list[float] = field(default_factory=list)  # seconds per sampled token
    since: float = field(default_factory=time.perf_counter)  # when the latency of its next token began
    waited: float = 0.0  # seconds it waited for a place in the loop
    failed: BaseException | None = None
    broken: bool = False  # its failure broke a connection: the set is closed, not kept

    @property
    def halted(self) -> bool:
        return self.halt is not None and self.halt.is_set()

    def next_input(self) -> list[int]:
        """A chunk of the prompt while some is left to compute, else the last sampled token."""
        if self.position < len(self.prompt):
            return list(self.prompt[self.position:self.position + PROMPT_CHUNK])
        return [self.tokens[-1]]

    def samples(self, fed: int) -> bool:
        """Whether the step that feeds it `fed` tokens ends with a token sampled (not a mid-prompt chunk)."""
        return self.position + fed >= len(self.prompt)

    def sampled(self, token: int, now: float, end: bool) -> None:
        """`token` sampled at `now`: its latency recorded and told, its text (none for an end token) shown."""
        latency = now - self.since
        self.since = now
        self.latencies.append(latency)
        self.tokens.append(token)
        if self.on_token_time is not None:
            first = len(self.latencies) == 1
            self.on_token_time(self.waited + latency if first else latency, first)
        if not end:
            piece = self.detokenizer.add(token)
            if piece and self.on_text is not None:
                self.on_text(piece)

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.broken = not isinstance(exc, RemoteWorkerError)


class StepLoop:
    """Runs requests over `runs` (the master's own layers in `runner`), at most the pool's size at once."""

    def __init__(self, head: Head, runner: BlockRunner | None, runs: Sequence[LayerRun], pool: ConnectionPool,
                 eos_ids: frozenset[int], wire_dtype: DType, ended: Callable[[SequenceState], None]) -> None:
        self.head, self.runner, self.runs, self.pool = head, runner, tuple(runs), pool
        # Each local run's layers as (index in the runner's layers, block_idx): names translated once.
        self._local = {run: [(runner.layers.index(name), index) for name, index in run.layers]
                       for run in self.runs if run.host is None} if runner is not None else {}
        self.eos_ids, self.wire_dtype = eos_ids, wire_dtype
        self._ended = ended  # told of each request as it leaves, before its future resolves
        self.waiting: deque[SequenceState] = deque()  # in arrival order, until their sets are ready
        self.running: list[SequenceState] = []
        self._task: asyncio.Task | None = None
        self._leaving: set[asyncio.Task] = set()  # Goodbyes in flight
        self._news = asyncio.Event()  # set when a request came, a set is ready or a Goodbye freed a place
        self.spent = StepTimes()

    def submit(self, sequence: SequenceState) -> None:
        """Queue `sequence`; the loop runs while any request runs or waits."""
        self.waiting.append(sequence)
        self._news.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Wait for the loop to finish its requests (halting none), then for their Goodbyes."""
        if self._task is not None:
            await self._task
        if self._leaving:
            await asyncio.gather(*self._leaving, return_exceptions=True)

    async def _loop(self) -> None:
        while self.waiting or self.running:
            started = time.perf_counter()
            self._news.clear()  # before _admit looks: news from then on wakes an idle loop
            self._admit()
            if self.running:
                await self._step(self.running)
                self.spent.steps += 1
            else:
                await self._idle()
            self._retire()
            await asyncio.sleep(0)  # a step without an await (every layer local, every request halted) yields
            self.spent.loop += time.perf_counter() - started

    def _admit(self) -> None:
        """Waiting requests take places in arrival order, while the pool has one (each its set at once, or
        dialed); those whose sets are ready join the running ones, and those that left go (one that left
        before its set was ready gave the cluster no work)."""
        for sequence in self.waiting:
            if sequence.taking is None and not sequence.halted:
                if not self.pool.free:
                    break
                sequence.taking = self.pool.take(sequence.key)
                sequence.taking.add_done_callback(lambda _: self._news.set())
        still_waiting: deque[SequenceState] = deque()
        for sequence in self.waiting:
            if sequence.taking is not None and sequence.taking.done():
                self._join(sequence)
            elif sequence.halted:
                if sequence.taking is not None:
                    sequence.taking.cancel()  # the pool keeps the set it dials for the next request
                self._finish(sequence)
            else:
                still_waiting.append(sequence)
        self.waiting = still_waiting

    def _join(self, sequence: SequenceState) -> None:
        """`sequence`'s set is ready: it runs from the next step, unless it left or its dial failed (the
        workers cannot be reached: this request fails, the next dials again)."""
        try:
            sequence.connections = sequence.taking.result()
        except Exception as exc:
            sequence.fail(exc)
            self._finish(sequence)
            return
        if sequence.halted:
            self._finish(sequence)
            return
        now = time.perf_counter()
        sequence.since, sequence.waited = now, now - sequence.since
        self.running.append(sequence)

    async def _idle(self) -> None:
        """No request runs: wait for news, or `IDLE_CHECK_S`."""
        try:
            await asyncio.wait_for(self._news.wait(), IDLE_CHECK_S)
        except TimeoutError:
            pass

    async def _step(self, running: list[SequenceState]) -> None:
        """One step of every running request (what each sampled, or why it failed, recorded on it)."""
        feeds = [sequence.next_input() for sequence in running]
        xs: list[torch.Tensor | None] = [self.head.embed(feed) for feed in feeds]  # [1, T, H] each
        for run in self.runs:
            live = [i for i, x in enumerate(xs) if x is not None]
            if not live:
                return
            if run.host is None:
                outputs = await asyncio.to_thread(self._run_local, run, [running[i] for i in live],
                                                  [xs[i] for i in live])
            else:
                sent = time.perf_counter()
                outputs = await asyncio.gather(*(self._run_remote(run, running[i], xs[i]) for i in live),
                                               return_exceptions=True)
                self.spent.workers += time.perf_counter() - sent
            for i, output in zip(live, outputs, strict=True):
                if isinstance(output, BaseException):
                    running[i].fail(output)
                    xs[i] = None
                else:
                    xs[i] = output
        sampling = [(sequence, x) for sequence, x, feed in zip(running, xs, feeds, strict=True)
                    if x is not None and sequence.samples(len(feed))]
        tokens = await asyncio.to_thread(self._sample, sampling) if sampling else []
        for sequence, feed, x in zip(running, feeds, xs, strict=True):
            if x is not None:
                sequence.position += len(feed)
        now = time.perf_counter()
        for (sequence, _), token in zip(sampling, tokens, strict=True):
            sequence.sampled(token, now, token in self.eos_ids)  # an end token is never text

    def _run_local(self, run: LayerRun, sequences: list[SequenceState], xs: list[torch.Tensor]) -> list:
        """The master's own layers of `run` for every request at once (in a thread): outputs or exceptions."""
        started = time.perf_counter()
        requests = [Request(sequence.connections.session, x,
                            [Op(local, sequence.position, index) for local, index in self._local[run]])
                    for sequence, x in zip(sequences, xs, strict=True)]
        outputs = self.runner.run_batch(requests)
        self.spent.local_layers += time.perf_counter() - started  # the loop awaits this thread: no race
        return outputs

    async def _run_remote(self, run: LayerRun, sequence: SequenceState, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, H] through a worker's run, on the request's own connection -> [1, T, H]."""
        ops = tuple(LayerOp(name, sequence.position, index) for name, index in run.layers)
        reply = await sequence.connections.clients[run.layers[0][1]].batch(to_raw(x, self.wire_dtype), ops)
        y = from_raw(reply).to(self.head.device, self.head.dtype)
        if sequence.trace is not None:
            sequence.trace.append(RemoteCall(run.host, ops, x, y))
        return y

    def _sample(self, sampling: list[tuple[SequenceState, torch.Tensor]]) -> list[int]:
        """Each request's next token: the final norm and lm_head over every last position at once
        ([B, H] -> [B, V]), then each request's own sampler (in a thread)."""
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self.head.project(torch.stack([x[0, -1] for _, x in sampling]))  # [B, H] -> [B, V]
            tokens = [sequence.sampler.sample(row, sequence.tokens) for (sequence, _), row in zip(sampling, logits)]
        self.spent.head += time.perf_counter() - started
        return tokens

    def _retire(self) -> None:
        """Every request that is done leaves now: halted, failed, at an end token or its max_tokens."""
        staying = []
        for sequence in self.running:
            tokens = sequence.tokens
            if sequence.failed is not None or sequence.halted or len(tokens) >= sequence.max_tokens or \
                    (tokens and tokens[-1] in self.eos_ids):
                self._finish(sequence)
            else:
                staying.append(sequence)
        self.running = staying

    def _finish(self, sequence: SequenceState) -> None:
        """Tell the request it ended; its set says Goodbye (or is closed) in the background."""
        connections = sequence.connections
        if connections is not None:
            if self.runner is not None:
                self.runner.free_session(connections.session)
            task = asyncio.create_task(self.pool.give_back(connections, sequence.broken))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
            task.add_done_callback(lambda _: self._news.set())  # its place is free
        self._ended(sequence)
