"""The device processes of this node: start, requests in flight, hangs, deaths, restarts, stop.

One spawned process per device, each behind its own ipc socket. A request is a future keyed by
request id; the device answers its socket in order, so requests to different devices run in
parallel and requests to one device queue there.

A device fails when its process dies (seen at once through its sentinel fd), or stays silent
while it owes the front a message (then the front kills it): a reply for `request_timeout`
seconds, or its next loaded layer for LOAD_SILENCE_S while it starts. A device that failed
after it had reported Ready is restarted in place, reloading its layers, while the others keep
serving: its requests in flight fail with DeviceLost, so do requests to it until it is back,
and a session that had KV state in the dead process gets one DeviceLost saying so when it next
relies on that state. After `restart_attempts` failed starts in a row the pool gives up and
sets `failed`, for the front to exit and leave the node to its service manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
from collections.abc import Iterator, Sequence

from cakemp import errors, log
from cakemp.device import process as device_process
from cakemp.device.spec import DeviceSpec
from cakemp.errors import CakempError, ConfigError, DeviceLost, RequestError
from cakemp.front.metrics import Metrics
from cakemp.front.status import NodeStatus
from cakemp.ipc import Activation, Clear, Done, End, Failure, Forward, FrontChannel, Loaded, Message, Op, Ready

# A starting device that reports no loaded layer for this long is hung. Not --request-timeout:
# that one is sized for requests, and a device's first layer comes only after torch and its
# CUDA context have started, which can take many seconds.
LOAD_SILENCE_S = 300.0
_STOP_GRACE_S = 3.0
_REAP_S = 1.0
# Delay before restart attempt n (0-based): doubling from the first, capped.
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0


class DevicePool:
    def __init__(self, specs: Sequence[DeviceSpec], *, status: NodeStatus, metrics: Metrics,
                 request_timeout: float = 60.0, restart_attempts: int = 5):
        self.specs = tuple(specs)
        self.failed = asyncio.Event()  # set when a device could not be restarted; `failure` says why
        self.failure: str | None = None
        self._status, self._metrics = status, metrics
        self._request_timeout = request_timeout
        self._restart_attempts = restart_attempts
        self._context = multiprocessing.get_context("spawn")
        self._devices: list[_Device] = []
        self._restarts: set[asyncio.Task] = set()
        self._request_ids = itertools.count(1)  # 0 is the start (Ready) exchange
        self._log = log.get_logger()

    async def start(self) -> tuple[Ready, ...]:
        """Spawn every device process and wait until all have loaded their layers.

        Raises ConfigError when a device rejects the configuration (its checkpoint, say), else
        CakempError or DeviceLost; every process is stopped before it raises. Failures at this
        first start are not retried: the configuration is the likely cause.
        """
        for spec in self.specs:
            device = _Device(spec, self._request_timeout, self._status, self._on_failure)
            self._devices.append(device)
            device.spawn(self._context)
        try:
            readies = tuple(await asyncio.gather(*(device.ready for device in self._devices)))
        except BaseException:
            await self.stop()
            raise
        for device, ready in zip(self._devices, readies):
            self._metrics.device_loaded(device.spec.label, ready.memory_bytes, device.spec.kv_budget_bytes)
        return readies

    async def forward(self, device: int, session: int, dtype: int, shape: tuple[int, ...],
                      ops: tuple[Op, ...], data) -> Activation:
        """Run `ops` on `device` over activation bytes `data`; raises the device's RequestError or DeviceLost."""
        target = self._devices[device]
        target.admit(session, ops)
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._metrics.requests_waiting.inc(device=target.spec.label)
        try:
            reply = await target.request(Forward(session, next(self._request_ids), dtype, shape, ops, data))
        finally:
            self._metrics.requests_waiting.dec(device=target.spec.label)
        self._metrics.device_request_seconds.observe(loop.time() - start, device=target.spec.label)
        return self._answer(target, reply)

    async def clear(self, device: int, session: int) -> Done:
        """Goodbye: drop the session's caches on `device` (a fresh start, so a lost state no longer matters)."""
        self._devices[device].lost.discard(session)
        return await self._done(device, Clear(session, next(self._request_ids)))

    async def end(self, device: int, session: int) -> Done:
        """The connection closed: free everything of the session on `device`."""
        self._devices[device].sessions.discard(session)
        self._devices[device].lost.discard(session)
        return await self._done(device, End(session, next(self._request_ids)))

    def label(self, device: int) -> str:
        return self.specs[device].label

    async def stop(self) -> None:
        """Stop restarting, fail requests in flight, stop every device process (SIGTERM, then
        SIGKILL after a grace period) and close the sockets. Safe to call again."""
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*(device.stop() for device in self._devices))

    async def _done(self, device: int, request: Clear | End) -> Done:
        target = self._devices[device]
        return self._answer(target, await target.request(request))

    def _answer(self, target: _Device, reply: Message) -> Activation | Done:
        """The reply to a request, its KV bytes recorded; the device's RequestError raised for a Failure."""
        if isinstance(reply, Failure):
            raise _request_error(reply)
        self._metrics.kv_bytes.set(reply.kv_bytes, device=target.spec.label)
        return reply

    def _on_failure(self, device: _Device, reason: str) -> None:
        """A serving device failed: restart it in the background."""
        task = asyncio.get_running_loop().create_task(self._restart(device, reason), name=f"restart-{device.spec.label}")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, device: _Device, reason: str) -> None:
        label = device.spec.label
        self._log.error("device failed; restarting it", device=device.spec.index, device_label=label, reason=reason)
        self._metrics.device_restarts.inc(device=label)
        self._metrics.kv_bytes.set(0, device=label)
        self._status.restarting(device.spec.index, reason)
        for attempt in itertools.count():
            await asyncio.sleep(min(_BACKOFF_FIRST_S * 2**attempt, _BACKOFF_MAX_S))
            device.spawn(self._context)
            try:
                ready = await device.ready
            except CakempError as e:
                await device.reap()
                self._log.error("device restart failed", device=device.spec.index, device_label=label,
                                attempt=attempt + 1, error=str(e))
                if attempt + 1 >= self._restart_attempts:
                    self.failure = f"device {label} failed to start {attempt + 1} times in a row (last: {e})"
                    self.failed.set()
                    return
                continue
            self._metrics.device_loaded(label, ready.memory_bytes, device.spec.kv_budget_bytes)
            self._status.restarted(device.spec.index)
            self._log.info("device restarted", device=device.spec.index, device_label=label, pid=device.process.pid)
            return


