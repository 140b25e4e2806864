"""The front's bookkeeping of its devices, as a state machine with no I/O and an injected clock.

Events go in (a process was spawned, loaded a layer, became ready, exited; a request was sent,
a chunk of it answered, the device reported progress; time passed), actions come out (spawn,
kill, ping, complete a request, and what to tell the operator), and `next_deadline` says
when `tick` must be called next. `DevicePool` (pool.py) is the thin asyncio layer that owns
the processes and sockets and carries the actions out; these tests need neither.

A device is STARTING (first start), READY, RESTARTING (failed after it had been ready: waiting
out a backoff, or loading again), FAILED (given up after `restart_attempts` failed starts in a
row) or STOPPED. Each spawn is a new generation of the device; a route names the generation it
expects, so a hand-off meant for a dead process is dropped by its successor.

A request is owed by every device on its route from the moment its first chunk is sent (never
before: nothing is registered for a request that could not be sent) until each chunk sent has
its answer, or one of those devices dies. Its silence counts from the last word about it (the
send, an answered chunk, a progress report). When it has been silent for `request_timeout`,
the devices on its route are pinged: a device that answers, or reports progress on any
request, is alive (it may be busy on a long request queued ahead); a device that stays silent
for another `request_timeout` is hung and killed, and its death fails the request.

A session whose state on a device is gone is told once, by its next request that relies on it
(past position 0 there): after the device's process died, or after one of its requests failed
once part of it had run (a later chunk, a later device of the route) on a device whose state
cannot be rewound (linear attention): that state is then dropped (Forget), never continued
from half-applied. Attention-only devices keep their rollback instead.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from cakemp.errors import CakempError, DeviceLost, RequestError

# Delay before restart attempt n (0-based): doubling from the first, capped.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class DeviceState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


# Actions, for the asyncio layer to carry out.
@dataclass(frozen=True)
class Spawn:
    device: int
    generation: int


@dataclass(frozen=True)
class Kill:
    device: int
    reason: str


@dataclass(frozen=True)
class Ping:
    device: int


@dataclass(frozen=True)
class Forget:
    """Drop the session's state on `device`: a request failed after part of it had run there, and
    that state cannot be rewound (a linear-attention layer's recurrence)."""

    device: int
    session: int


@dataclass(frozen=True)
class Complete:
    """Every chunk of the request is answered (or can no longer be): resolve it, with `error` if one failed."""

    request_id: int
    error: RequestError | None


@dataclass(frozen=True)
class Started:
    """Every device is ready for the first time."""


@dataclass(frozen=True)
class StartFailed:
    """A device failed its first start: the node cannot start."""

    device: int
    error: CakempError


@dataclass(frozen=True)
class Restarting:
    device: int
    reason: str


@dataclass(frozen=True)
class RestartFailed:
    device: int
    attempt: int
    error: str


@dataclass(frozen=True)
class Restarted:
    device: int


@dataclass(frozen=True)
class GiveUp:
    reason: str


Action = Spawn | Kill | Ping | Forget | Complete | Started | StartFailed | Restarting | RestartFailed | Restarted | GiveUp


@dataclass
class _Device:
    label: str
    state: DeviceState = DeviceState.STARTING
    generation: int = 0
    loading: bool = False  # a process is running and has not reported Ready yet
    heard: float = 0.0  # when its current process last said anything
    respawn_at: float | None = None  # RESTARTING: when the next attempt starts
    attempts: int = 0  # failed restart attempts in a row
    failure: str = ""  # RESTARTING: why it went down
    killing: str | None = None  # why the front is killing its current process, once it decided to
    start_error: str | None = None  # what the loading process reported before exiting
    sessions: set[int] = field(default_factory=set)  # sessions that sent requests to the current process
    # session -> why its state here is gone (it died with an earlier process, or a failed request
    # left it half-applied), for the session's next request that relies on it
    lost: dict[int, str] = field(default_factory=dict)


@dataclass
class _Request:
    session: int
    devices: tuple[int, ...]
    deadline: float
    sent: int = 1  # chunks sent
    answered: int = 0
    sealed: bool = False  # every chunk that will be sent has been
    error: RequestError | None = None
    partial: bool = False  # the error came after part of the request had run (on an earlier device or chunk)
    pinged_at: float | None = None


class PoolState:
    def __init__(self, labels: Sequence[str], *, request_timeout: float, load_silence: float, restart_attempts: int,
                 recurrent: Sequence[bool] = ()):
        """`recurrent[i]`: device i serves layers whose state cannot be rewound (linear attention)."""
        self._devices = [_Device(label) for label in labels]
        self._recurrent = tuple(recurrent) or (False,) * len(labels)
        self._requests: dict[int, _Request] = {}
        self._request_timeout = request_timeout
        self._load_silence = load_silence
        self._restart_attempts = restart_attempts

    # -- queries

    def state(self, device: int) -> DeviceState:
        return self._devices[device].state

    def generation(self, device: int) -> int:
        return self._devices[device].generation

    def owed(self, request_id: int) -> bool:
        return request_id in self._requests

    def waiting(self, device: int) -> int:
        """Requests owed by `device` (on their way to it, running on it, or passed on by it)."""
        return sum(1 for request in self._requests.values() if device in request.devices)

    def down(self, device: int) -> DeviceLost | None:
        """Why requests to `device` cannot be served now, as the error to answer them with; None while it serves."""
        d = self._devices[device]
        if d.state is DeviceState.READY:
            return None
        why = {
            DeviceState.STARTING: "is starting",
            DeviceState.RESTARTING: f"is restarting after it {d.failure}",
            DeviceState.FAILED: "could not be restarted",
            DeviceState.STOPPED: "is stopping",
        }[d.state]
        return DeviceLost(f"device {d.label} {why}")

    def next_deadline(self) -> float | None:
        """When `tick` must next be called (None: nothing to watch)."""
        times = [r.deadline for r in self._requests.values()]
        for d in self._devices:
            if d.loading and d.killing is None:
                times.append(d.heard + self._load_silence)
            elif d.respawn_at is not None:
                times.append(d.respawn_at)
        return min(times, default=None)

    # -- device lifecycle

    def start(self, now: float) -> list[Action]:
        return [self._spawn(index, now) for index in range(len(self._devices))]

    def heard(self, device: int, now: float) -> None:
        """The device's current process said something (a layer loaded, a Pong, any reply)."""
        self._devices[device].heard = now

    def ready(self, device: int, now: float) -> list[Action]:
        d = self._devices[device]
        d.heard = now
        if not d.loading:  # a late Ready of a process already gone
            return []
        d.loading = False
        if d.state is DeviceState.STARTING:
            d.state = DeviceState.READY
            if all(other.state is DeviceState.READY for other in self._devices):
                return [Started()]
            return []
        if d.state is DeviceState.RESTARTING:
            d.state, d.attempts, d.failure = DeviceState.READY, 0, ""
            return [Restarted(device)]
        return []

    def start_failed(self, device: int, now: float, error: CakempError) -> list[Action]:
        """The loading process reported that it cannot load (it exits next)."""
        d = self._devices[device]
        d.heard = now
        if not d.loading:
            return []
        if d.state is DeviceState.STARTING:
            d.loading = False
            d.state = DeviceState.FAILED
            return [StartFailed(device, error)]
        d.start_error = d.killing = str(error)
        return [Kill(device, str(error))]  # make sure it is gone; its exit counts the attempt

    def exited(self, device: int, now: float, exitcode: int | None) -> list[Action]:
        """The device's current process is gone: fail what it owed, then restart it, count the attempt, or give up."""
        d = self._devices[device]
        reason, d.killing = d.killing or f"died (exit code {exitcode})", None
        was_loading, d.loading = d.loading, False
        actions: list[Action] = []
        if d.state in (DeviceState.STOPPED, DeviceState.FAILED):
            return self._fail_requests(device, DeviceLost(f"device {d.label} {reason}"))
        actions += self._fail_requests(device, DeviceLost(f"device {d.label} {reason}"))
        d.lost.update(dict.fromkeys(d.sessions, f"device {d.label} restarted; this session's KV state was lost"))
        d.sessions = set()
        if d.state is DeviceState.STARTING:
            d.state = DeviceState.FAILED
            return actions + [StartFailed(device, CakempError(f"device {d.label} {reason}"))]
        if d.state is DeviceState.READY:
            d.state, d.attempts, d.failure = DeviceState.RESTARTING, 0, reason
            d.respawn_at = now + _backoff(0)
            return actions + [Restarting(device, reason)]
        # RESTARTING: an attempt failed (or a process ended before it even loaded).
        if was_loading or d.start_error is not None:
            error, d.start_error = d.start_error or reason, None
            d.attempts += 1
            actions.append(RestartFailed(device, d.attempts, error))
            if d.attempts >= self._restart_attempts:
                d.state, d.respawn_at = DeviceState.FAILED, None
                return actions + [GiveUp(f"device {d.label} failed to start {d.attempts} times in a row (last: {error})")]
            d.respawn_at = now + _backoff(d.attempts)
        return actions

    def stop(self) -> list[Action]:
        """The node stops: no more restarts; every request fails."""
        for d in self._devices:
            d.state, d.respawn_at = DeviceState.STOPPED, None
        actions: list[Action] = []
        for request_id, request in list(self._requests.items()):
            labels = list(dict.fromkeys(self._devices[device].label for device in request.devices))
            which = f"device {labels[0]} is" if len(labels) == 1 else f"devices {', '.join(labels)} are"
            actions.append(Complete(request_id, DeviceLost(f"{which} stopping")))
        self._requests.clear()
        return actions

    # -- requests

    def admit(self, session: int, devices: Sequence[int], relies: Sequence[bool]) -> None:
        """Take note of the session's request on `devices`, or raise DeviceLost: while one is down,
        and once for a session whose state died with an earlier process of one of them and that
        still relies on it there (`relies[i]`: a request past position 0 on devices[i])."""
        for device in devices:
            if (error := self.down(device)) is not None:
                raise error
        lost = {device: self._devices[device].lost.pop(session) for device in devices
                 if session in self._devices[device].lost}
        for device in devices:
            self._devices[device].sessions.add(session)
        relied = [why for device, rely in zip(devices, relies) if rely and (why := lost.get(device)) is not None]
        if relied:
            raise DeviceLost(f"{'; '.join(dict.fromkeys(relied))}; start again with a fresh prefill (index_pos 0)")

    def sent(self, request_id: int, session: int, devices: Sequence[int], now: float) -> None:
        """A chunk of the request went to the first device of its route (the first chunk registers it)."""
        request = self._requests.get(request_id)
        if request is None:
            self._requests[request_id] = _Request(session, tuple(devices), now + self._request_timeout)
        else:
            request.sent += 1

    def sealed(self, request_id: int) -> list[Action]:
        """No more chunks of the request will be sent (all were, or the sender gave up)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        request.sealed = True
        return self._settle(request_id, request)

    def answered(self, device: int, request_id: int, now: float, error: RequestError | None = None,
                 chunk: int = 0) -> list[Action]:
        """Chunk `chunk`'s answer came from `device` (its Activation or Done, or a Failure with `error`)."""
        self._devices[device].heard = now
        request = self._requests.get(request_id)
        if request is None:  # already failed (a death, the stop) or a dead process's late reply
            return []
        request.answered += 1
        if error is not None and request.error is None:
            request.error = error
            # Only a failure of the first chunk on the route's first device comes before anything ran.
            request.partial = (device, chunk) != (request.devices[0], 0)
        request.deadline, request.pinged_at = now + self._request_timeout, None
        return self._settle(request_id, request)

    def progressed(self, device: int, request_id: int, now: float) -> None:
        """The device is computing `request_id`: it is alive, and that request is not stuck."""
        self._devices[device].heard = now
        request = self._requests.get(request_id)
        if request is not None:
            request.deadline, request.pinged_at = now + self._request_timeout, None

    def cleared(self, device: int, session: int) -> None:
        """Goodbye: the session starts afresh, so state lost earlier no longer matters."""
        self._devices[device].lost.pop(session, None)

    def ended(self, device: int, session: int) -> None:
        d = self._devices[device]
        d.sessions.discard(session)
        d.lost.pop(session, None)

    # -- time

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for index, d in enumerate(self._devices):
            if d.loading and now >= d.heard + self._load_silence and d.killing is None:
                d.killing = f"loaded no layer within {self._load_silence:g} s"
                actions.append(Kill(index, d.killing))
            elif d.state is DeviceState.RESTARTING and d.respawn_at is not None and now >= d.respawn_at:
                actions.append(self._spawn(index, now))
        hung: set[int] = set()
        for request in self._requests.values():
            if now < request.deadline:
                continue
            ready = [device for device in request.devices if self._devices[device].state is DeviceState.READY]
            if request.pinged_at is None:
                request.pinged_at, request.deadline = now, now + self._request_timeout
                actions += [Ping(device) for device in ready]
                continue
            silent = [device for device in ready if self._devices[device].heard < request.pinged_at]
            hung.update(silent)
            request.deadline = now + self._request_timeout  # a kill's exit fails it before then
            if not silent:  # all alive: it waits behind other work; look again later
                request.pinged_at = None
        for index in sorted(hung):
            d = self._devices[index]
            if d.killing is None:
                d.killing = f"did not answer within {self._request_timeout:g} s"
                actions.append(Kill(index, d.killing))
        return actions

    # -- internals

    def _spawn(self, index: int, now: float) -> Spawn:
        d = self._devices[index]
        d.generation += 1
        d.loading, d.heard, d.respawn_at, d.start_error, d.killing = True, now, None, None, None
        return Spawn(index, d.generation)

    def _settle(self, request_id: int, request: _Request) -> list[Action]:
        if request.sealed and request.answered >= request.sent:
            del self._requests[request_id]
            forget = self._half_applied(request) if request.error is not None and request.partial else []
            return [*forget, Complete(request_id, request.error)]
        return []

    def _fail_requests(self, device: int, error: DeviceLost) -> list[Action]:
        failed = {request_id: request for request_id, request in self._requests.items() if device in request.devices}
        actions: list[Action] = []
        for request_id, request in failed.items():
            del self._requests[request_id]
            actions += [*self._half_applied(request, dead=device), Complete(request_id, error)]
        return actions

    def _half_applied(self, request: _Request, dead: int | None = None) -> list[Action]:
        """The request failed after part of it ran: on each other device of its route whose state
        cannot be rewound, mark the session lost and forget its state there, so that it never
        continues from a half-applied request (attention layers keep their rollback)."""
        actions: list[Action] = []
        for device in dict.fromkeys(request.devices):
            if device == dead or not self._recurrent[device]:
                continue
            d = self._devices[device]
            d.lost[request.session] = (f"a request of this session failed part-way, and device {d.label}'s "
                                       "linear-attention state cannot be rewound: its state there was dropped")
            actions.append(Forget(device, request.session))
        return actions


def _backoff(attempt: int) -> float:
    return min(BACKOFF_FIRST_S * 2**attempt, BACKOFF_MAX_S)
