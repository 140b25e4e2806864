"""What a device process does with each message: a plain class, runnable without a process.

`DeviceService.handle` turns one ipc message, and `run_step` a step's hops (several
sessions' requests computed as one batch), into at most one message each to send on; neither
raises, so that nothing a master sends can crash the process or touch another session's
state. A Hop runs this device's stage and becomes either the hand-off to the next stage's
device (a Hop holding the rest of the route) or, from the last stage, the Activation for
the front. A RequestError becomes a Failure with its code and message; any other exception is
logged here and reaches the front as an INTERNAL failure that names no class, path or
traceback.

Every chunk of a request gets exactly one answer to the front (an Activation from the last
stage, or a Failure from the device where it stopped): once a chunk fails here, the request's
later chunks are answered with the same failure, unrun, so the front knows when nothing of
the request is left on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cakemp import log
from cakemp.compute import tensors
from cakemp.compute.components import Call, ComponentRunner
from cakemp.compute.loading import Rounding
from cakemp.compute.runner import BlockRunner, Request, Runner
from cakemp.device import fault
from cakemp.errors import BadTensor, ConfigError, InternalError, RequestError
from cakemp.ipc import Activation, Clear, Done, End, ErrorCode, ExpertReport, Failure, Hop, PrefixReport, error_code
from cakemp.ipc.spec import TEXT, DeviceSpec, Workload
from cakemp.rss import resident_bytes
from cakemp.wire import RawTensor


def _no_progress(request_id: int) -> None:
    pass


@dataclass
class DeviceService:
    """One device's runner behind the ipc contract: messages in, at most one message out each."""

    runner: Runner  # the front's ops index its `layers` (a text model's layers, or image components)
    workload: Workload = TEXT  # what the hops are: a text model's activations, or image components' calls
    index: int = 0  # this device's place in the node, as routes name it
    generation: int = 0  # which start of this device this process is; a route names the one it expects
    label: str = "cpu:0"
    # Called with the request id between slices of a long request's ops.
    progress: Callable[[int], None] = _no_progress
    poisoned: str | None = None  # why this process must end after its last answer (a sticky CUDA error)
    # request id -> the failure of one of its chunks, while later chunks may still come.
    _failed: dict[int, Failure] = field(default_factory=dict, init=False)
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

    def handle(self, request: Hop | Clear | End) -> Hop | Activation | Done | Failure | None:
        """The message to send on (a Hop to hand off, else one for the front); None for a
        Hop meant for another process of this device (a stale route), which is dropped."""
        if isinstance(request, Hop):
            return self.run_step([request])[0]
        try:
            if isinstance(request, Clear):  # Goodbye: its rows may be kept for reuse
                self.runner.clear_session(request.session)
            else:
                self.runner.free_session(request.session)
        except Exception as e:
            return self._failure(request.request_id, 0, e)
        return Done(request.request_id, self.runner.session_count(), self.runner.kv_bytes())

    def run_step(self, hops: Sequence[Hop], together: Callable[[Sequence[Hop]], None] | None = None
                 ) -> list[Hop | Activation | Failure | None]:
        """Run this device's stage of each hop (of distinct sessions) as one batch
        (the runner's run_batch); the message each becomes, in order, as `handle` says.
        `together(hops)`: the hops the runner computes as one batch, before it does."""
        replies: list[Hop | Activation | Failure | None] = [None] * len(hops)
        batch: list[tuple[int, Request | Call]] = []
        for i, hop in enumerate(hops):
            stage = hop.stages[0] if hop.stages else None
            if stage is None or stage.device != self.index or stage.generation != self.generation:
                continue
            earlier = self._failed.get(hop.request_id)
            if earlier is not None:
                replies[i] = self._failed_chunk(hop, earlier)
                continue
            try:
                batch.append((i, self._request(hop, stage.ops)))
            except Exception as e:
                replies[i] = self._failed_chunk(hop, self._failure(hop.request_id, hop.chunk, e))
        if not batch:
            return replies
        first = hops[batch[0][0]].request_id
        told = None if together is None else (lambda indices: together([hops[batch[j][0]] for j in indices]))
        results = self.runner.run_batch([request for _, request in batch], lambda: self.progress(first), told)
        for (i, _), result in zip(batch, results, strict=True):
            hop = hops[i]
            try:
                if isinstance(result, Exception):
                    raise result
                # The copy to the host is where an asynchronous CUDA error or a cast's OOM surfaces.
                replies[i] = self._onward(hop, result)
            except Exception as e:
                replies[i] = self._failed_chunk(hop, self._failure(hop.request_id, hop.chunk, e))
        return replies

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

    def _failed_chunk(self, hop: Hop, failure: Failure) -> Failure:
        """The answer to a chunk of a failed request: the request's failure, remembered until its last chunk."""
        if hop.chunk + 1 >= hop.chunks:
            self._failed.pop(hop.request_id, None)
        else:
            self._failed[hop.request_id] = failure
        return Failure(hop.request_id, failure.code, failure.message, hop.chunk)

    def _onward(self, hop: Hop, y: torch.Tensor) -> Hop | Activation:
        """The hand-off of `y` to the route's next stage, or from the last, the answer to the front:
        of the hop's dtype and shape, or an image component's reply as it is (its dtype, its shape)."""
        dtype, shape = hop.dtype, hop.shape
        if not self.workload.same_reply_shape:
            dtype, shape = tensors.wire_dtype(y.dtype), tuple(y.shape)
        data = tensors.to_bytes(y, dtype)
        kv = hop.kv + (self.runner.kv_bytes(),)
        rest = hop.stages[1:]
        if rest:
            return Hop(hop.session, hop.request_id, dtype, shape, rest, data, hop.chunk, hop.chunks, kv)
        return Activation(hop.request_id, dtype, shape, data, hop.chunk, kv)

    def _request(self, hop: Hop, ops) -> Request | Call:
        """What the runner computes for the hop: its activation through `ops`, or one component's call
        over the master's tensor as it came (the component runner reads its packing)."""
        if self.workload.image is not None:  # one op: the component, and in index_pos a token count
            return Call(hop.session, RawTensor(hop.data, hop.dtype, hop.shape), ops[0].layer, ops[0].index_pos)
        return Request(hop.session, self._input(hop), ops)

    def _input(self, hop: Hop) -> torch.Tensor:
        """The hop's activation [1, T, H] on this device, in its compute dtype."""
        try:
            x = tensors.to_tensor(hop.data, hop.dtype, hop.shape)  # wire dtype, CPU
        except BadTensor as e:  # admission at the front passed it: the contract is broken
            raise InternalError(f"the hop's activation breaks the contract: {e}") from None
        # Cast on the device: torch casts within a host copy on the CPU, single-threaded.
        return x.to(self.runner.device).to(self.runner.dtype)

    def _failure(self, request_id: int, chunk: int, error: Exception) -> Failure:
        """The Failure for `error`. Out of memory fails that request alone; an error that poisons
        the CUDA context sets `poisoned`, for the process to end once this answer is sent
        (cakemp/device/fault.py says why); any other fault is logged here and named to the front
        only as internal."""
        code = error_code(error)
        if isinstance(error, RequestError) and not isinstance(error, InternalError):  # InternalError: a bug here
            return Failure(request_id, code, str(error), chunk)
        summary = ". ".join(str(error).split(". ")[:2]).strip()  # torch's OOM text goes on for lines
        if isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()  # hand back what the failed request had cached
            return Failure(request_id, ErrorCode.OUT_OF_MEMORY, f"out of memory on {self.runner.device}: {summary}", chunk)
        if fault.poisons_context(error):
            self.poisoned = f"{type(error).__name__}: {error}"
            return Failure(request_id, ErrorCode.DEVICE_LOST, f"device {self.runner.device} faulted ({summary}); it "
                           "restarts, and its sessions lose their KV state", chunk)
        log.get_logger(device=self.index).error("request failed inside the device", device_label=self.label,
                                                error=f"{type(error).__name__}: {error}", exc_info=error)
        return Failure(request_id, ErrorCode.INTERNAL, f"internal error on device {self.label}", chunk)
