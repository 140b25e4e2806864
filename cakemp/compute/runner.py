"""The compute of one device: its loaded layers and its sessions' KV caches.

A plain class (no process, no socket) so tests and benchmarks call it directly; the device
process wraps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from cakemp.checkpoint.config import ModelConfig
from cakemp.compute import memory, tensors
from cakemp.compute.decode_graph import DecodeGraphs, capturable
from cakemp.compute.fair_share import FairShare
from cakemp.compute.kv_cache import KVCache, KVSlot
from cakemp.compute.loading import Block, LoadPlan, Rounding, check_quantizable, kept_kernels
from cakemp.compute.paged_step import StepRows, in_place_attention
from cakemp.compute.prefix_cache import Begun, PrefixCache
from cakemp.errors import InternalError, PositionGap, RecurrentRewind, UnknownLayer
from cakemp.model.block import MATRICES
from cakemp.model.deltanet import LinearState
from cakemp.model.rotary import Rotary
from cakemp.model.weights import packed
from cakemp.model.weights.experts import ExpertCache
from cakemp.model.weights.readers import open_checkpoint
from cakemp.op import Op, Ops

# Ops between two calls of run_batch's `between_ops` (the device's progress reports).
_OPS_BETWEEN_CALLS = 16


class Request(NamedTuple):
    """One request of a batch: its session, its activation x: [1, T, H], and its ops in order
    (`Op.layer` indexes the runner's `layers`; as `Ops`, columns, they are read as they are, any other
    sequence of Op is read into them); `data`, x's bytes on the host where the caller holds them (a
    device, as it received them): prefix reuse names rows by them, else by a copy of x's."""

    session: int
    x: torch.Tensor
    ops: Sequence[Op]
    data: memoryview | None = None
    # A piece of a longer request (a prompt cut into chunks): its rows from its first to that request's end
    # (0: x is all of it). Longrope picks its factors by where the whole request ends, as it would computed whole.
    to_end: int = 0


X = TypeVar("X", contravariant=True)  # what a runner's request is made of: the activation as the device holds it
R = TypeVar("R")  # a runner's request: BlockRunner's Request, ComponentRunner's Call (compute/components.py)


