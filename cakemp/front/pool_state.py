"""The front's bookkeeping of its devices, as a state machine with no I/O and an injected clock.

Events go in (a process was spawned, loaded a layer, became ready, exited; a request was sent,
a chunk of it answered, the device reported progress; time passed), actions come out (spawn,
kill, probe, complete a request, and what to tell the operator), and `next_deadline` says
when `tick` must be called next. `DevicePool` (pool.py) is the thin asyncio layer that owns
the processes and sockets and carries the actions out; these tests need neither.

A device is in one phase at a time, a small frozen record carrying what that phase needs;
`state()` is its coarse DeviceState (STARTING, READY, RESTARTING, FAILED, STOPPED). What each
event does in each phase:

    phase        Ready                 StartFailure            exit                          tick
    Starting     Serving (Started      Failed (StartFailed)    Failed (StartFailed)          Killing, if silent
                 once all are)                                                               for load_silence
    Serving      -                     -                       Backoff (Restarting)          Killing, if hung
    Backoff      -                     -                       -                             Reloading (Spawn),
                                                                                             at respawn_at
    Reloading    Serving (Restarted)   Killing (its error)     Backoff (RestartFailed), or   Killing, if silent
                                                               Failed (GiveUp) after the
                                                               restart_attempts-th in a row
    Killing      -                     as the phase it was     as the phase it was, with     -
                                       killed in               the kill's reason
    Failed       -                     -                       -                             -
    Stopped      -                     -                       -                             -

Each spawn is a new generation of the device; a route names the generation it expects, so a
hand-off meant for a dead process is dropped by its successor. `stop` makes every device Stopped.

A request is owed by every device on its route from the moment its chunks are queued for the
first device (a request refused before, its device down, registers nothing) until each chunk has
its answer, or one of those devices dies. Its silence counts from the last word about it (the
send, an answered chunk, a progress report). When it has been silent for `request_timeout`,
the devices on its route are probed (pinged): a device that answers, or reports progress on any
request, is alive (it may be busy on a long request queued ahead); a device that stays silent
for another `request_timeout` is hung and killed, and its death fails the request.

A session whose state on a device is gone is told once, by its next request that relies on it
(past position 0 there): after the device's process died, or after one of its requests failed
once part of it had run (a later chunk or piece of a prompt, a later device of the route). A
device rolls back only the step that failed: what the request's earlier chunks, pieces or
stages wrote stays (a linear-attention state cannot be rewound at all), so the session's state
on every device of its route is then dropped (Forget), never continued from half-applied.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from cakemp.errors import CakempError, DeviceLost, RequestError

# Delay before restart attempt n (0-based): doubling from the first, capped.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class DeviceState(enum.Enum):
    """What a device is, as the pool's users see it; its `Phase` says the rest."""

    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


# A device's phase: what it is doing, and what that phase carries.
@dataclass(frozen=True)
class Starting:
    """Its first process loads its layers."""

    state: ClassVar[DeviceState] = DeviceState.STARTING


@dataclass(frozen=True)
class Serving:
    state: ClassVar[DeviceState] = DeviceState.READY


@dataclass(frozen=True)
class Backoff:
    """Down since it `failure`, with `attempts` failed restarts in a row since; the next process starts at `respawn_at`."""

    failure: str
    attempts: int
    respawn_at: float
    state: ClassVar[DeviceState] = DeviceState.RESTARTING


@dataclass(frozen=True)
class Reloading:
    """A new process loads its layers, after the device `failure` and `attempts` failed restarts in a row."""

    failure: str
    attempts: int
    state: ClassVar[DeviceState] = DeviceState.RESTARTING


@dataclass(frozen=True)
class Killing:
    """The front kills the current process, which was in phase `of`; its exit is reported as `reason`."""

    reason: str
    of: Starting | Serving | Reloading

    @property
    def state(self) -> DeviceState:
        return self.of.state


@dataclass(frozen=True)
class Failed:
    """Its first start failed, or it failed `restart_attempts` restarts in a row: given up."""

    state: ClassVar[DeviceState] = DeviceState.FAILED


@dataclass(frozen=True)
class Stopped:
    state: ClassVar[DeviceState] = DeviceState.STOPPED


Phase = Starting | Serving | Backoff | Reloading | Killing | Failed | Stopped


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
class Probe:
    """Ask `device` whether it is alive (an ipc Ping): a request on its route went silent."""

    device: int


@dataclass(frozen=True)
class Forget:
    """Drop the session's state on `device`: a request of it failed after part of it had run on its route,
    and what ran is not rolled back (module docstring)."""

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


