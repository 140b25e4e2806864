"""The device processes of this node: start, requests in flight, death, stop.

One spawned process per device, each behind its own ipc socket. A request is a future keyed by
request id; the device answers its socket in order, so requests to different devices run in
parallel and requests to one device queue there. The death of a process is seen at once
through its sentinel fd: its in-flight requests fail with DeviceLost and `lost` is set, which
is the seam for whoever supervises the pool (today the front exits; later, restart in place).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
from typing import Iterator, Sequence

from cakemp import errors, log
from cakemp.device import process as device_process
from cakemp.device.spec import DeviceSpec
from cakemp.errors import CakempError, ConfigError, DeviceLost, RequestError
from cakemp.ipc import Activation, Clear, Done, End, Failure, Forward, FrontChannel, Message, Op, Ready

_STOP_GRACE_S = 3.0


class DevicePool:
    def __init__(self, specs: Sequence[DeviceSpec]):
        self.specs = tuple(specs)
        self.lost = asyncio.Event()  # set when a device process dies unasked
        self.lost_error: DeviceLost | None = None
        self._devices: list[_Device] = []
        self._request_ids = itertools.count(1)  # 0 is the start (Ready) exchange
        self._log = log.get_logger()

    async def start(self) -> tuple[Ready, ...]:
        """Spawn every device process and wait until all have loaded their layers.

        Raises ConfigError when a device rejects the configuration (its checkpoint, say), else
        CakempError or DeviceLost; every process is stopped before it raises.
        """
        context = multiprocessing.get_context("spawn")
        for spec in self.specs:
            self._devices.append(_Device(context, spec, self._on_lost))
        try:
            return tuple(await asyncio.gather(*(device.ready for device in self._devices)))
        except BaseException:
            await self.stop()
            raise

    async def forward(self, device: int, session: int, dtype: int, shape: tuple[int, ...],
                      ops: tuple[Op, ...], data) -> Activation:
        """Run `ops` on `device` over activation bytes `data`; raises the device's RequestError or DeviceLost."""
        reply = await self._devices[device].request(
            Forward(session, next(self._request_ids), dtype, shape, ops, data))
        if isinstance(reply, Failure):
            raise _request_error(reply)
        return reply

    async def clear(self, device: int, session: int) -> Done:
        """Goodbye: drop the session's caches on `device`."""
        return await self._done(device, Clear(session, next(self._request_ids)))

    async def end(self, device: int, session: int) -> Done:
        """The connection closed: free everything of the session on `device`."""
        return await self._done(device, End(session, next(self._request_ids)))

    def label(self, device: int) -> str:
        return self.specs[device].label

    async def stop(self) -> None:
        """Stop every device process (SIGTERM, then SIGKILL after a grace period) and close sockets."""
        await asyncio.gather(*(device.stop() for device in self._devices))

    async def _done(self, device: int, request: Clear | End) -> Done:
        reply = await self._devices[device].request(request)
        if isinstance(reply, Failure):
            raise _request_error(reply)
        return reply

    def _on_lost(self, error: DeviceLost) -> None:
        self._log.error("device process died", error=str(error))
        if self.lost_error is None:
            self.lost_error = error
        self.lost.set()


def _request_error(failure: Failure) -> RequestError:
    """The device's exception as the same RequestError subclass here, else a plain RequestError."""
    cls = getattr(errors, failure.error, None)
    if not (isinstance(cls, type) and issubclass(cls, RequestError)):
        cls = RequestError
    return cls(failure.message)


def _start_error(failure: Failure) -> CakempError:
    cls = getattr(errors, failure.error, None)
    if isinstance(cls, type) and issubclass(cls, ConfigError):
        return ConfigError(failure.message)
    return CakempError(f"{failure.error}: {failure.message}")


class _Device:
    """One device process, its socket, and its requests in flight."""

    def __init__(self, context, spec: DeviceSpec, on_lost):
        loop = asyncio.get_running_loop()
        self.spec = spec
        self._on_lost = on_lost
        self._stopping = False
        self._error: DeviceLost | None = None
        self._channel = FrontChannel(spec.endpoint)
        self._pending: dict[int, asyncio.Future] = {}
        self.ready: asyncio.Future = loop.create_future()
        self._pending[0] = self.ready
        # Only we hold the write end; the child sees EOF on its read end when we are gone.
        reader, self._parent_pipe = context.Pipe(duplex=False)
        self.process = context.Process(
            target=device_process.main, args=(spec, reader, os.getpid()),
            name=f"cakemp-device-{spec.index}", daemon=True,
        )
        with _visible_gpu(spec.gpu):
            self.process.start()
        reader.close()
        loop.add_reader(self.process.sentinel, self._exited)
        self._receiver = loop.create_task(self._receive(), name=f"device-{spec.index}-receiver")

    async def request(self, msg: Message) -> Message:
        if self._error is not None:
            raise self._error
        if self._stopping:
            raise DeviceLost(f"device {self.spec.label} is stopping")
        future = asyncio.get_running_loop().create_future()
        self._pending[msg.request_id] = future
        try:
            await self._channel.send(msg)
            return await future
        finally:
            self._pending.pop(msg.request_id, None)

    async def _receive(self) -> None:
        logger = log.get_logger(device=self.spec.index)
        while True:
            try:
                reply = await self._channel.receive()
            except errors.ProtocolError as e:
                logger.error("bad ipc reply", error=str(e))
                continue
            request_id = 0 if isinstance(reply, Ready) else reply.request_id
            future = self._pending.pop(request_id, None)
            if future is None or future.done():  # its requester went away (connection closed)
                continue
            if request_id == 0 and isinstance(reply, Failure):
                future.set_exception(_start_error(reply))
            else:
                future.set_result(reply)

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(0)
        if self._stopping:
            return
        self._error = DeviceLost(f"device {self.spec.label} died (exit code {self.process.exitcode})")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._error)
        self._pending.clear()
        self._on_lost(self._error)

    async def stop(self) -> None:
        self._stopping = True
        self._receiver.cancel()
        if self.process.is_alive():
            self.process.terminate()
            deadline = asyncio.get_running_loop().time() + _STOP_GRACE_S
            while self.process.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self._channel.close()
        self._parent_pipe.close()


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
