"""What a device process does with the work it receives: a plain class, runnable without a process.

`DeviceService.tasks` turns a received `Hops` message into the device's tasks, its activations
converted to the device's tensors once for the whole message (one buffer of rows: one copy to
the device, one cast); `run_step` computes a step's pieces (scheduler.py: several sessions'
requests, and a piece of a prompt cut here, as one batch) and says what each finished task
sends on, its bytes converted back once for the whole step; `handle` runs a Clear or an End.
None of them raises, so that nothing a master sends can crash the process or touch another
session's state. A task runs this device's stage and becomes either a hand-off to the next
stage's device (a Hop holding the rest of the route) or, from the last stage, an Activation
for the front. A RequestError becomes a Failure with its code and message; any other exception
is logged here and reaches the front as an INTERNAL failure that names no class, path or
traceback.

Every chunk of a request gets exactly one answer to the front (an Activation from the last
stage, or a Failure from the device where it stopped): once a chunk fails here, the request's
later chunks are answered with the same failure, unrun, so the front knows when nothing of
the request is left on any device. A prompt cut into pieces here is answered once, after its
last piece, or at the first piece that fails (its later pieces are not run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cakemp import log
from cakemp.compute import tensors
from cakemp.compute.components import ComponentRunner
from cakemp.compute.loading import Rounding
from cakemp.compute.runner import BlockRunner, Runner
from cakemp.device import fault
from cakemp.device.scheduler import Piece
from cakemp.errors import BadTensor, ConfigError, InternalError, RequestError
from cakemp.ipc import (
    Activation,
    Batch,
    Buffer,
    Clear,
    Done,
    End,
    ErrorCode,
    ExpertReport,
    Failure,
    Hop,
    Hops,
    PrefixReport,
    error_code,
    rows,
)
from cakemp.ipc.spec import TEXT, DeviceSpec, Workload
from cakemp.rss import resident_bytes
from cakemp.wire import RawTensor


def _no_progress(request_id: int) -> None:
    pass


@dataclass(eq=False)
class Task:
    """A hop this device computes: `x` its activation as the runner takes it (a text model's
    [1, T, H] on the device in its compute dtype; an image call's wire tensor), or why it has none;
    `done` the outputs [1, t, H] of the pieces of a prompt cut here that have run so far."""

    hop: Hop
    x: torch.Tensor | RawTensor | Exception
    # x's bytes as they came, where they are x's own (a text model's, its wire dtype the compute dtype):
    # prefix reuse names rows by them rather than copy x's back from the device.
    data: memoryview | None = None
    done: list[torch.Tensor] = field(default_factory=list)
    # T of its [1, T, H] (a malformed shape counts all but its last dim): asked several times a step.
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        shape = self.hop.shape
        self.tokens = math.prod(shape[:-1]) if len(shape) > 1 else 1

    @property
    def session(self) -> int:
        return self.hop.session


class Onward(NamedTuple):
    """What a finished task sends on: `item` (a Hop for device `device`; for the front, None, an
    Activation or a Failure) and its bytes (the activation, or the failure's message)."""

    task: Task
    device: int | None
    item: Hop | Activation | Failure
    data: Buffer


@dataclass
class Stepped:
    """A step's outcome: what its finished tasks send on, and the batches the runner computed."""

    onward: list[Onward]
    batches: list[Batch]


class _Fault(NamedTuple):
    """Why a request failed, as the front is told."""

    code: ErrorCode
    message: str


@dataclass
class DeviceService:
    """One device's runner behind the ipc contract: a message's hops in, a step's results out."""

    runner: Runner  # the front's ops index its `layers` (a text model's layers, or image components)
    workload: Workload = TEXT  # what the hops are: a text model's activations, or image components' calls
    index: int = 0  # this device's place in the node, as routes name it
    generation: int = 0  # which start of this device this process is; a route names the one it expects
    label: str = "cpu:0"
    # Called with the request id between slices of a long request's ops.
    progress: Callable[[int], None] = _no_progress
    poisoned: str | None = None  # why this process must end after its last answer (a sticky CUDA error)
    # request id -> why one of its chunks failed, while later chunks may still come.
    _failed: dict[int, _Fault] = field(default_factory=dict, init=False)
    _last_report: PrefixReport = field(default=PrefixReport(0, 0, 0, 0, 0), init=False)

    @classmethod
    def load(cls, spec: DeviceSpec, on_layer: Callable[[int], None] | None = None, generation: int = 0,
             progress: Callable[[int], None] = _no_progress) -> DeviceService:
        """Load the spec's parts (its layers or components); `on_layer(n)` once n of them are on the device."""
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        device = "cuda:0" if spec.gpu is not None else "cpu"  # the one GPU this process sees
        if spec.gpu is not None and not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "CUDA finds no such GPU"
            raise ConfigError(f"device {spec.label}: cannot use GPU {spec.gpu}: {build}")
        image = spec.workload.image
        if image is not None:
            runner = ComponentRunner.load(image.arch, image.sd_version, spec.component_files, device,
                                          tensors.compute_dtype(spec.dtype), on_layer, spec.kv_budget_bytes)
            return cls(runner, spec.workload, spec.index, generation, spec.label, progress)
        runner = BlockRunner.load(
            spec.checkpoint_path, spec.parts, device, tensors.compute_dtype(spec.dtype),
            kv_budget_bytes=spec.kv_budget_bytes, max_context=spec.max_context, on_layer=on_layer,
            prefix_reuse=spec.prefix_reuse, share_prefixes=spec.share_prefixes, keep_int4=spec.keep_int4,
            expert_cache_bytes=spec.expert_cache_bytes,
            quantize=None if spec.quantize is None else Rounding(spec.quantize, spec.quantize_group),
            graph_batch=spec.max_batch if spec.cuda_graphs and spec.gpu is not None else None,
        )
        return cls(runner, spec.workload, spec.index, generation, spec.label, progress)

    def threads(self) -> int:
        """torch's intra-op threads in this process (--cpu-threads, or the CPU devices' share of the cores)."""
        return torch.get_num_threads()

    def memory_bytes(self) -> int:
        """Bytes this device holds: GPU memory allocated, or the process's RSS on a CPU."""
        if torch.device(self.runner.device).type == "cuda":
            return torch.cuda.memory_allocated()
        return resident_bytes()

    def handle(self, request: Clear | End) -> Done | tuple[Failure, bytes]:
        """Run a Clear or an End: its Done, or its failure and the failure's message."""
        try:
            if isinstance(request, Clear):  # Goodbye: its rows may be kept for reuse
                self.runner.clear_session(request.session)
            else:
                self.runner.free_session(request.session)
        except Exception as e:
            fault = self._fault(e)
            text = fault.message.encode()
            return Failure(request.request_id, fault.code, 0, 0, len(text)), text
        return Done(request.request_id, len(self.runner.sessions()), self.runner.kv_bytes())

    def tasks(self, message: Hops) -> list[Task]:
        """The message's hops this process computes, each with its activation on the device. A hop
        meant for another process of this device (a stale route), or another device, is dropped."""
        hops = message.hops
        mine = [i for i, hop in enumerate(hops)
                if hop.stages and hop.stages[0].device == self.index and hop.stages[0].generation == self.generation]
        data = rows(hops, message.data)  # each hop's bytes, apart
        if self.workload.image is not None:
            return [Task(hops[i], RawTensor(data[i], hops[i].dtype, hops[i].shape)) for i in mine]
        # Hops of the compute dtype arrive as x's own bytes: prefix reuse names their rows by them (and
        # only then are they held, with the message, as long as their task).
        own = None if self.runner.prefixes is None else tensors.wire_dtype(self.runner.dtype)
        if len(mine) == len(hops) and (whole := self._rows(message)) is not None:
            return [Task(hop, x, body if hop.dtype == own else None)
                    for hop, x, body in zip(hops, whole, data, strict=True)]
        return [Task(hops[i], self._input(hops[i], data[i]), data[i] if hops[i].dtype == own else None) for i in mine]

    def run_step(self, pieces: Sequence[Piece]) -> Stepped:
        """Run this device's stage of each piece (of distinct sessions) as one batch (the runner's
        run_batch): what each task finished here sends on, and the batches computed."""
        onward: list[Onward] = []
        batches: list[Batch] = []
        batch: list[tuple[Piece, object]] = []
        for piece in pieces:
            task = piece.work
            hop = task.hop
            earlier = self._failed.get(hop.request_id)
            if earlier is not None:
                onward.append(self._failed_chunk(task, earlier))
                continue
            try:
                if isinstance(task.x, Exception):
                    raise task.x
                x, ops, data, to_end = task.x, hop.stages[0].ops, task.data, hop.to_end
                if not (piece.first and piece.last):  # a piece of a prompt cut here: its rows, at its positions
                    x = x[:, piece.start:piece.end]
                    ops = ops.shifted(piece.start)
                    to_end = (to_end or task.tokens) - piece.start  # its rows to the request's end
                    if data is not None:
                        row = data.nbytes // task.tokens
                        data = data[piece.start * row:piece.end * row]
                batch.append((piece, self.runner.request(hop.session, x, ops, data, to_end)))
            except Exception as e:
                onward.append(self._failed_chunk(task, self._fault(e), ran=not piece.first))
        if not batch:
            return Stepped(onward, batches)
        first = batch[0][0].work.hop.request_id

        def together(indices: Sequence[int]) -> None:
            batches.append(Batch(len(indices), sum(batch[j][0].end - batch[j][0].start for j in indices)))

        results = self.runner.run_batch([request for _, request in batch], lambda: self.progress(first), together)
        finished: list[tuple[Task, torch.Tensor]] = []
        for (piece, _), result in zip(batch, results, strict=True):
            task = piece.work
            if isinstance(result, Exception):
                onward.append(self._failed_chunk(task, self._fault(result), ran=not piece.first))
            elif not piece.last:
                task.done.append(result)
            else:
                finished.append((task, torch.cat([*task.done, result], dim=1) if task.done else result))
                task.done = []
        onward += self._onward(finished)
        return Stepped(onward, batches)

    def prefix_report(self) -> PrefixReport | None:
        """What prefix reuse did since the last report, if anything changed (None without reuse)."""
        prefixes = self.runner.prefixes
        if prefixes is None:
            return None
        report = PrefixReport(prefixes.hits, prefixes.tokens, prefixes.evictions, prefixes.retired_bytes(),
                              prefixes.kept_bytes())
        if report == self._last_report:
            return None
        prefixes.hits = prefixes.tokens = prefixes.evictions = 0
        self._last_report = PrefixReport(0, 0, 0, report.retired_bytes, report.kept_bytes)
        return report

    def expert_report(self) -> ExpertReport | None:
        """What the offloaded experts' cache did since the last report, if it did anything (None without one)."""
        cache = self.runner.expert_cache
        if cache is None or cache.hits == cache.misses == 0:
            return None
        report = ExpertReport(cache.hits, cache.misses, cache.read_bytes, cache.resident_bytes)
        cache.hits = cache.misses = cache.read_bytes = 0
        return report

    def _failed_chunk(self, task: Task, fault: _Fault, ran: bool = False) -> Onward:
        """The answer to a chunk of a failed request: the request's failure, remembered until its
        last chunk. `ran`: an earlier piece of it ran here (a prompt cut here)."""
        hop = task.hop
        task.done = []
        if hop.chunk + 1 >= hop.chunks:
            self._failed.pop(hop.request_id, None)
        else:
            self._failed[hop.request_id] = fault
        text = fault.message.encode()
        return Onward(task, None, Failure(hop.request_id, fault.code, hop.chunk, int(ran), len(text)), text)

    def _onward(self, finished: Sequence[tuple[Task, torch.Tensor]]) -> list[Onward]:
        """What each finished task's output y sends on: the hand-off to the route's next stage, or from
        the last, the answer to the front: of the hop's dtype and shape, or an image component's reply
        as it is (its dtype, its shape). The outputs of one wire dtype go to the host as one buffer."""
        if not finished:
            return []
        same_shape = self.workload.same_reply_shape
        wire = [task.hop.dtype if same_shape else tensors.wire_dtype(y.dtype) for task, y in finished]
        data: list[Buffer | Exception] = [None] * len(finished)
        for dtype in dict.fromkeys(wire):
            members = [i for i, d in enumerate(wire) if d == dtype]
            try:
                # The copy to the host is where an asynchronous CUDA error or a cast's OOM surfaces.
                for i, body in zip(members, tensors.to_bytes_each([finished[i][1] for i in members], dtype), strict=True):
                    data[i] = body
            except Exception:  # each alone, for each its own answer
                for i in members:
                    try:
                        data[i] = tensors.to_bytes(finished[i][1], dtype)
                    except Exception as e:
                        data[i] = e
        onward = []
        kv = self.runner.kv_bytes()
        for (task, y), dtype, body in zip(finished, wire, data, strict=True):
            if isinstance(body, Exception):
                onward.append(self._failed_chunk(task, self._fault(body), ran=True))  # its state is updated
                continue
            hop = task.hop
            shape = hop.shape if same_shape else tuple(y.shape)
            rest = hop.stages[1:]
            if rest:
                item = Hop(hop.session, hop.request_id, dtype, body.nbytes, hop.chunk, hop.chunks, shape, rest,
                           (*hop.kv, kv), to_end=hop.to_end)
                onward.append(Onward(task, rest[0].device, item, body))
            else:
                onward.append(Onward(task, None, Activation(hop.request_id, dtype, body.nbytes, hop.chunk, shape,
                                                            (*hop.kv, kv)), body))
        return onward

    def _rows(self, message: Hops) -> list[torch.Tensor] | None:
        """Each hop's activation [1, T, H] on the device, as views of the message's whole data converted
        at once, when every hop is [1, T, H] of one dtype and H and its bytes say so (else None)."""
        hops = message.hops
        dtype, hidden = hops[0].dtype, hops[0].shape[-1] if hops[0].shape else 0
        itemsize = tensors.itemsize(dtype)
        if itemsize is None:  # not an activation's dtype: each hop is told so on its own
            return None
        row = hidden * itemsize
        lengths = []
        for hop in hops:
            shape = hop.shape
            if hop.dtype != dtype or len(shape) != 3 or shape[0] != 1 or shape[2] != hidden or shape[1] < 1 or \
                    hop.nbytes != shape[1] * row:  # each hop's bytes its rows' (they name its rows for prefix reuse)
                return None
            lengths.append(shape[1])
        try:
            x = tensors.to_tensor(message.data, dtype, (sum(lengths), hidden))  # wire dtype, CPU: [N, H]
        except BadTensor:
            return None
        # Cast on the device: torch casts within a host copy on the CPU, single-threaded. (Each call only
        # where it changes something: after a sleep every torch call runs cold, tens of µs for a lone decode.)
        if self.runner.device.type != "cpu":
            x = x.to(self.runner.device)
        if x.dtype != self.runner.dtype:
            x = x.to(self.runner.dtype)
        if len(lengths) == 1:
            return [x.view(1, lengths[0], hidden)]
        if len(lengths) == sum(lengths):  # decodes alone: [N, 1, 1, H] unbound in one call
            return list(x.view(len(lengths), 1, 1, hidden).unbind(0))
        return [x.unsqueeze(0) for x in x.split_with_sizes(lengths)]

    def _input(self, hop: Hop, data: Buffer) -> torch.Tensor | Exception:
        """The hop's activation [1, T, H] on this device, in its compute dtype (or why it has none)."""
        try:
            x = tensors.to_tensor(data, hop.dtype, hop.shape)  # wire dtype, CPU
        except BadTensor as e:  # admission at the front passed it: the contract is broken
            return InternalError(f"the hop's activation breaks the contract: {e}")
        try:
            # Cast on the device: torch casts within a host copy on the CPU, single-threaded.
            return x.to(self.runner.device).to(self.runner.dtype)
        except Exception as e:  # out of memory, a CUDA fault: this request's answer
            return e

    def _fault(self, error: Exception) -> _Fault:
        """Why `error` fails its request, as the front is told. Out of memory fails that request alone;
        an error that poisons the CUDA context sets `poisoned`, for the process to end once this answer
        is sent (cakemp/device/fault.py says why); any other fault is logged here and named to the front
        only as internal."""
        code = error_code(error)
        if isinstance(error, RequestError) and not isinstance(error, InternalError):  # InternalError: a bug here
            return _Fault(code, str(error))
        summary = ". ".join(str(error).split(". ")[:2]).strip()  # torch's OOM text goes on for lines
        if isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()  # hand back what the failed request had cached
            return _Fault(ErrorCode.OUT_OF_MEMORY, f"out of memory on {self.runner.device}: {summary}")
        if fault.poisons_context(error):
            self.poisoned = f"{type(error).__name__}: {error}"
            return _Fault(ErrorCode.DEVICE_LOST, f"device {self.runner.device} faulted ({summary}); it "
                          "restarts, and its sessions lose their KV state")
        log.get_logger(device=self.index).error("request failed inside the device", device_label=self.label,
                                                error=f"{type(error).__name__}: {error}", exc_info=error)
        return _Fault(ErrorCode.INTERNAL, f"internal error on device {self.label}")
