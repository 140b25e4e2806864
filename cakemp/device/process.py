"""The device process: spawned by the front, one per device, serving its ipc socket.

Lifecycle: die with the parent (PR_SET_PDEATHSIG and a parent-death pipe), load only this
device's layers (reporting Loaded progress after each), report Ready (or StartFailure), then
serve one message at a time until the parent is gone: a Hop's result goes to the next
device of its route or, from the last, to the front; a Ping is answered at once. While one
request runs long, the device tells the front every `progress_s` seconds (between slices of
its ops), so that the front's watchdog never takes a busy device for a hung one. (Cross-session
batching would drain every request waiting on the sockets here and hand DeviceService the
list.) This module is imported by the front to name the spawn target, so torch (via
DeviceService) is imported only inside `main`, in the child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from cakemp import log
from cakemp.device.spec import DeviceSpec
from cakemp.errors import ProtocolError
from cakemp.ipc import (
    DeviceChannel,
    ErrorCode,
    Failure,
    Hop,
    Loaded,
    Ping,
    Pong,
    Progress,
    Ready,
    StartFailure,
    error_code,
)

_PR_SET_PDEATHSIG = 1


def main(spec: DeviceSpec, parent_pipe: Connection, parent_pid: int, generation: int = 0,
         peers: Sequence[str] = (), progress_s: float = 15.0) -> None:
    """Entry point of the spawned process (CUDA_VISIBLE_DEVICES was set by the parent).

    `generation`: which start of this device this is; `peers[i]`: device i's endpoint.
    """
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the front decides when devices stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.configure(spec.log_format, spec.log_level)
    logger = log.get_logger(device=spec.index)
    channel = DeviceChannel(spec.endpoint, parent_pipe.fileno(), peers)
    total = len(spec.layers)
    # Progress from the first moment: the front counts a silent device as hung.
    channel.send(Loaded(0, total))
    try:
        service = _load(spec, lambda loaded: channel.send(Loaded(loaded, total)), generation)
    except Exception as e:
        logger.error("device load failed", device_label=spec.label, error=f"{type(e).__name__}: {e}")
        channel.send(StartFailure(error_code(e), str(e)))
        channel.close(linger_ms=5000)
        sys.exit(1)
    service.progress = _reporter(channel, progress_s)
    channel.send(Ready("cuda" if spec.gpu is not None else "cpu", service.memory_bytes(), len(spec.layers)))
    logger.info("device ready", device_label=spec.label, layers=len(spec.layers), pid=os.getpid(),
                threads=service.threads())
    while True:
        try:
            request = channel.receive()
        except ProtocolError as e:  # only the front writes here; log and carry on
            logger.error("bad ipc message", error=str(e))
            continue
        if request is None:
            break
        if isinstance(request, Ping):
            channel.send(Pong())
            continue
        if isinstance(request, Hop):  # between chunks and requests too, not only inside one
            service.progress(request.request_id)
        reply = service.handle(request)
        if isinstance(reply, Hop):
            if not channel.hand_off(reply.stages[0].device, reply):
                # Every chunk gets its answer: this one's is that it went no further.
                channel.send(Failure(reply.request_id, ErrorCode.DEVICE_LOST,
                                     f"device {spec.label} could not pass the activation on to device "
                                     f"#{reply.stages[0].device} (its queue is full or it is gone)", reply.chunk))
        elif reply is not None:
            channel.send(reply)
        if service.poisoned is not None:
            # The CUDA context fails every call from now on: end, for the front to start afresh.
            logger.error("device fault; exiting so that the front restarts this device", device_label=spec.label,
                         error=service.poisoned)
            channel.close(linger_ms=5000)
            sys.exit(1)
    channel.close()


def _reporter(channel: DeviceChannel, every_s: float):
    """service.progress: tell the front a request is still running once it has not heard from us for `every_s`."""

    def progress(request_id: int) -> None:
        if time.monotonic() - channel.last_sent >= every_s:
            channel.send(Progress(request_id))

    return progress


def _die_with_parent(parent_pid: int) -> None:
    # SIGKILL us when the parent dies, even mid-forward; then close the race where it died first.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent-death pipe still ends the loop
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _load(spec: DeviceSpec, on_layer, generation: int):
    from cakemp.device.service import DeviceService  # torch, in the child only

    return DeviceService.load(spec, on_layer, generation)
