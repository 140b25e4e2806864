"""The device processes of this node, as an asyncio layer over the pool's state machine.

One spawned process per device, each behind its own ipc socket, and one inbox per device for
hand-offs from the others. `run` sends a request to the first device of its route; each
device passes its result to the next, the last answers here. What the requests of one wake-up
of the event loop have for a device goes to it as one message (`Hops`), sent once the loop has
run every task that wake-up woke, and each device answers a whole step in one message
(`Answers`): ZeroMQ's cost, the codec's and this class's bookkeeping are paid per device step,
not per request. A prompt longer than `prefill_chunk` tokens whose route is one device goes to
it whole: the device cuts it into chunks, one a step beside its decodes (device/scheduler.py),
so a long prompt does not stall other sessions. Only a route spanning devices has the front cut
it, so that the chunks follow each other down the route and device 1 works on chunk k while
device 0 works on chunk k + 1.

All the bookkeeping (device states, requests owed, deadlines, restarts) is `PoolState`
(pool_state.py), which has no I/O; this class feeds it events (messages, process exits, its
timer) and carries out the actions it returns: spawn, kill, ping, resolve a request, and tell
the status, the metrics and the log. A serving device that fails is restarted in place while
the others keep serving; after `restart_attempts` failed starts in a row the pool gives up and
sets `failed`, for the front to exit and leave the node to its service manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cakemp import log
from cakemp.errors import BadIpcMessage, CakempError, DeviceLost, InternalError, RequestError
from cakemp.front import pool_state as ps
from cakemp.front.metrics import Metrics
from cakemp.front.pool_state import PoolState
from cakemp.front.router import Route, Router
from cakemp.front.status import NodeStatus
from cakemp.ipc import (
    Answers,
    Buffer,
    Clear,
    Done,
    End,
    FrontChannel,
    Hop,
    Hops,
    Loaded,
    Message,
    Ping,
    Progress,
    Ready,
    Stage,
    StartFailure,
    encode,
    error_from,
    rows,
    trace,
)
from cakemp.ipc.message import joined
from cakemp.ipc.spec import DeviceMain, DeviceSpec, Workload, chunk_bounds
from cakemp.wire import LayerOps, RawTensor

# A starting device that reports no loaded layer for this long is hung. Not --request-timeout:
# that one is sized for requests, and a device's first layer comes only after torch and its
# CUDA context have started, which can take many seconds.
LOAD_SILENCE_S = 300.0
_STOP_GRACE_S = 3.0
_REAP_S = 1.0


@dataclass
class _Pending:
    """A request's waiter and the answers of its chunks so far."""

    future: asyncio.Future
    devices: tuple[int, ...]  # the route, in order
    outputs: list[tuple[int, RawTensor]] = field(default_factory=list)  # (chunk, its answer) of each answered chunk
    reply: Done | None = None
    stamps: list[int] | None = None  # the request's stamps when traced (ipc/trace.py): the answer's go here
    x: RawTensor | None = None  # a request's activation: its chunks' answers join to its dtype and shape
    waited: tuple = ()  # a request's: the series of each device of its route, once (their waiting gauges count it)
    start: float = 0.0  # loop time it was queued


class _Outbox:
    """What the requests of this wake-up have for one device, until it is sent: hops (with their
    bytes and routes), then Clears and Ends, in the order they came."""

    def __init__(self) -> None:
        self.hops: list[tuple[Hop, Buffer, Route]] = []
        self.controls: list[tuple[Clear | End, Route]] = []
        self.flushing = False  # a flush is scheduled, or waits for the socket
        self.waiter: asyncio.Task | None = None  # the flush that waits for the socket (held: tasks are weakly kept)


