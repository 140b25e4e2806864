"""The device process: spawned by the front, one per device, serving its ipc socket.

Lifecycle: die with the parent (PR_SET_PDEATHSIG and a parent-death pipe), load only this
device's layers (reporting Loaded progress after each), report Ready (or StartFailure), then
serve until the parent is gone. It drains every message waiting on its sockets into a
Scheduler (scheduler.py says which run together) and runs them a step at a time: several
sessions' hops as one batch (DeviceService.run_step), each result going to the next device
of its route or, from the last, to the front; a Ping is answered at once. Each step is
reported to the front (StepReport) for its metrics. While a step runs long, the device tells
the front every `progress_s` seconds (between slices of its ops), so that the front's
watchdog never takes a busy device for a hung one. This module is imported by the front to name the spawn target, so torch (via
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
from cakemp.device.scheduler import Scheduler
from cakemp.device.spec import DeviceSpec
from cakemp.ipc import (
    Clear,
    DeviceChannel,
    End,
    ErrorCode,
    Failure,
    Hop,
    Loaded,
    Ping,
    Pong,
    Progress,
    Ready,
    StartFailure,
    StepReport,
    error_code,
)

_PR_SET_PDEATHSIG = 1
# After a step of several sessions, the device waits for their next requests at most this
# fraction of the step's time, and never more than GATHER_MAX_S: enough for a master's round
# trip on a local network, little against the step a straggler would otherwise wait for.
GATHER_FRACTION = 0.25
GATHER_MAX_S = 0.005


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
    channel = DeviceChannel(spec.endpoint, parent_pipe.fileno(), peers,
                            on_garbage=lambda error: logger.error("bad ipc message", error=str(error)))
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
                threads=service.threads(), max_batch=spec.max_batch, step_tokens=spec.step_tokens)
    scheduler = Scheduler(spec.max_batch, spec.step_tokens)

    def take(timeout_s: float | None) -> bool:
        """Queue what arrives within `timeout_s`, answering Pings at once; False once the parent is gone."""
        messages = channel.receive(timeout_s)
        if messages is None:
            return False
        for message in messages:
            if isinstance(message, Ping):
                channel.send(Pong())
            elif isinstance(message, Hop | Clear | End):
                scheduler.add(message)
            else:
                logger.error("unexpected ipc message", kind=type(message).__name__)
        return True

    # The sessions of the last step, and how long to wait for their next requests.
    expected: set[int] = set()
    gather_s = 0.0
    alive = take(None)
    while alive:
        # A batch's sessions come back a round trip after their answers, one after another: a
        # step started at the first arrival would leave the others waiting a whole step (the
        # batch splits into cohorts taking turns). So wait for them a little.
        deadline = time.monotonic() + gather_s
        while alive and expected - scheduler.sessions() and (left := deadline - time.monotonic()) > 0:
            alive = take(left)
        step = scheduler.next_step()
        for control in step.controls:
            channel.send(service.handle(control))
        if step.hops:
            channel.send(StepReport(len(step.hops), step.tokens, len(scheduler)))
            started = time.monotonic()
            replies = service.run_step(step.hops)
            gather_s = min(GATHER_FRACTION * (time.monotonic() - started), GATHER_MAX_S)
            expected = {hop.session for hop in step.hops}
            for reply in replies:
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
        alive = alive and take(0 if scheduler else None)
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