Action = Spawn | Kill | Probe | Forget | Complete | Started | StartFailed | Restarting | RestartFailed | Restarted | GiveUp


class Loss(enum.Enum):
    """Why a session's state on a device is gone, for the next request of it that relies on that state."""

    RESTART = "restart"  # it died with an earlier process of the device
    HALF_APPLIED = "half-applied"  # a request failed part-way, and what ran of it was not rolled back (Forget)


@dataclass
class _Device:
    label: str
    phase: Phase = Starting()
    generation: int = 0
    heard: float = 0.0  # when its current process last said anything
    sessions: set[int] = field(default_factory=set)  # sessions that sent requests to the current process
    lost: dict[int, Loss] = field(default_factory=dict)  # session -> why its state here is gone


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
    """The devices' phases and the requests they owe; every method is an event, and returns the actions it calls for."""

    def __init__(self, labels: Sequence[str], *, request_timeout: float, load_silence: float, restart_attempts: int,
                 stateful: bool = True):
        """`stateful`: whether requests leave state on the devices (a text model's KV caches; image components
        keep none)."""
        self._devices = [_Device(label) for label in labels]
        self._stateful = stateful
        # The requests owed, in the order of their deadlines: each is set to now + the timeout, then moved
        # last (`_renew`), so the first's is the next, and `tick` stops at the first not yet due. That
        # holds because the events' `now` never goes back (the pool reads its loop's monotonic clock as it
        # handles each event, and hands one event's `now` to no later one).
        self._requests: dict[int, _Request] = {}
        # Per device, the requests owed whose route passes it: `waiting` is asked once per request
        # answered, so it is counted as requests come and go rather than over all of them each time.
        self._owed_by = [0] * len(labels)
        self._request_timeout = request_timeout
        self._load_silence = load_silence
        self._restart_attempts = restart_attempts

    # -- queries

    def phase(self, device: int) -> Phase:
        return self._devices[device].phase

    def state(self, device: int) -> DeviceState:
        return self._devices[device].phase.state

    def generation(self, device: int) -> int:
        return self._devices[device].generation

    def owed(self, request_id: int) -> bool:
        return request_id in self._requests

    def waiting(self, device: int) -> int:
        """Requests owed by `device` (on their way to it, running on it, or passed on by it)."""
        return self._owed_by[device]

    def down(self, device: int) -> DeviceLost | None:
        """Why requests to `device` cannot be served now, as the error to answer them with; None while it serves."""
        d = self._devices[device]
        return None if d.phase.state is DeviceState.READY else _down(d.label, d.phase)

    def unusable(self, device: int, generation: int) -> DeviceLost | None:
        """Why a hop for process `generation` of `device` cannot go now (it is down, or that process is gone); None if it can."""
        d = self._devices[device]
        return self.down(device) or (_restarted(d.label) if d.generation != generation else None)

    def next_deadline(self) -> float | None:
        """When `tick` must next be called (None: nothing to watch)."""
        times = [next(iter(self._requests.values())).deadline] if self._requests else []
        for d in self._devices:
            match d.phase:
                case Starting() | Reloading():
                    times.append(d.heard + self._load_silence)
                case Backoff(respawn_at=respawn_at):
                    times.append(respawn_at)
        return min(times, default=None)

    # -- device lifecycle

    def start(self, now: float) -> list[Action]:
        return [self._spawn(index, now) for index in range(len(self._devices))]

    def heard(self, device: int, now: float) -> None:
        """The device's current process said something (a layer loaded, a Pong, any reply)."""
        self._devices[device].heard = now

    def ready(self, device: int, now: float) -> list[Action]:
        """The loading process holds its layers. A Ready from a process already gone, or being
        killed, changes nothing."""
        d = self._devices[device]
        d.heard = now
        match d.phase:
            case Starting():
                d.phase = Serving()
                return [Started()] if all(other.phase.state is DeviceState.READY for other in self._devices) else []
            case Reloading():
                d.phase = Serving()
                return [Restarted(device)]
        return []

    def start_failed(self, device: int, now: float, error: CakempError) -> list[Action]:
        """The loading process reported that it cannot load (it exits next)."""
        d = self._devices[device]
        d.heard = now
        match d.phase:
            case Starting() | Killing(of=Starting()):
                d.phase = Failed()
                return [StartFailed(device, error)]
            case Reloading() | Killing(of=Reloading()):
                # Make sure it is gone; its exit counts the attempt, with this error.
                return self._kill(device, str(error))
        return []

    def exited(self, device: int, now: float, exitcode: int | None) -> list[Action]:
        """The device's current process is gone: fail what it owed, then, by what the process was
        doing, fail the node's start, restart the device, count the attempt, or give up."""
        d = self._devices[device]
        killed = isinstance(d.phase, Killing)
        reason = d.phase.reason if killed else f"died (exit code {exitcode})"
        was = d.phase.of if killed else d.phase
        actions = self._fail_requests(device, _gone(d.label, reason))
        if isinstance(was, Failed | Stopped):
            return actions
        d.lost.update(dict.fromkeys(d.sessions, Loss.RESTART))
        d.sessions = set()
        match was:
            case Starting():
                d.phase = Failed()
                return actions + [StartFailed(device, CakempError(f"device {d.label} {reason}"))]
            case Serving():
                d.phase = Backoff(reason, 0, now + _backoff(0))
                return actions + [Restarting(device, reason)]
            case Reloading(failure=failure, attempts=attempts):
                attempts += 1
                actions.append(RestartFailed(device, attempts, reason))
                if attempts >= self._restart_attempts:
                    d.phase = Failed()
                    return actions + [GiveUp(f"device {d.label} failed to start {attempts} times in a row "
                                             f"(last: {reason})")]
                d.phase = Backoff(failure, attempts, now + _backoff(attempts))
        return actions  # Backoff: no process of it ran

    def stop(self) -> list[Action]:
        """The node stops: no more restarts; every request fails."""
        for d in self._devices:
            d.phase = Stopped()
        actions: list[Action] = []
        for request_id, request in list(self._requests.items()):
            labels = [self._devices[device].label for device in request.devices]
            actions.append(Complete(request_id, _stopping(labels)))
        self._requests.clear()
        self._owed_by = [0] * len(self._devices)
        return actions

    # -- requests

    def admit(self, session: int, devices: Sequence[int], relies: Sequence[bool]) -> None:
        """Take note of the session's request on `devices`, or raise DeviceLost: while one is down,
        and once for a session whose state on one of them is gone (it died with an earlier
        process, or a failed request left it half-applied) when it still relies on it there
        (`relies[i]`: a request past position 0 on devices[i])."""
        for device in devices:
            if (error := self.down(device)) is not None:
                raise error
        losses: dict[int, Loss] = {}
        for device in dict.fromkeys(devices):
            d = self._devices[device]
            d.sessions.add(session)
            # Told once: the session's next request through the device forgets the loss.
            if (loss := d.lost.pop(session, None)) is not None:
                losses[device] = loss
        relied = [(self._devices[device].label, losses[device])
                  for device, rely in zip(devices, relies) if rely and device in losses]
        if relied:
            raise _state_lost(relied)

    def sent(self, request_id: int, session: int, devices: Sequence[int], now: float) -> None:
        """A chunk of the request went to the first device of its route (the first chunk registers it)."""
        request = self._requests.get(request_id)
        if request is None:
            self._requests[request_id] = request = _Request(session, tuple(devices), now + self._request_timeout)
            for device in set(request.devices):
                self._owed_by[device] += 1
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
                 chunk: int = 0, ran: bool = False) -> list[Action]:
        """Chunk `chunk`'s answer came from `device` (its Activation or Done, or a Failure with `error`;
        `ran`: part of the chunk had run on `device` before it failed, a prompt the device cut)."""
        self._devices[device].heard = now
        request = self._requests.get(request_id)
        if request is None:  # already failed (a death, the stop) or a dead process's late reply
            return []
        request.answered += 1
        if error is not None and request.error is None:
            request.error = error
            # Only a failure of the first chunk on the route's first device, before any of it ran
            # there, comes before anything ran.
            request.partial = ran or (device, chunk) != (request.devices[0], 0)
        self._renew(request_id, request, now)
        return self._settle(request_id, request)

    def progressed(self, device: int, request_id: int, now: float) -> None:
        """The device is computing `request_id`: it is alive, and that request is not stuck."""
        self._devices[device].heard = now
        request = self._requests.get(request_id)
        if request is not None:
            self._renew(request_id, request, now)

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
            match d.phase:
                case Starting() | Reloading() if now >= d.heard + self._load_silence:
                    actions += self._kill(index, f"loaded no layer within {self._load_silence:g} s")
                case Backoff(respawn_at=respawn_at) if now >= respawn_at:
                    actions.append(self._spawn(index, now))
        hung: set[int] = set()
        due = list(itertools.takewhile(lambda owed: now >= owed[1].deadline, self._requests.items()))
        for request_id, request in due:
            ready = [device for device in request.devices if self.state(device) is DeviceState.READY]
            pinged_at = request.pinged_at
            self._renew(request_id, request, now)  # after a Probe; after a kill, whose exit fails it before then
            if pinged_at is None:
                request.pinged_at = now
                actions += [Probe(device) for device in ready]
                continue
            silent = [device for device in ready if self._devices[device].heard < pinged_at]
            hung.update(silent)
            if silent:  # else all alive: it waits behind other work; look again later
                request.pinged_at = pinged_at
        for index in sorted(hung):
            if self.phase(index) == Serving():  # not already being killed
                actions += self._kill(index, f"did not answer within {self._request_timeout:g} s")
        return actions

    # -- internals

    def _spawn(self, index: int, now: float) -> Spawn:
        d = self._devices[index]
        d.generation += 1
        d.heard = now
        d.phase = Reloading(d.phase.failure, d.phase.attempts) if isinstance(d.phase, Backoff) else Starting()
        return Spawn(index, d.generation)

    def _kill(self, index: int, reason: str) -> list[Action]:
        """Kill the device's current process; its exit will be reported as `reason`."""
        d = self._devices[index]
        d.phase = Killing(reason, d.phase.of if isinstance(d.phase, Killing) else d.phase)
        return [Kill(index, reason)]

    def _settle(self, request_id: int, request: _Request) -> list[Action]:
        if request.sealed and request.answered >= request.sent:
            self._remove(request_id)
            forget = self._half_applied(request) if request.error is not None and request.partial else []
            return [*forget, Complete(request_id, request.error)]
        return []

    def _renew(self, request_id: int, request: _Request, now: float) -> None:
        """The request is heard of: its deadline the timeout from `now`, the latest of all (moved last), no Probe out."""
        request.deadline, request.pinged_at = now + self._request_timeout, None
        del self._requests[request_id]
        self._requests[request_id] = request

    def _remove(self, request_id: int) -> None:
        for device in set(self._requests.pop(request_id).devices):
            self._owed_by[device] -= 1

    def _fail_requests(self, device: int, error: DeviceLost) -> list[Action]:
        failed = {request_id: request for request_id, request in self._requests.items() if device in request.devices}
        actions: list[Action] = []
        for request_id, request in failed.items():
            self._remove(request_id)
            actions += [*self._half_applied(request, dead=device), Complete(request_id, error)]
        return actions

    def _half_applied(self, request: _Request, dead: int | None = None) -> list[Action]:
        """The request failed after part of it ran: on each other device of its route, mark the session lost
        and forget its state there, so that it never continues from a half-applied request."""
        if not self._stateful:
            return []
        actions: list[Action] = []
        for device in dict.fromkeys(request.devices):
            if device == dead:
                continue
            self._devices[device].lost[request.session] = Loss.HALF_APPLIED
            actions.append(Forget(device, request.session))
        return actions


