"""The device process: spawned by the front, one per device, serving its ipc socket.

Lifecycle: die with the parent (PR_SET_PDEATHSIG and a parent-death pipe), load only this
device's layers (reporting Loaded progress after each), report Ready (or the load Failure),
then answer requests one at a time until the parent is gone. (Cross-session batching would
drain every request waiting on the socket here and hand DeviceService the list.) This module is
imported by the front to name the spawn target, so torch (via DeviceService) is imported only
inside `main`, in the child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection

from cakemp import log
from cakemp.device.spec import DeviceSpec
from cakemp.errors import ProtocolError
from cakemp.ipc import DeviceChannel, Failure, Loaded, Ready

_PR_SET_PDEATHSIG = 1


def main(spec: DeviceSpec, parent_pipe: Connection, parent_pid: int) -> None:
    """Entry point of the spawned process (CUDA_VISIBLE_DEVICES was set by the parent)."""
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the front decides when devices stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.configure(spec.log_format, spec.log_level)
    logger = log.get_logger(device=spec.index)
    channel = DeviceChannel(spec.endpoint, parent_pipe.fileno())
    total = len(spec.layers)
    # Progress from the first moment: the front counts a silent device as hung.
    channel.send(Loaded(0, total))
    try:
        service = _load(spec, lambda loaded: channel.send(Loaded(loaded, total)))
    except Exception as e:
        logger.error("device load failed", device_label=spec.label, error=f"{type(e).__name__}: {e}")
        channel.send(Failure(0, type(e).__name__, str(e)))
        channel.close(linger_ms=5000)
        sys.exit(1)
    channel.send(Ready("cuda" if spec.gpu is not None else "cpu", service.memory_bytes(), len(spec.layers)))
    logger.info("device ready", device_label=spec.label, layers=len(spec.layers), pid=os.getpid())
    while True:
        try:
            request = channel.receive()
        except ProtocolError as e:  # only the front writes here; log and carry on
            logger.error("bad ipc message", error=str(e))
            continue
        if request is None:
            break
        channel.send(service.handle(request))
        if service.poisoned is not None:
            # The CUDA context fails every call from now on: end, for the front to start afresh.
            logger.error("device fault; exiting so that the front restarts this device", device_label=spec.label,
                         error=service.poisoned)
            channel.close(linger_ms=5000)
            sys.exit(1)
    channel.close()


def _die_with_parent(parent_pid: int) -> None:
    # SIGKILL us when the parent dies, even mid-forward; then close the race where it died first.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent-death pipe still ends the loop
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _load(spec: DeviceSpec, on_layer):
    from cakemp.device.service import DeviceService  # torch, in the child only

    return DeviceService.load(spec, on_layer)