class Runner(Protocol[X, R]):
    """What a device service calls of the compute it serves: BlockRunner (a text model's layers,
    below: `Runner[torch.Tensor, Request]`) and ComponentRunner (an image model's components,
    compute/components.py: `Runner[RawTensor, Call]`) implement it. Each declares its request and
    how one is made from a hop's activation and ops, so the service hands requests on unread."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype
    prefixes: PrefixCache | None  # the rows prefix reuse keeps, and its counts (None: no reuse)
    expert_cache: ExpertCache | None  # what holds offloaded MoE experts, and its counts (None: none offloaded)
    weight_bytes: int | None  # the bytes its weights hold (None: not counted, an image model's components)

    def request(self, session: int, x: X, ops: Sequence[Op], data: memoryview | None = None, to_end: int = 0) -> R:
        """The request of `session` computing `ops` over `x`; `data`: x's own bytes on the host, as
        received, where the caller has them (x's dtype and shape as they are); `to_end`: where x is a
        piece of a request, the rows from its first to that request's end (0: x is all of it)."""

    def run_batch(self, requests: Sequence[R], between_ops: Callable[[], None] | None = None,
                  together: Callable[[Sequence[int]], None] | None = None) -> list[torch.Tensor | Exception]:
        """Each request's result, in order, or the exception that failed it alone; `between_ops` is
        called now and then while a long step computes, `together` with the indices of each set of
        requests computed as one batch, before it computes (the device reports it in its answers)."""

    def clear_session(self, session: int) -> None:
        """Goodbye: the session starts afresh (what it ran may be kept for reuse)."""

    def free_session(self, session: int) -> None:
        """The session's connection closed: nothing of it is kept."""

    def kv_bytes(self) -> int:
        """Bytes of session state held."""

    def sessions(self) -> Set[int]:
        """The sessions holding state."""


@dataclass(slots=True)
class _Planned:
    """A request checked and given its slots, and what it changes as it runs."""

    session: int
    x: torch.Tensor  # [1, T, H]
    ops: Ops
    run: tuple[tuple[int, int], ...]  # each op's (layer, block_idx): requests of one run compute together
    slots: dict[int, KVSlot]  # block_idx -> the session's attention slot (those of `writes` among them)
    writes: dict[int, tuple[int, int]]  # block_idx -> the rows [start, end) its ops write in that slot
    begun: Begun | None = None  # as prefix reuse took it: `x` and `ops` are then its rows still to compute
    beyond: int = 0  # a piece of a longer request: that request's rows past this piece's end (Request.to_end)
    computed: dict[int, tuple[LinearState, int]] = field(default_factory=dict)  # block_idx -> (new state, consumed)

    def answer(self, computed: torch.Tensor | None) -> torch.Tensor:
        """The request's output [1, T, H]: the rows prefix reuse kept, then the `computed` ones
        from the request's first position on."""
        begun = self.begun
        if begun is None:
            return computed
        if computed is None:
            return begun.kept
        if begun.kept is not None:
            return torch.cat([begun.kept, computed], dim=1)
        return computed[:, max(0, begun.extension.start - begun.resume):]

    def linear_state(self, cache: KVCache, block_idx: int, index_pos: int) -> LinearState | None:
        """The state a linear-attention op starts from: none at position 0, else this request's
        own latest for the slot, else the session's."""
        if index_pos == 0:
            return None
        if block_idx in self.computed:
            return self.computed[block_idx][0]
        slot = cache.linear_slot(self.session, block_idx)
        return LinearState(slot.conv, slot.recurrent)

    def roll_back(self) -> None:
        # A slot falls back to the first row the request writes (at most what was cached: the plan
        # checks it); rows past it are unused, and those a rewind overwrote are lost.
        for block_idx, (start, _) in self.writes.items():
            self.slots[block_idx].length = start
        self.computed.clear()  # the new linear states were never installed

    def install(self, cache: KVCache) -> None:
        for block_idx, (state, consumed) in self.computed.items():
            cache.linear_slot(self.session, block_idx).install(state.conv, state.recurrent, consumed)


class _RunLayers(NamedTuple):
    """What a run of ops (each op's (layer, block_idx)) asks of this runner's layers, worked out once
    for the steps that repeat it (a master sends one run step after step)."""

    run: tuple[tuple[int, int], ...]
    layers: tuple[int, ...]  # each op's layer
    slots: tuple[int, ...]  # each op's block_idx
    linear: bool  # whether it has a linear-attention layer
    attention: dict[int, int]  # the index of each attention layer's op -> its index among them
    blocks: tuple[Block, ...]  # each op's layer
    rotaries: tuple[Rotary | None, ...]  # ... and its rotary
    capturable: bool  # whether a graph holds every one of its layers (compute/decode_graph.py)


class _Decode(NamedTuple):
    """A one-row request whose KV slots hold its row already, or were given the block it opens
    (KVCache.continuing): nothing else to reserve, nothing to install, so it joins its group as it is."""

    x: torch.Tensor  # [1, 1, H]
    run: tuple[tuple[int, int], ...]
    position: int  # every op's index_pos
    slots: list[KVSlot]  # each op's
    begun: Begun | None  # as prefix reuse took it (every row still to compute)


@dataclass(slots=True)
class _Group:
    """The step's requests of one run, computed together, as columns: one entry per request, in the order
    they joined. A decode whose KV slots hold its row already (`_Decode`: most of a decode step) is these
    entries alone, and prefix reuse's take of it; any other request (a prompt chunk, a new block, rows
    prefix reuse kept, a linear-attention layer) has its `_Planned` too."""

    run: tuple[tuple[int, int], ...]
    indices: list[int] = field(default_factory=list)  # each request's index in the step
    sessions: list[int] = field(default_factory=list)
    xs: list[torch.Tensor] = field(default_factory=list)  # [1, T, H] each
    starts: list[int | tuple[int, ...]] = field(default_factory=list)  # each request's index_pos: one for all its ops, or each op's
    slots: list[Sequence[KVSlot | None]] = field(default_factory=list)  # ... its KV slot of each op (None: linear)
    planned: list[_Planned | None] = field(default_factory=list)  # ... its plan, if it was planned on its own
    begun: list[Begun | None] = field(default_factory=list)  # ... a joining decode's, as prefix reuse took it

    def add(self, index: int, session: int, x: torch.Tensor, starts: int | tuple[int, ...],
            slots: Sequence[KVSlot | None], planned: _Planned | None = None, begun: Begun | None = None) -> None:
        self.indices.append(index)
        self.sessions.append(session)
        self.xs.append(x)
        self.starts.append(starts)
        self.slots.append(slots)
        self.planned.append(planned)
        self.begun.append(begun)

    def single(self, k: int) -> _Group:
        """Entry k alone."""
        return _Group(self.run, [self.indices[k]], [self.sessions[k]], [self.xs[k]],
                      [self.starts[k]], [self.slots[k]], [self.planned[k]], [self.begun[k]])

    def roll_back(self) -> None:
        """The step failed: a slot falls back to the first row its request writes (at most what it had
        cached), and new linear states are dropped."""
        for starts, slots, planned in zip(self.starts, self.slots, self.planned, strict=True):
            if planned is not None:
                planned.roll_back()
                continue
            for slot in slots:  # a decode's one row, at its index_pos
                slot.length = starts


class BlockRunner:
    """A device's layers (`layers`, in the order ops index them) and its sessions' KV caches."""

    request = Request  # the Runner protocol's: Request(session, x: [1, T, H] on the device, ops)

    def __init__(
        self,
        config: ModelConfig,
        blocks: dict[str, Block],
        device: torch.device,
        dtype: torch.dtype,
        kv_budget_bytes: int | None = None,
        max_context: int | None = None,
        prefix_reuse: bool = False,
        share_prefixes: bool = False,
        expert_cache: ExpertCache | None = None,
        graph_batch: int | None = None,
    ):
        """`prefix_reuse`: keep sessions' rows past their end for requests that send them again
        (compute/prefix_cache.py), reused by the same session only, or by any with `share_prefixes`.
        `expert_cache`: what holds the offloaded experts of the blocks' MoE layers (None: none offloaded).
        `graph_batch`: decode steps of up to this many requests run as fixed-shape steps
        (compute/decode_graph.py), captured as CUDA graphs on a GPU (None: never); with a budget, and
        every layer one a graph holds, the KV pools and the first graphs are made here (`_prepare_graphs`)."""
        self.config = config
        self.expert_cache = expert_cache
        # The bytes its layers' weights hold (kept int4/int8 as such, packed copies too), counted by `load`.
        self.weight_bytes: int | None = None
        self.layers = tuple(blocks)  # Op.layer indexes these
        self.blocks = tuple(blocks.values())
        self.recurrent = tuple(block.recurrent for block in self.blocks)  # a linear-attention layer's state is a recurrence
        self.device = device
        self.dtype = dtype
        # Each layer's rotary (None: the layer has none); layers sharing one share its tables.
        rotaries = {rope: Rotary(rope, device) for rope in set(config.layer_ropes) if rope is not None}
        self.rotaries = tuple(rotaries.get(config.layer_ropes[config.layer_index(layer)]) for layer in self.layers)
        # What each layer's block_idx is counted on from to make its KV slot (0 but for a later stack's layers).
        self.slot_bases = tuple(config.kv_slot(layer, 0) for layer in self.layers)
        self.slots_shifted = any(self.slot_bases)
        self.cache = KVCache(
            config.num_key_value_heads,
            config.head_dim,
            dtype,
            device,
            max_context=max_context or config.max_position_embeddings,
            budget_bytes=kv_budget_bytes,
            linear_shapes=_linear_state_shapes(config),
        )
        self.cache.paged_attend = in_place_attention(device, dtype, config.num_attention_heads // config.num_key_value_heads,
                                                     config.head_dim)
        self.prefixes = PrefixCache(self.cache, [block.recurrent for block in self.blocks], config.hidden_size,
                                    share_prefixes, self._regime()) if prefix_reuse else None
        self.share = FairShare(self.cache, self.free_session)
        self.capturable = tuple(map(capturable, self.blocks))
        self._checked = self._run_layers(())  # the run `_check_run` passed last (none yet)
        self.graphs = None if graph_batch is None else DecodeGraphs(self.cache, graph_batch, device.type == "cuda")
        if self.graphs is not None and kv_budget_bytes is not None and all(self.capturable):
            self._prepare_graphs()

    def _regime(self) -> Callable[[int], bytes] | None:
        """How a request ending at `end` rotates its rows, as prefix reuse tells rows of the same bytes apart:
        which of the layers' longrope rotaries it takes the long factors of (None: no layer has them)."""
        longrope = tuple(dict.fromkeys(rotary for rotary in self.rotaries
                                       if rotary is not None and rotary.long_inv_freq is not None))
        if not longrope:
            return None

        def regime(end: int) -> bytes:
            taken = bytes(rotary.reaches_long(end) for rotary in longrope)
            return taken if any(taken) else b""

        return regime

    def _prepare_graphs(self) -> None:
        """The KV pools of the slots a master names (block_idx N for the layer `…layers.N`) made at their
        shares of the budget, so that no pool grows under a graph, and the decode graphs of the run of all
        this runner's layers made with them (compute/decode_graph.py; every layer is one a graph holds)."""
        run = tuple((j, self.config.layer_index(layer)) for j, layer in enumerate(self.layers))
        self.cache.presize(slot for _, slot in run)
        with torch.inference_mode():  # as a step's: the graphs' buffers are written under it
            self.graphs.prepare(run, self.blocks, self.rotaries, [self.cache.pools[slot] for _, slot in run],
                                self.config.hidden_size, self.dtype)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        layers: Sequence[str],
        device: torch.device | str,
        dtype: torch.dtype,
        kv_budget_bytes: int | None = None,
        max_context: int | None = None,
        on_layer: Callable[[int], None] | None = None,
        pack_weights: bool = True,
        prefix_reuse: bool = False,
        share_prefixes: bool = False,
        keep_int4: bool = True,
        expert_cache_bytes: int | None = None,
        quantize: Rounding | None = None,
        graph_batch: int | None = None,
    ) -> BlockRunner:
        """Load `layers` (e.g. "model.layers.3") of the checkpoint in `model_dir` onto `device`.

        `pack_weights`: on the CPU, keep f32 matrices packed for MKL's GEMM instead of plain where
        that costs at most 1.1x their bytes (model/weights/packed.py): decode steps, batched ones
        most, and prompt chunks then cost less.

        `keep_int4`: keep 4-bit and 8-bit matrices so where torch's int4/int8 matmuls take them
        (compute/loading.kept_kernels); False dequantizes them all (--dequantize-4bit).

        `expert_cache_bytes`: offload MoE layers' routed experts (--expert-offload), read on demand
        into a cache of at most this many bytes (model/weights/experts.py), which the fit check and a
        GPU's default KV budget count in their stead; None: loaded with the layer.

        `quantize` (--quantize): round a plain checkpoint's matrices into kept int8 or int4 weights at
        load (model/weights/rtn.py; the results change); ConfigError for a checkpoint quantized already.
        `graph_batch`: as the constructor's. `on_layer(n)` is called once `n` layers are on the device.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # so x.device compares equal
        checkpoint = open_checkpoint(model_dir)  # and its config, a GGUF file's header parsed once for both
        config = checkpoint.config
        plan = LoadPlan.of(config, checkpoint, layers, offload_experts=expert_cache_bytes is not None)
        kernels = kept_kernels(checkpoint, device, dtype) if keep_int4 else frozenset()
        if quantize is not None:
            check_quantizable(checkpoint, quantize, device, dtype)
        weights = plan.read(checkpoint, device, dtype, on_layer, kernels, quantize, reserved=expert_cache_bytes or 0)
        if pack_weights:
            _pack_matrices(weights)
        cache = ExpertCache(expert_cache_bytes) if plan.offloaded else None
        experts = {} if cache is None else plan.expert_stores(checkpoint, device, dtype, kernels, cache)
        blocks = {
            layer: plan.kinds[layer](config, config.layer_index(layer),
                                     {key: weights[layer, key] for key in plan.groups[layer]} |
                                     ({"experts": experts[layer]} if layer in experts else {}))
            for layer in layers
        }
        if device.type == "cuda" and kv_budget_bytes is None:
            free, total = torch.cuda.mem_get_info(device)
            kv_budget_bytes = memory.default_kv_budget(free - (cache.capacity if cache else 0), total, str(device))
        runner = cls(config, blocks, device, dtype, kv_budget_bytes, max_context, prefix_reuse, share_prefixes, cache, graph_batch)
        runner.weight_bytes = sum(map(_held_bytes, weights.values()))
        return runner

    def ops(self, named: Sequence[tuple[str, int, int]]) -> Ops:
        """(layer name, index_pos, block_idx), ... as this runner's ops, for in-process callers (the
        master's local layers, the demo, benchmarks): names are translated once, here, as the
        front's router translates them for a device. UnknownLayer for a layer not loaded here."""
        index = {layer: i for i, layer in enumerate(self.layers)}
        try:
            return Ops.of((index[layer], index_pos, block_idx) for layer, index_pos, block_idx in named)
        except KeyError as e:
            raise UnknownLayer(f"layer {e.args[0]!r} is not loaded here (this runner has {', '.join(self.layers)})") from None

    def block(self, layer: str) -> Block:
        """The block of layer `layer` (e.g. "model.layers.3"), for tests and benchmarks that look inside."""
        return self.blocks[self.layers.index(layer)]

    def run(self, session: int, x: torch.Tensor, ops: Sequence[Op]) -> torch.Tensor:
        """Run `ops` in order on x: [1, T, H] (one request alone: `run_batch` of one)."""
        (result,) = self.run_batch([Request(session, x, ops)])
        if isinstance(result, Exception):
            raise result
        return result

    def run_batch(
        self, requests: Sequence[Request], between_ops: Callable[[], None] | None = None,
        together: Callable[[Sequence[int]], None] | None = None,
    ) -> list[torch.Tensor | Exception]:
        """Each request's output [1, T, H], or the exception that failed it (and it alone).

        Requests of distinct sessions, each run as `run` would run it alone. Those with the
        same run (the same layers, in the same order and KV slots) are computed together: the
        GEMMs over all their tokens at once (a decode step reads the weights once, not once per
        session), every decode row's attention in one call over its own blocks of each layer's KV
        pool, a prompt chunk's in one of its own (compute/paged_step.py). Runs that differ form
        separate groups, one after another: the runs a master sends are its topology entry's
        layers, so sessions either share a run or share nothing that a merge could exploit.

        index_pos is the absolute position of a request's first token; block_idx picks the KV
        slot (a later stack's counted on after the earlier stacks' slots, ModelConfig.kv_slot: so
        VibeVoice-Realtime's two stacks, both numbered from 0, keep apart). A request at index_pos
        p keeps the first p cached positions of each slot and replaces the rest, so a master that
        restarts a prompt at 0 without Goodbye gets a fresh context rather than Cake's silently
        appended one; a p beyond what is cached is refused.

        A linear-attention layer's state is a recurrence: p must be what it has consumed
        (continue) or 0 (start afresh); anything else is a RecurrentRewind. Each request is
        checked before anything runs, and new linear states are installed only once the
        request's every op has succeeded, so a failed request leaves them as they were
        (attention slots fall back to their old length, or to index_pos if less). An error
        while a group computes fails that group's requests; the other groups are untouched.

        With prefix reuse, a request re-sending rows a session had computed is answered them
        from what was kept and computes only the rest (compute/prefix_cache.py); a request kept
        whole computes nothing.

        `between_ops` is called every few ops of a long run (the device reports progress there);
        `together` once with every request's index: the step is one batch, its groups layer by layer.

        What a request may ask for (its shape, its layers, its KV slots) the front's admission
        has judged; a request that breaks that contract fails with InternalError, a bug here.
        """
        sessions = [request.session for request in requests]
        if len(set(sessions)) != len(sessions):
            raise ValueError(f"a batch holds one request per session, got sessions {sessions}")
        if together is not None:
            together(range(len(requests)))
        results: list[torch.Tensor | Exception | None] = [None] * len(requests)
        with self.share.step(sessions):  # none of them given up to make room for another source's
            for group in self._plan_step(requests, results).values():
                outputs = self._run_group(group, between_ops)
                for i, planned, output in zip(group.indices, group.planned, outputs, strict=True):
                    results[i] = output if planned is None or isinstance(output, Exception) else planned.answer(output)
        return results

    def _plan_step(self, requests: Sequence[Request], results: list) -> dict[tuple, _Group]:
        """The step's requests in groups by run: a decode whose KV slots hold its row already, or whose row
        opens their next blocks, joins as it is (`_Decode`), every other request with a plan of its own (`_Planned`);
        a request that cannot run, or whose every row prefix reuse kept, has its result in `results`
        instead."""
        checked = []  # (index, request, T): the requests whose x is what this runner computes
        for i, request in enumerate(requests):
            try:
                checked.append((i, request, self._check_input(request.x)))
            except InternalError as e:
                results[i] = e
        # Prefix reuse names rows by their bytes: as the device received them, else read in one copy.
        rows = None if self.prefixes is None or not checked else _host_rows([request for _, request, _ in checked])
        groups: dict[tuple, _Group] = {}
        recurrent = self.recurrent
        for k, (i, request, T) in enumerate(checked):
            try:
                plan = self._plan(request, T, None if rows is None else rows[k])
            except Exception as e:
                results[i] = e
                continue
            if isinstance(plan, _Decode):
                self._group(groups, plan.run).add(i, request.session, plan.x, plan.position, plan.slots, begun=plan.begun)
            elif plan.begun is not None and not plan.begun.computes:  # every row kept
                results[i] = plan.answer(None)
            else:
                position = plan.ops.position
                self._group(groups, plan.run).add(
                    i, plan.session, plan.x, plan.ops.positions if position is None else position,
                    [None if recurrent[layer] else plan.slots[block_idx] for layer, block_idx in plan.run], plan)
        return groups

    def _group(self, groups: dict[tuple, _Group], run: tuple[tuple[int, int], ...]) -> _Group:
        group = groups.get(run)
        if group is None:
            group = groups[run] = _Group(run)
        return group

    def _run_group(self, group: _Group, between_ops: Callable[[], None] | None) -> list[torch.Tensor | Exception]:
        """Each member's output, computed together; on an error every member is rolled back and
        fails with it, except out of memory: one member's tokens (a long prompt chunk) may be
        what did not fit, so the members then run one by one and only those that fail alone fail."""
        try:
            with torch.inference_mode():
                outputs = self._run(group, between_ops)
        except BaseException as e:
            group.roll_back()
            if not isinstance(e, Exception):
                raise
            if isinstance(e, torch.OutOfMemoryError) and len(group.indices) > 1:
                return [self._run_group(group.single(k), between_ops)[0] for k in range(len(group.indices))]
            return [e] * len(group.indices)
        for planned in group.planned:
            if planned is not None and planned.computed:
                planned.install(self.cache)
        if self.prefixes is not None:
            try:
                self._keep_for_reuse(group, outputs)
            except torch.OutOfMemoryError:  # a GPU without the memory: the rows are given up, the requests answered
                self.prefixes.give_up(group.sessions)
        return outputs

    def _keep_for_reuse(self, group: _Group, outputs: list[torch.Tensor]) -> None:
        """Hand what the group's followed requests computed to prefix reuse: one-row requests that
        computed their row (decodes) in one copy, the others one by one."""
        one_row = []
        for planned, begun, output in zip(group.planned, group.begun, outputs, strict=True):
            if planned is not None:
                begun = planned.begun
                if begun is not None and not begun.resume == begun.extension.start == begun.extension.end - 1:
                    states = {block_idx: state for block_idx, (state, _) in planned.computed.items()}
                    self.prefixes.finish(begun, output, states)
                    continue
            if begun is not None:
                one_row.append((begun, output))
        if one_row:  # their rows [n, H]: the only one's, or one copy of them all
            rows = one_row[0][1][0] if len(one_row) == 1 else torch.cat([output for _, output in one_row], dim=1)[0]
            self.prefixes.finish_rows([begun for begun, _ in one_row], rows)

    def _plan(self, request: Request, T: int, rows: memoryview | None) -> _Planned | _Decode:
        """Check `request` (x: [1, T, H], its bytes `rows` on the host where prefix reuse reads them)
        against the session's state and reserve its slots (RequestError if it cannot run); a decode whose
        slots hold its row already is a `_Decode`."""
        session, x, ops = request.session, request.x, request.ops
        beyond = max(0, request.to_end - T)  # (a piece of a longer request: its rows past this one)
        if type(ops) is not Ops:  # a sequence of Op: read into columns once
            ops = Ops.of(ops)
        if self.slots_shifted:  # from here on, block_idx is the KV slot
            layers, bases = len(self.blocks), self.slot_bases
            ops = Ops(ops.layers, ops.positions, tuple(bases[layer] + block_idx if 0 <= layer < layers else block_idx
                                                       for layer, block_idx in zip(ops.layers, ops.blocks)))
        checked = self._checked
        if ops.layers != checked.layers or ops.blocks != checked.slots:  # a step's requests mostly share one run
            self._check_run(tuple(zip(ops.layers, ops.blocks)))  # checked once
        run = self._checked.run  # what the request shares with those it batches with: each op's (layer, block_idx)
        position = ops.position  # (None: the ops are at several positions)
        self.share.asked(session, position)
        begun = None if self.prefixes is None else self.prefixes.begin(session, x, rows, position, run, beyond)
        if begun is not None and begun.resume != begun.extension.start:  # rows kept: compute the rest
            if not begun.computes:
                return _Planned(session, x, Ops((), (), ()), (), {}, {}, begun, beyond)
            start = begun.extension.start
            x = x[:, begun.resume - start:] if begun.resume > start else torch.cat([begun.pending, x], dim=1)
            ops = Ops(ops.layers, (begun.resume,) * len(ops), ops.blocks)
            T = x.shape[1]
        elif T == 1 and not beyond and (decode := self._decode(session, x, position, run, begun)) is not None:
            return decode
        writes, linear_ends = {}, {}  # block_idx -> the rows [start, end) its ops write; -> the end
        held, recurrent = self.cache.slots(session), self.recurrent
        for layer, index_pos, block_idx in ops:
            if recurrent[layer]:
                # An earlier op of this request on the same slot counts as consumed.
                consumed = linear_ends.get(block_idx, self.cache.linear_length(session, block_idx))
                if 0 < index_pos < consumed:
                    raise RecurrentRewind(
                        f"index_pos {index_pos} for block {block_idx} would rewind a linear-attention layer's "
                        f"recurrent state, which cannot be rewound: it has consumed {consumed} positions in this "
                        f"session; continue at {consumed} or start again at 0"
                    )
                cached = consumed
            else:
                slot = held.get(block_idx)
                cached = 0 if slot is None else slot.length
            if index_pos < 0 or index_pos > cached:
                raise PositionGap(
                    f"index_pos {index_pos} for block {block_idx} does not follow the {cached} positions cached in this session"
                )
            if recurrent[layer]:
                linear_ends[block_idx] = index_pos + T
            elif block_idx in writes:
                start, end = writes[block_idx]
                writes[block_idx] = (min(start, index_pos), max(end, index_pos + T))
            else:
                writes[block_idx] = (index_pos, index_pos + T)
        slots = self.cache.reserve(session, writes, linear_ends)
        return _Planned(session, x, ops, run, slots, writes, begun, beyond)

    def _decode(self, session: int, x: torch.Tensor, position: int | None, run: tuple[tuple[int, int], ...],
                begun: Begun | None) -> _Decode | None:
        """The one-row request (none of its rows kept by prefix reuse) as a `_Decode` if its ops are at one
        `position` that each of its KV slots holds already and its run has no linear-attention layer."""
        if position is None or self._checked.linear:
            return None
        slots = self.cache.continuing(session, self._checked.slots, position)
        return None if slots is None else _Decode(x, run, position, slots, begun)

    def _check_run(self, run: tuple[tuple[int, int], ...]) -> None:
        """InternalError where an op names a layer or KV slot this runner lacks."""
        layers, slots = len(self.blocks), self.config.num_hidden_layers
        for layer, block_idx in run:
            if not (0 <= layer < layers and 0 <= block_idx < slots):
                raise InternalError(f"op {layer}, {block_idx} (layer, KV slot) breaks the contract: this runner "
                                    f"has {layers} layers and {slots} KV slots")
        self._checked = self._run_layers(run)

    def _run_layers(self, run: tuple[tuple[int, int], ...]) -> _RunLayers:
        """What `run` (checked) asks of the layers."""
        recurrent = self.recurrent
        attention = {j: i for i, j in enumerate(j for j, (layer, _) in enumerate(run) if not recurrent[layer])}
        return _RunLayers(run, tuple(layer for layer, _ in run), tuple(block_idx for _, block_idx in run),
                          any(recurrent[layer] for layer, _ in run),
                          attention, tuple(self.blocks[layer] for layer, _ in run),
                          tuple(self.rotaries[layer] for layer, _ in run), all(self.capturable[layer] for layer, _ in run))

    def _run(self, group: _Group, between_ops: Callable[[], None] | None) -> list[torch.Tensor]:
        """The outputs of `group`'s requests, which share one run, computed together: the decode
        requests first in x (the step's pages take them in one attention call), outputs in `group`'s order."""
        lengths = [x.shape[1] for x in group.xs]
        columns = group.sessions, group.xs, group.starts, group.slots, group.planned
        order = None if max(lengths) == 1 else sorted(range(len(lengths)), key=lambda i: lengths[i] > 1)
        if order is not None:  # prompt chunks among them: decodes first
            lengths = [lengths[i] for i in order]
            columns = tuple([column[i] for i in order] for column in columns)
        sessions, xs, starts, slots, planned = columns
        x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)  # [1, N, H]
        run = group.run
        layers = self._checked if run == self._checked.run else self._run_layers(run)
        attention = layers.attention
        # Each request's rows past it where it is a piece of a longer one (a step of decodes has no plan: none is).
        beyond = [0 if plan is None else plan.beyond for plan in planned] if any(planned) else None
        step = None if not attention else StepRows(self.cache, sessions, lengths, starts, slots, list(attention), beyond)
        # A fixed-shape decode step (compute/decode_graph.py, which also asks that its shape fit a graph):
        # decodes only, through attention layers a graph holds every one of.
        graphed = self.graphs.run(run, layers.blocks, layers.rotaries, step, x) \
            if self.graphs is not None and step is not None and lengths[-1] == 1 and layers.capturable else None
        x = graphed if graphed is not None else self._layers(run, planned, lengths, x, starts, attention, step, between_ops)
        for request_starts, request_slots, plan in zip(starts, slots, planned, strict=True):
            if plan is None:  # a decode: its slots hold its row
                ended = request_starts + 1
                for slot in request_slots:
                    slot.length = ended
                continue
            for block_idx, (_, end) in plan.writes.items():
                plan.slots[block_idx].length = end
        outputs = [x] if len(lengths) == 1 else list(x.split_with_sizes(lengths, dim=1))
        if order is None:
            return outputs
        in_order: list[torch.Tensor] = [None] * len(lengths)
        for i, output in zip(order, outputs, strict=True):
            in_order[i] = output
        return in_order

    def _layers(self, run: tuple[tuple[int, int], ...], members: Sequence[_Planned | None], lengths: list[int],
                x: torch.Tensor, starts: list[int | tuple[int, ...]], attention: dict[int, int], step: StepRows | None,
                between_ops: Callable[[], None] | None) -> torch.Tensor:
        """x: [1, N, H] through the run's layers, op by op, over the step's pages (compute/paged_step.py);
        `starts`: each request's index_pos (one for all its ops, or each op's); `members`: each request's
        plan (a run with a linear-attention layer has one for every request)."""
        rotations = {}  # (rotary, the first attention layer at these positions) -> cos, sin: [N, R]
        for j, (layer, block_idx) in enumerate(run):
            if j and j % _OPS_BETWEEN_CALLS == 0 and between_ops is not None:
                between_ops()
            block = self.blocks[layer]
            if block.recurrent:
                op_starts = [start if type(start) is int else start[j] for start in starts]
                segments = [(T, planned.linear_state(self.cache, block_idx, index_pos))
                            for planned, T, index_pos in zip(members, lengths, op_starts, strict=True)]
                x, states = block.forward(x, segments)
                for planned, T, index_pos, state in zip(members, lengths, op_starts, states, strict=True):
                    planned.computed[block_idx] = (state, index_pos + T)
                continue
            rotary, alike = self.rotaries[layer], step.alike(attention[j])
            if (rotary, alike) not in rotations:
                rotations[rotary, alike] = self._rotation(rotary, step, attention[j])
            cos, sin = rotations[rotary, alike]
            x = block.forward(x, cos, sin, step.layer(attention[j]))
        return x

    def _rotation(self, rotary: Rotary | None, step: StepRows, index: int):
        """cos, sin: [N, R] for the step's rows at attention layer `index`'s positions (longrope picks
        its factors per request); None, None without a rotary."""
        if rotary is None:
            return None, None
        long = step.long_rows(index, rotary) if rotary.long_inv_freq is not None else None
        return rotary.cos_sin(step.positions[index], self.dtype, long)

    def _check_input(self, x: torch.Tensor) -> int:
        """T of x: [1, T, H] (InternalError where x is not what this runner computes)."""
        shape, hidden = x.shape, self.config.hidden_size
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != hidden or \
                x.dtype != self.dtype or x.device != self.device:
            raise InternalError(f"activation {x.dtype} {tuple(shape)} on {x.device} breaks the contract: this "
                                f"runner computes [1, T, {hidden}] with T >= 1, {self.dtype} on {self.device}")
        return shape[1]

    def clear_session(self, session: int) -> None:
        """Goodbye: the session starts afresh. With prefix reuse its rows are kept as a retired
        prefix (within the budget, given up as soon as a live session needs the room); whatever
        else it held is freed (unknown session: no-op)."""
        if self.prefixes is not None:
            self.prefixes.retire(session)
        self.cache.clear(session)
        self.share.forget(session)

    def free_session(self, session: int) -> None:
        """A closed connection: forget the session's positions and free its buffers, and its
        retired prefixes, unless prefixes are shared, when its rows are retired as on Goodbye
        (unknown session: no-op)."""
        if self.prefixes is not None:
            self.prefixes.end(session)
        self.cache.clear(session)
        self.share.forget(session)

    def kv_bytes(self) -> int:
        """Bytes the live sessions' KV slots and linear states hold (not what prefix reuse keeps)."""
        return self.cache.nbytes()

    def sessions(self) -> Set[int]:
        return self.cache.sessions()