def _backoff(attempt: int) -> float:
    return min(BACKOFF_FIRST_S * 2**attempt, BACKOFF_MAX_S)


# -- what a master is told: every DeviceLost is worded here

def _down(label: str, phase: Phase) -> DeviceLost:
    """A request to a device that does not serve now."""
    match phase:
        case Backoff(failure=failure) | Reloading(failure=failure) | Killing(of=Reloading(failure=failure)):
            why = f"is restarting after it {failure}"
        case Failed():
            why = "could not be restarted"
        case Stopped():
            why = "is stopping"
        case _:
            why = "is starting"
    return DeviceLost(f"device {label} {why}")


def _gone(label: str, reason: str) -> DeviceLost:
    """A request owed by a process that exited (`reason`: "died (exit code -9)", or why it was killed)."""
    return DeviceLost(f"device {label} {reason}")


def _restarted(label: str) -> DeviceLost:
    """A hop meant for a process of the device that has since been replaced."""
    return DeviceLost(f"device {label} restarted")


def _stopping(labels: Sequence[str]) -> DeviceLost:
    """A request in flight when the node stops, naming its route's devices."""
    labels = list(dict.fromkeys(labels))
    which = f"device {labels[0]} is" if len(labels) == 1 else f"devices {', '.join(labels)} are"
    return DeviceLost(f"{which} stopping")


def _state_lost(relied: Sequence[tuple[str, Loss]]) -> DeviceLost:
    """A request relying on state the session lost on these devices (label, why)."""
    whys = {
        Loss.RESTART: "device {} restarted; this session's KV state was lost",
        Loss.HALF_APPLIED: ("a request of this session failed part-way, after part of it had run: its state on "
                            "device {} was dropped rather than kept half-applied"),
    }
    told = dict.fromkeys(whys[loss].format(label) for label, loss in relied)
    return DeviceLost(f"{'; '.join(told)}; start again with a fresh prefill (index_pos 0)")