class DevicePool:
    def __init__(self, specs: Sequence[DeviceSpec], device_main: DeviceMain, *, status: NodeStatus, metrics: Metrics,
                 request_timeout: float, restart_attempts: int, workload: Workload, prefill_chunk: int):
        """`workload`: whether requests keep state and are cut into chunks of `prefill_chunk` tokens."""
        self.specs = tuple(specs)
        self._labels = tuple(spec.label for spec in self.specs)  # as metrics and logs name each device
        self._series = tuple(map(metrics.device, self._labels))  # each device's series of the metrics
        self._router = Router([spec.parts for spec in self.specs])
        self._device_main = device_main  # the spawn target: the front never imports the device package
        self.failed = asyncio.Event()  # set when a device could not be restarted; `failure` says why
        self.failure: str | None = None
        self._status, self._metrics = status, metrics
        self._request_timeout = request_timeout
        self._workload = workload
        self._prefill_chunk = prefill_chunk
        self._state = PoolState([spec.label for spec in self.specs], request_timeout=request_timeout,
                                load_silence=LOAD_SILENCE_S, restart_attempts=restart_attempts,
                                stateful=workload.stateful)
        self._context = multiprocessing.get_context("spawn")
        self._loop = asyncio.get_running_loop()
        self._channels: list[FrontChannel] = []
        self._processes: list = [None] * len(self.specs)
        self._parent_pipes: list = [None] * len(self.specs)
        self._gone = [asyncio.Event() for _ in self.specs]  # the device's current process has exited
        self._readies: list[Ready | None] = [None] * len(self.specs)
        self._started: asyncio.Future = self._loop.create_future()
        self._pending: dict[int, _Pending] = {}
        self._outboxes = [_Outbox() for _ in self.specs]
        self._request_ids = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._log = log.get_logger()

    async def start(self) -> tuple[Ready, ...]:
        """Spawn every device process and wait until all have loaded their layers.

        Raises ConfigError when a device rejects the configuration (its checkpoint, say), else
        CakempError; every process is stopped before it raises. Failures at this first start
        are not retried: the configuration is the likely cause.
        """
        for index, spec in enumerate(self.specs):
            self._channels.append(FrontChannel(spec.endpoint, lambda msg, i=index: self._on_message(i, msg),
                                               lambda error, i=index: self._on_garbage(i, error)))
        try:
            self._act(self._state.start(self._loop.time()))
            await self._started
            return tuple(self._readies)
        except BaseException:
            await self.stop()
            raise

    def route(self, ops: LayerOps) -> Route:
        """Where `ops` (admitted: every layer served here) run, expecting each device's current process."""
        return self._router.plan(ops, self._state.generation)

    def run(self, session: int, x: RawTensor, route: Route, stamps: list[int] | None = None) -> asyncio.Future:
        """Run `route` over the admitted activation x ([1, T, H]): the future of the result, as bytes of
        x's dtype and shape (an image component's: of the dtype and shape its device answered), never a
        tensor here. It fails with the failing device's RequestError, or DeviceLost; DeviceLost is
        raised at once when a device of the route is down. A future, not a coroutine: a connection
        goes on from its callback, no task woken (connection.py).

        `stamps`: the request's stamps when traced (ipc/trace.py); replaced by all of them once answered."""
        if not route.stages:  # no layers: nothing to compute
            done = self._loop.create_future()
            done.set_result(x)
            return done
        devices = route.devices
        # Image components keep nothing between calls (FLUX.2's text encoder's index_pos is a token count).
        stateful = self._workload.stateful
        self._state.admit(session, devices, [stateful and any(stage.positions) for stage in route.stages])
        chunks = self._chunks(x, route)
        request_id = next(self._request_ids)
        carried = ()
        if stamps is not None:
            stamps.append(trace.now())  # routed
            carried = tuple(stamps)
        # A chunk's rows to the request's end (0 for a request sent whole): where longrope's factors switch.
        hops = [(Hop(session, request_id, x.dtype, memoryview(data).nbytes, i, len(chunks), chunk_shape,
                     route.shifted(first), trace=carried, to_end=0 if len(chunks) == 1 else x.shape[1] - first), data)
                for i, (first, chunk_shape, data) in enumerate(chunks)]
        pending = self._queue(session, route, hops, stamps)
        pending.x, pending.start = x, self._loop.time()
        pending.waited = tuple(self._series[device] for device in dict.fromkeys(devices))  # every device of the route, once
        for series in pending.waited:
            series.requests_waiting.inc()
        return pending.future

    async def clear(self, device: int, session: int) -> Done:
        """Goodbye: drop the session's caches on `device` (a fresh start, so a lost state no longer matters)."""
        self._state.cleared(device, session)
        return await self._control(device, session, Clear(session, next(self._request_ids)))

    async def end(self, device: int, session: int) -> Done:
        """The connection closed: free everything of the session on `device`."""
        self._state.ended(device, session)
        return await self._control(device, session, End(session, next(self._request_ids)))

    def label(self, device: int) -> str:
        return self._labels[device]

    def waiting(self, device: int) -> int:
        """Requests owed by `device` now."""
        return self._state.waiting(device)

    async def stop(self) -> None:
        """Stop restarting, fail requests in flight, stop every device process (SIGTERM, then
        SIGKILL after a grace period) and close the sockets. Safe to call again."""
        if self._closed:
            return
        self._closed = True
        self._act(self._state.stop())
        if self._timer is not None:
            self._timer.cancel()
        if not self._started.done():
            self._started.cancel()
        for index, process in enumerate(self._processes):
            if process is not None and not self._gone[index].is_set():
                process.terminate()
        for index, process in enumerate(self._processes):
            if process is None:
                continue
            try:
                await asyncio.wait_for(self._gone[index].wait(), _STOP_GRACE_S)
            except TimeoutError:
                process.kill()
                await self._gone[index].wait()
        for channel in self._channels:
            channel.close()

    # -- requests

    def _chunks(self, x: RawTensor, route: Route) -> list[tuple[int, tuple[int, ...], Buffer]]:
        """(first token, shape, bytes) of each chunk of x ([1, T, H], admitted): the whole request
        unless it is longer than one chunk and its route spans devices (one device cuts it itself)."""
        shape = x.shape
        if not self._workload.chunked or shape[1] <= self._prefill_chunk or len(route.stages) == 1:
            return [(0, shape, x.data)]
        view = memoryview(x.data).cast("B")
        row = view.nbytes // shape[1]
        return [(start, (1, end - start, shape[2]), view[start * row:end * row])
                for start, end in chunk_bounds(shape[1], self._prefill_chunk)]

    def _control(self, device: int, session: int, msg: Clear | End) -> asyncio.Future:
        """Queue a Clear or an End for `device`: the future of its Done (DeviceLost at once if the device is down)."""
        return self._queue(session, Route.through((Stage(device, self._state.generation(device), (), (), ()),)), [msg]).future

    def _queue(self, session: int, route: Route, messages: list[tuple[Hop, Buffer]] | list[Clear | End],
               stamps: list[int] | None = None) -> _Pending:
        """Queue `messages` (a request's chunks and their bytes, or one control message) for the first
        device of `route`: what waits for them, its future that of the request's result once every
        chunk is answered (a control message's Done). DeviceLost at once if a device of the route is down or changed process (its
        new process would drop the hop). What is queued stays owed until answered, whether or not its
        future is still awaited (a requester cancelled cancels it: `_complete` then skips it)."""
        if (error := self._unusable(route)) is not None:
            raise error
        devices = route.devices
        first = messages[0][0] if isinstance(messages[0], tuple) else messages[0]
        request_id = first.request_id
        pending = _Pending(self._loop.create_future(), devices, stamps=stamps)
        now = self._loop.time()
        # Owed from now: what is queued for a device that dies is failed with the rest it owed.
        for _ in messages:
            self._state.sent(request_id, session, devices, now)
        self._pending[request_id] = pending
        self._state.sealed(request_id)  # nothing is answered yet: no action
        outbox = self._outboxes[route.stages[0].device]
        if isinstance(messages[0], tuple):
            outbox.hops += [(hop, data, route) for hop, data in messages]
        else:
            outbox.controls.append((first, route))
        if not outbox.flushing:
            outbox.flushing = True
            self._loop.call_soon(self._flush, route.stages[0].device)
        return pending

    def _unusable(self, route: Route) -> CakempError | None:
        for stage in route.stages:
            if (error := self._state.unusable(stage.device, stage.generation)) is not None:
                return error
        return None

    def _flush(self, device: int) -> None:
        """Send what the requests of the last wake-up queued for `device`: every hop in one Hops
        message, then each Clear and End. What can no longer go (its device went down, or changed
        process) is answered with why; what the socket does not take waits until it can."""
        outbox = self._outboxes[device]
        if self._closed:
            return
        now = self._loop.time()
        actions: list[ps.Action] = []
        hops = []
        for hop, data, route in outbox.hops:
            if not self._state.owed(hop.request_id):  # failed meanwhile (its device died): gone
                continue
            if (error := self._unusable(route)) is not None:
                actions += self._state.answered(device, hop.request_id, now, error, hop.chunk)
                continue
            hops.append((hop, data, route))
        outbox.hops = hops
        channel = self._channels[device]
        if hops:
            try:
                frames = encode(Hops(tuple(hop for hop, _, _ in hops), joined([data for _, data, _ in hops])))
            except CakempError:  # a hop whose fields do not fit (BadTensor): it fails alone
                frames, failed = self._encodable(hops)
                for hop, error in failed:
                    actions += self._state.answered(device, hop.request_id, now, error, hop.chunk)
            if frames is not None and not channel.try_send(frames):
                return self._wait(device, actions)
            outbox.hops = []
        while outbox.controls:
            control, route = outbox.controls[0]
            if self._state.owed(control.request_id):
                if (error := self._unusable(route)) is not None:
                    actions += self._state.answered(device, control.request_id, now, error)
                elif not channel.try_send(encode(control)):
                    return self._wait(device, actions)
            outbox.controls.pop(0)
        outbox.flushing = False
        self._act(actions)

    def _encodable(self, hops: list[tuple[Hop, Buffer, Route]]) -> tuple[list | None, list[tuple[Hop, CakempError]]]:
        """The frames of the hops that encode (None: none), and each that does not with its error."""
        good, failed = [], []
        for hop, data, _ in hops:
            try:
                encode(Hops((hop,), data))
                good.append((hop, data))
            except CakempError as e:
                failed.append((hop, e))
        frames = encode(Hops(tuple(hop for hop, _ in good), joined([data for _, data in good]))) if good else None
        return frames, failed

    def _wait(self, device: int, actions: list[ps.Action]) -> None:
        """The socket of `device` takes nothing now: flush again once it may."""
        self._act(actions)

        async def flush_when_writable() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._channels[device].writable()
                self._flush(device)

        self._outboxes[device].waiter = self._loop.create_task(flush_when_writable())

    # -- events

    def _on_message(self, device: int, msg: Message) -> None:
        now = self._loop.time()
        match msg:
            case Answers():
                try:
                    self._answers(device, msg, now)
                except BadIpcMessage as e:
                    self._on_garbage(device, e)
            case Done():
                pending = self._pending.get(msg.request_id)
                if pending is not None:
                    pending.reply = msg
                    self._series[device].kv_bytes.set(msg.kv_bytes)
                self._act(self._state.answered(device, msg.request_id, now))
            case Progress():
                self._state.progressed(device, msg.request_id, now)
            case Loaded():
                self._state.heard(device, now)
                self._status.loaded(device, msg.layers)
            case Ready():
                self._readies[device] = msg
                self._metrics.device_loaded(self.label(device), msg.memory_bytes, self.specs[device].kv_budget_bytes)
                self._act(self._state.ready(device, now))
            case StartFailure():
                self._act(self._state.start_failed(device, now, error_from(msg.code, msg.message)))
            case _:  # Pong
                self._state.heard(device, now)

    def _answers(self, device: int, msg: Answers, now: float) -> None:
        """A step's answers: each activation and failure to its request, the batches and reports to the metrics."""
        self._state.heard(device, now)
        data = rows((*msg.activations, *msg.failures), msg.data)
        actions: list[ps.Action] = []
        kv: dict[int, int] = {}  # device -> its KV bytes, as the latest answer through it says
        for activation, body in zip(msg.activations, data):
            request_id = activation.request_id
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.outputs.append((activation.chunk, RawTensor(body, activation.dtype, activation.shape)))
                if pending.stamps is not None and activation.trace:
                    pending.stamps[:] = (*activation.trace, trace.now())  # answered
                kv.update(zip(pending.devices, activation.kv))
            actions += self._state.answered(device, request_id, now)
        for failure, text in zip(msg.failures, data[len(msg.activations):]):
            message = bytes(text).decode(errors="replace")
            error = error_from(failure.code, message)
            if not isinstance(error, RequestError):  # a start code on a request: the device's own fault
                error = InternalError(message)
            actions += self._state.answered(device, failure.request_id, now, error, failure.chunk, bool(failure.ran))
        for stage_device, kv_bytes in kv.items():
            self._series[stage_device].kv_bytes.set(kv_bytes)
        series = self._series[device]
        for batch in msg.batches:
            series.batch_requests.set(batch.requests)
            series.batch_size.observe(batch.requests)
            series.step_tokens.observe(batch.tokens)
        label = self.label(device)
        for report in msg.prefixes:
            self._metrics.prefixes(label, report.hits, report.tokens, report.evictions, report.retired_bytes,
                                   report.kept_bytes)
        for report in msg.experts:
            self._metrics.experts(label, report.hits, report.misses, report.read_bytes, report.resident_bytes)
        self._act(actions)

    def _on_garbage(self, device: int, error: BadIpcMessage) -> None:
        self._log.error("bad ipc reply", device=device, error=str(error))

    def _exited(self, device: int) -> None:
        process = self._processes[device]
        self._loop.remove_reader(process.sentinel)
        # The sentinel closes as the process exits, a moment before it can be reaped.
        process.join(_REAP_S)
        self._parent_pipes[device].close()
        self._gone[device].set()
        self._channels[device].wake_writers()
        self._act(self._state.exited(device, self._loop.time(), process.exitcode))

    def _tick(self) -> None:
        self._timer = None
        self._act(self._state.tick(self._loop.time()))

    def _arm(self) -> None:
        """Make sure the timer fires by the state machine's next deadline (a timer firing early just re-arms)."""
        deadline = self._state.next_deadline()
        if deadline is None or self._closed:
            return
        if self._timer is not None:
            if self._timer.when() <= deadline:
                return
            self._timer.cancel()
        self._timer = self._loop.call_at(deadline, self._tick)

    # -- actions

    def _act(self, actions: Sequence[ps.Action]) -> None:
        forgetting: list[asyncio.Future] = []  # the Clears of the Forgets before the next Complete (its request's)
        for action in actions:
            match action:
                case ps.Complete() if forgetting:
                    # Its requester hears of the failure only once the state it half-applied is dropped on
                    # those devices: its next request could otherwise reach one of them first (through
                    # another device's hand-off, not the front's socket the Clear takes) and have its new
                    # state dropped after it.
                    dropped = asyncio.gather(*forgetting, return_exceptions=True)
                    dropped.add_done_callback(lambda _, action=action: self._complete(action))
                    forgetting = []
                case ps.Complete():
                    self._complete(action)
                case ps.Spawn(device=device, generation=generation):
                    self._spawn(device, generation)
                case ps.Kill(device=device):
                    process = self._processes[device]
                    if process is not None and process.exitcode is None:
                        process.kill()  # its sentinel then reports the exit, with this reason
                case ps.Probe(device=device):
                    self._channels[device].try_send(encode(Ping()))
                case ps.Forget(device=device, session=session):
                    forgetting.append(self._forget(device, session))
                case ps.Started():
                    if not self._started.done():
                        self._started.set_result(None)
                case ps.StartFailed(error=error):
                    if not self._started.done():
                        self._started.set_exception(error)
                case ps.Restarting(device=device, reason=reason):
                    self._restarting(device, reason)
                case ps.RestartFailed(device=device, attempt=attempt, error=error):
                    self._log.error("device restart failed", device=device, device_label=self.label(device),
                                    attempt=attempt, error=error)
                case ps.Restarted(device=device):
                    self._status.restarted(device)
                    self._log.info("device restarted", device=device, device_label=self.label(device),
                                   pid=self._processes[device].pid)
                case ps.GiveUp(reason=reason):
                    self.failure = reason
                    self.failed.set()
        self._arm()

    def _forget(self, device: int, session: int) -> asyncio.Future:
        """Drop the session's state on `device` (a Clear, queued as any control message): the future of its Done
        (failed if the device goes down first, when the state went with it)."""
        try:
            return self._control(device, session, Clear(session, next(self._request_ids)))
        except DeviceLost as e:  # down already: its state is gone with its process
            gone = self._loop.create_future()
            gone.set_exception(e)
            return gone

    def _restarting(self, device: int, reason: str) -> None:
        """A device failed and restarts: say so, and zero what it held."""
        label = self.label(device)
        self._log.error("device failed; restarting it", device=device, device_label=label, reason=reason)
        self._metrics.device_restarts.inc(device=label)
        self._metrics.kv_bytes.set(0, device=label)
        self._metrics.prefix_retired_bytes.set(0, device=label)
        self._metrics.prefix_kept_bytes.set(0, device=label)
        self._metrics.expert_resident_bytes.set(0, device=label)
        self._status.restarting(device, reason)

    def _complete(self, action: ps.Complete) -> None:
        pending = self._pending.pop(action.request_id, None)
        if pending is None:
            return
        for device in pending.devices:
            if not self._state.waiting(device):  # its last request: the device is idle
                self._series[device].batch_requests.set(0)
        if pending.waited:  # a request's (a control message waits in no gauge)
            elapsed = self._loop.time() - pending.start
            for series in pending.waited:
                series.requests_waiting.dec()
                if action.error is None:
                    series.request_seconds.observe(elapsed)
        if pending.future.done():  # its requester went away
            return
        if action.error is not None:
            pending.future.set_exception(action.error)
        elif pending.reply is not None:
            pending.future.set_result(pending.reply)
        elif len(pending.outputs) == 1:
            pending.future.set_result(pending.outputs[0][1])
        else:  # a request's chunks, in order
            x = pending.x
            outputs = sorted(pending.outputs, key=lambda output: output[0])
            pending.future.set_result(RawTensor(b"".join(output.data for _, output in outputs), x.dtype, x.shape))

    def _spawn(self, device: int, generation: int) -> None:
        """Start a process for `device`; its Ready then comes over its socket. A process that cannot
        even be started (no file descriptor left for its pipes, no memory to fork) counts as a start
        that failed, so the pool's backoff and give-up apply as to any other."""
        spec = self.specs[device]
        try:
            process, parent_pipe = self._started_process(spec, generation)
        except OSError as e:
            self._log.error("cannot start a device process", device=device, device_label=spec.label,
                            error=f"{type(e).__name__}: {e}")
            now = self._loop.time()
            error = CakempError(f"could not start its process: {e.strerror or e}")
            # As if it reported StartFailure and exited: a first start fails the node's start, a
            # restart waits its backoff (or gives up). Its exit is the one that was never started.
            self._act(self._state.start_failed(device, now, error))
            if isinstance(self._state.phase(device), ps.Killing):
                self._act(self._state.exited(device, now, None))
            return
        self._gone[device] = asyncio.Event()
        self._readies[device] = None
        self._processes[device], self._parent_pipes[device] = process, parent_pipe
        self._loop.add_reader(process.sentinel, self._exited, device)

    def _started_process(self, spec: DeviceSpec, generation: int):
        """A started process for `spec` and the write end of its pipe; OSError, with nothing left
        open, if it cannot be started."""
        # Only we hold the write end; the child sees EOF on its read end when we are gone.
        reader, writer = self._context.Pipe(duplex=False)
        try:
            process = self._context.Process(
                target=self._device_main,
                args=(spec, reader, os.getpid(), generation, tuple(s.endpoint for s in self.specs)),
                name=f"cakemp-device-{spec.index}", daemon=True,
            )
            with _visible_gpu(spec.gpu):
                process.start()
        except BaseException:
            writer.close()
            raise
        finally:
            reader.close()
        return process, writer


@contextlib.contextmanager
def _visible_gpu(gpu: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES for a child about to be spawned ("" hides every GPU from a CPU process)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu if gpu is not None else ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
