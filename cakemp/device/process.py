"""The device process: spawned by the front, one per device, serving its ipc socket.

Lifecycle: die with the parent (PR_SET_PDEATHSIG and a parent-death pipe), load only this
device's layers (reporting Loaded progress after each), report Ready (or StartFailure), then
serve until the parent is gone. It drains every message waiting on its sockets into a
Scheduler (scheduler.py says which run together) and runs them a step at a time: several
sessions' hops as one batch (DeviceService.run_step), and a piece of a prompt it cuts. Each
step sends one message to the front (`Answers`: every activation and failure it finished, the
batches the runner computed together, for the metrics, and what prefix reuse and the experts'
cache did, when that changed) and one `Hops` to each next device of the routes it ran; a Ping
is answered at once. While a step runs long, the device tells the front every `progress_s` seconds
(between slices of its ops), so that the front's watchdog never takes a busy device for a hung
one. This module is imported by the front to name the spawn target, so torch (via
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

from cakemp import heap, log
from cakemp.device.scheduler import Gathering, Scheduler
from cakemp.ipc import (
    Activation,
    Answers,
    Clear,
    DeviceChannel,
    End,
    ErrorCode,
    Failure,
    Hop,
    Hops,
    Loaded,
    Ping,
    Pong,
    Progress,
    Ready,
    StartFailure,
    error_code,
    joined,
    trace,
)
from cakemp.ipc.spec import DeviceSpec

_PR_SET_PDEATHSIG = 1


def main(spec: DeviceSpec, parent_pipe: Connection, parent_pid: int, generation: int = 0,
         peers: Sequence[str] = ()) -> None:
    """Entry point of the spawned process (CUDA_VISIBLE_DEVICES was set by the parent).

    `generation`: which start of this device this is; `peers[i]`: device i's endpoint.
    """
    _die_with_parent(parent_pid)
    if spec.cpus is not None:  # first: every thread started from here on (zmq's, torch's) inherits it
        os.sched_setaffinity(0, spec.cpus)
    # Ctrl-C reaches the whole process group; the front decides when devices stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.configure(spec.log_format, spec.log_level)
    logger = log.get_logger(device=spec.index)
    channel = DeviceChannel(spec.endpoint, parent_pipe.fileno(), peers,
                            on_garbage=lambda error: logger.error("bad ipc message", error=str(error)))
    total = len(spec.parts)
    # Progress from the first moment: the front counts a silent device as hung.
    channel.send(Loaded(0, total))
    try:
        service = _load(spec, lambda loaded: channel.send(Loaded(loaded, total)), generation)
    except Exception as e:
        logger.error("device load failed", device_label=spec.label, error=f"{type(e).__name__}: {e}")
        channel.send(StartFailure(error_code(e), str(e)))
        channel.close(linger_ms=5000)
        sys.exit(1)
    service.progress = _reporter(channel, spec.progress_s)
    heap.keep_freed_memory()  # a prompt's activations and frames reused, not mapped afresh each prompt (heap.py)
    frozen = heap.freeze_loaded()  # torch and the layers: out of every garbage collection from here on
    channel.send(Ready("cuda" if spec.gpu is not None else "cpu", service.memory_bytes(), len(spec.parts)))
    logger.info("device ready", device_label=spec.label, layers=len(spec.parts), pid=os.getpid(),
                threads=service.threads(), max_batch=spec.max_batch, prefill_chunk=spec.prefill_chunk,
                weight_bytes=service.runner.weight_bytes, frozen_objects=frozen)
    _serve(spec, channel, service, logger)


def _serve(spec: DeviceSpec, channel: DeviceChannel, service, logger) -> None:
    """Run steps until the parent is gone (or the device faults: then exit 1)."""
    scheduler = Scheduler(spec.max_batch, spec.prefill_chunk, cut=spec.workload.chunked)
    gathering = Gathering()

    def take(timeout_s: float | None, poll_s: float = 0.0) -> bool:
        """Queue what arrives within `timeout_s` (looking without sleeping for `poll_s` first), answering
        Pings at once; False once the parent is gone."""
        messages = channel.receive(timeout_s, poll_s)
        if messages is None:
            return False
        now = time.monotonic()
        for message in messages:
            if isinstance(message, Hops):
                for task in service.tasks(message):
                    if task.hop.trace:
                        task.hop = task.hop._replace(trace=(*task.hop.trace, trace.now()))
                    gathering.arrived(task.session, now)
                    scheduler.add(task)
            elif isinstance(message, Ping):
                channel.send(Pong())
            elif isinstance(message, Clear | End):
                gathering.arrived(message.session, now)
                scheduler.add(message)
            else:
                logger.error("unexpected ipc message", kind=type(message).__name__)
        return True

    alive = take(None)
    while alive:
        deadline = time.monotonic() + gathering.window_s
        while alive and gathering.awaited() - scheduler.sessions() and (left := deadline - time.monotonic()) > 0:
            alive = take(left)
        step = scheduler.next_step(service.runner.sessions())
        for control in step.controls:
            if isinstance(control, End):
                gathering.ended(control.session)
            _answer_control(channel, service, control)
        if step.pieces:
            started = time.monotonic_ns()  # the same clock as time.monotonic(), in ns for the trace
            stepped = service.run_step(step.pieces)
            ran = time.monotonic_ns()
            scheduler.ran(step, (ran - started) / 1e9)
            _send_step(spec, channel, service, stepped, started, ran)
            for onward in stepped.onward:
                if isinstance(onward.item, Failure):
                    scheduler.drop(onward.task)  # pieces of it left: they run no more
            now = time.monotonic()
            gathering.stepped({onward.task.session for onward in stepped.onward}, now - started / 1e9, now, step.decodes)
        if service.poisoned is not None:
            # The CUDA context fails every call from now on: end, for the front to start afresh.
            logger.error("device fault; exiting so that the front restarts this device", device_label=spec.label,
                         error=service.poisoned)
            channel.close(linger_ms=5000)
            sys.exit(1)
        # Idle: a device owed a session's next request looks for it a while before it sleeps.
        alive = alive and (take(0) if scheduler else take(None, spec.poll_s if gathering.owed() else 0.0))
    channel.close()


def _answer_control(channel: DeviceChannel, service, control: Clear | End) -> None:
    """A Goodbye's or a closed connection's freeing done, answered (after the reports it changed,
    so that the front counts them by then)."""
    done = service.handle(control)
    reports = _reports(service)
    if isinstance(done, tuple):
        failure, text = done
        channel.send(Answers(failures=(failure,), **reports, data=text))
        return
    if reports:
        channel.send(Answers(**reports))
    channel.send(done)


def _send_step(spec: DeviceSpec, channel: DeviceChannel, service, stepped, started: int, ran: int) -> None:
    """A step's results in one message to each next device of their routes (Hops) and one to the
    front (Answers: its activations and failures, with the step's batches and reports). A hand-off
    a next device cannot take is answered to the front: every chunk gets its answer."""
    activations, failures, hand_offs = [], [], {}
    for task, device, item, data in stepped.onward:
        if task.hop.trace and not isinstance(item, Failure):
            item = item._replace(trace=(*task.hop.trace, started, ran, trace.now()))
        if isinstance(item, Hop):
            hand_offs.setdefault(device, []).append((item, data))
        else:
            (activations if isinstance(item, Activation) else failures).append((item, data))
    for device, hops in hand_offs.items():
        message = Hops(tuple(hop for hop, _ in hops), joined([data for _, data in hops]))
        if not channel.hand_off(device, message):
            for hop, _ in hops:
                text = (f"device {spec.label} could not pass the activation on to device #{device} (its queue is "
                        "full or it is gone)").encode()
                failures.append((Failure(hop.request_id, ErrorCode.DEVICE_LOST, hop.chunk, 1, len(text)), text))
    answered = activations + failures
    channel.send(Answers(tuple(item for item, _ in activations), tuple(item for item, _ in failures),
                         tuple(stepped.batches), **_reports(service),
                         data=joined([data for _, data in answered]) if answered else b""))


def _reports(service) -> dict[str, tuple]:
    """What prefix reuse and the offloaded experts' cache did, if anything changed (as Answers' fields)."""
    prefix, experts = service.prefix_report(), service.expert_report()
    reports = {}
    if prefix is not None:
        reports["prefixes"] = (prefix,)
    if experts is not None:
        reports["experts"] = (experts,)
    return reports


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