def _host_rows(requests: Sequence[Request]) -> list[memoryview]:
    """Each request's x's bytes, row after row, on the host: its `data` where it came with them, else
    read in one copy for all those that did not (on a GPU one transfer, not one per request)."""
    rows: list[memoryview | None] = [request.data for request in requests]
    missing = [i for i, data in enumerate(rows) if data is None]
    if not missing:
        return rows
    xs = [requests[i].x for i in missing]
    for i, data in zip(missing, tensors.to_bytes_each(xs, tensors.wire_dtype(xs[0].dtype)), strict=True):
        rows[i] = data
    return rows


def _linear_state_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """LinearState's conv and recurrent shapes for one session (batch 1), if the model has linear layers."""
    la = config.linear_attention
    if la is None:
        return None
    return (1, la.conv_channels, la.conv_kernel - 1), (1, la.value_heads, la.key_head_dim, la.value_head_dim)


def _pack_matrices(weights: dict[tuple[str, str], Any]) -> None:
    """On the CPU, f32 matrices packed for MKL's GEMM instead, once, at load, where that costs little
    memory (model/weights/packed.py says why)."""
    for (layer, key), tensor in weights.items():
        if key in MATRICES and isinstance(tensor, torch.Tensor) and packed.packable(tensor):
            weights[layer, key] = packed.packed_or_plain(tensor)


def _held_bytes(weight: object) -> int:
    """The bytes a loaded weight holds: a tensor's, or those of the tensors a kept or packed weight is made of."""
    if isinstance(weight, torch.Tensor):
        return weight.nbytes
    return sum(part.nbytes for part in vars(weight).values() if isinstance(part, torch.Tensor))