def _request_error(failure: Failure) -> RequestError:
    """The device's exception as the same RequestError subclass here, else an InternalError."""
    cls = getattr(errors, failure.error, None)
    if not (isinstance(cls, type) and issubclass(cls, RequestError)):
        cls = errors.InternalError
    return cls(failure.message)


def _start_error(failure: Failure) -> CakempError:
    cls = getattr(errors, failure.error, None)
    if isinstance(cls, type) and issubclass(cls, ConfigError):
        return ConfigError(failure.message)
    return CakempError(f"{failure.error}: {failure.message}")


class _Device:
    """One device: its socket (kept across restarts), its current process, the messages that
    process owes, and the sessions that may hold KV state in it."""

    def __init__(self, spec: DeviceSpec, request_timeout: float, status: NodeStatus, on_failure):
        self.spec = spec
        self.process = None
        self.ready: asyncio.Future | None = None  # the current process's Ready
        # Why requests cannot be served now ("is starting", "is restarting after it died …"),
        # None while serving.
        self.down: str | None = "is starting"
        self.sessions: set[int] = set()  # sessions that sent requests to the current process
        self.lost: set[int] = set()  # sessions whose KV state died with an earlier process
        self._request_timeout = request_timeout
        self._status = status
        self._on_failure = on_failure
        self._channel = FrontChannel(spec.endpoint)
        # Requests sent and not yet answered, by request id, whether or not anyone still
        # awaits them (the device owes the answer all the same); 0 is the Ready.
        self._pending: dict[int, asyncio.Future] = {}
        # Loop time of the process's last message, or of when it began to owe one; a timer
        # looks at it while something is owed (lazily: the hot path only stores a time).
        self._heard = 0.0
        self._watch: asyncio.TimerHandle | None = None
        self._hung: str | None = None  # set when we killed the process for its silence
        self._gone = asyncio.Event()  # the current process has exited
        self._parent_pipe = None
        self._closed = False
        self._log = log.get_logger(device=spec.index)
        self._receiver = asyncio.get_running_loop().create_task(self._receive(), name=f"device-{spec.index}-receiver")

    def spawn(self, context) -> None:
        """Start a process for this device; `ready` resolves once it has loaded its layers."""
        loop = asyncio.get_running_loop()
        self.ready = loop.create_future()
        self._owe(0, self.ready)
        self._gone = asyncio.Event()
        # Only we hold the write end; the child sees EOF on its read end when we are gone.
        reader, self._parent_pipe = context.Pipe(duplex=False)
        self.process = context.Process(
            target=device_process.main, args=(self.spec, reader, os.getpid()),
            name=f"cakemp-device-{self.spec.index}", daemon=True,
        )
        with _visible_gpu(self.spec.gpu):
            self.process.start()
        reader.close()
        loop.add_reader(self.process.sentinel, self._exited)

    def admit(self, session: int, ops: Sequence[Op]) -> None:
        """Take note of the session's Forward, or raise DeviceLost: while the device is down, and
        once for a session whose KV state died with an earlier process and that still relies on
        it (a request past position 0; a fresh prefill just goes ahead)."""
        if self.down is not None:
            raise DeviceLost(f"device {self.spec.label} {self.down}")
        if session in self.lost:
            self.lost.discard(session)
            if any(op.index_pos > 0 for op in ops):
                raise DeviceLost(f"device {self.spec.label} restarted; this session's KV state was lost, "
                                 "start again with a fresh prefill (index_pos 0)")
        self.sessions.add(session)

    async def request(self, msg: Message) -> Message:
        if self.down is not None:
            raise DeviceLost(f"device {self.spec.label} {self.down}")
        future = asyncio.get_running_loop().create_future()
        self._owe(msg.request_id, future)
        await self._channel.send(msg)
        return await future

    def _owe(self, request_id: int, future: asyncio.Future) -> None:
        """The process now owes the reply to `request_id`; its silence counts from now if it owed nothing."""
        loop = asyncio.get_running_loop()
        if not self._pending:
            self._heard = loop.time()
        self._pending[request_id] = future
        deadline = self._heard + self._silence_limit()
        if self._watch is None or self._watch.when() > deadline:
            self._stop_watching()
            self._watch = loop.call_at(deadline, self._check_silence)

    def _silence_limit(self) -> float:
        return LOAD_SILENCE_S if 0 in self._pending else self._request_timeout  # 0: its Ready, before any request

    def _check_silence(self) -> None:
        """Kill the process if it has owed a message too long without a word, else look again when it would have."""
        self._watch = None
        if not self._pending:
            return
        limit = self._silence_limit()
        if asyncio.get_running_loop().time() < self._heard + limit:
            self._watch = asyncio.get_running_loop().call_at(self._heard + limit, self._check_silence)
            return
        self._hung = f"loaded no layer within {limit:g} s" if 0 in self._pending else f"did not answer within {limit:g} s"
        self.process.kill()  # its sentinel then reports the failure, with this reason

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def _receive(self) -> None:
        while True:
            try:
                reply = await self._channel.receive()
            except errors.ProtocolError as e:
                self._log.error("bad ipc reply", error=str(e))
                continue
            self._heard = asyncio.get_running_loop().time()
            if isinstance(reply, Loaded):
                self._status.loaded(self.spec.index, reply.layers)
                continue
            request_id = 0 if isinstance(reply, Ready) else reply.request_id
            future = self._pending.pop(request_id, None)
            if future is None or future.done():  # a dead process's late reply, or its requester went away
                continue
            if request_id == 0 and isinstance(reply, Failure):
                future.set_exception(_start_error(reply))
                continue
            if request_id == 0:
                # Serving from its Ready on: a death from now on is a failure to restart from,
                # even while other devices are still loading.
                self.down = None
            future.set_result(reply)

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        # The sentinel closes as the process exits, a moment before it can be reaped.
        self.process.join(_REAP_S)
        self._parent_pipe.close()
        self._gone.set()
        self._stop_watching()
        reason, self._hung = self._hung or f"died (exit code {self.process.exitcode})", None
        if self._closed:
            return
        was_serving = self.down is None
        self.down = f"is restarting after it {reason}"
        error = DeviceLost(f"device {self.spec.label} {reason}")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self.lost |= self.sessions
        self.sessions = set()
        if was_serving:
            self._on_failure(self, reason)

    async def reap(self) -> None:
        """Kill the current process if it still runs (a start that failed) and wait until it is gone."""
        if self.process.exitcode is None:
            self.process.kill()
        await self._gone.wait()

    async def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.down = "is stopping"
        error = DeviceLost(f"device {self.spec.label} is stopping")
        for request_id, future in self._pending.items():
            if future.done():
                continue
            if request_id == 0:
                future.cancel()  # a Ready nobody awaits any more
            else:
                future.set_exception(error)
        self._pending.clear()
        self._stop_watching()
        self._receiver.cancel()
        if self.process is not None and not self._gone.is_set():
            self.process.terminate()
            try:
                await asyncio.wait_for(self._gone.wait(), _STOP_GRACE_S)
            except TimeoutError:
                self.process.kill()
                await self._gone.wait()
        self._channel.close()


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
