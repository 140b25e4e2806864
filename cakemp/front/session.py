"""The rules of one master session, with no I/O: each message in, the actions it calls for out.

A session is one master connection (connection.py reads its frames and carries the actions
out). Its first message is Hello, answered with WorkerInfo; or a LayerAssignment from a master
that restarted and runs setup again: a node that holds those layers answers Ack(needs_data=
false) and WorkerReady, as Cake's worker does, while a zero-config node set up with another
model or layer set refuses it (WorkerError) rather than answer WorkerReady and fail every
request that follows; either way the connection then ends. Anything else first ends it too.

After Hello: a Batch or a SingleOp is admitted (admission.py; component_admission.py on an
image node, which refuses every Batch) and run, or refused with WorkerError while the session
goes on; Goodbye clears the session's state on every device it
used and is answered with WorkerInfo; any other message ends the session.

A session idle past `idle_timeout` between frames has its state freed (the same clear as
Goodbye); its next request that relies on that state (past position 0) is refused once with
SessionExpired, and a fresh prefill just goes ahead.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from cakemp.errors import InternalError, RequestError, SessionExpired
from cakemp.front.admission import Admission
from cakemp.wire import (
    Batch,
    Goodbye,
    Hello,
    LayerAssignment,
    LayerAssignmentAck,
    LayerOps,
    Message,
    RawTensor,
    SingleOp,
    WorkerError,
    WorkerReady,
)


class SessionState(enum.Enum):
    AWAITING_HELLO = "awaiting hello"
    OPEN = "open"
    CLOSED = "closed"


# Actions, for the connection to carry out in order.
@dataclass(frozen=True)
class Greet:
    """Answer WorkerInfo, with the time the frame just read took as its latency."""


@dataclass(frozen=True)
class Reply:
    message: Message


@dataclass(frozen=True)
class Forward:
    """Pass the admitted request down its route, and answer its result (or why it failed)."""

    x: RawTensor
    ops: LayerOps


@dataclass(frozen=True)
class Refuse:
    """Answer the request WorkerError: it may not run."""

    error: RequestError


@dataclass(frozen=True)
class Reset:
    """Drop the session's state on `devices`; the session goes on (unlike the connection's end)."""

    devices: tuple[int, ...]


@dataclass(frozen=True)
class Note:
    """Tell the operator: log `event` at `level` with `fields`."""

    level: str
    event: str
    fields: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Close:
    """End the connection."""


Action = Greet | Reply | Forward | Refuse | Reset | Note | Close


class Session:
    """One master session's rules: which messages it may send when, and what each calls for."""

    def __init__(self, admission: Admission, *, served: LayerAssignment | None = None,
                 idle_timeout: float | None = None):
        """`served`: a zero-config node's setup, which a re-setup must match; `idle_timeout`: seconds
        idle after which the session's state is freed (None: never)."""
        self.state = SessionState.AWAITING_HELLO
        self._admission = admission
        self._served = served
        self._idle_timeout = idle_timeout
        self._devices: set[int] = set()  # devices that may hold state of this session
        self._expired = False  # its state was freed for idleness and it has not been told yet

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices that may hold the session's state, in order."""
        return tuple(sorted(self._devices))

    def idle_after(self) -> float | None:
        """How long the session may now sit idle before its state is freed; None: indefinitely
        (no timeout, no state anywhere, or freed already)."""
        if self._idle_timeout is None or self._expired or not self._devices:
            return None
        return self._idle_timeout

    def received(self, message: Message) -> list[Action]:
        """The master sent `message`."""
        if self.state is SessionState.AWAITING_HELLO:
            return self._first(message)
        if self.state is SessionState.CLOSED:
            return []
        if isinstance(message, Goodbye):
            self._expired = False  # a fresh start: nothing to be told
            return [Reset(self.devices), Greet()]
        if isinstance(message, Batch):
            try:
                self._admission.check_batch()  # an image node takes none
            except RequestError as e:
                return [Refuse(e)]
            return [self._request(message.x, message.batch)]
        if isinstance(message, SingleOp):
            return [self._request(message.x, LayerOps((message.layer_name,), (message.index_pos,), (message.block_idx,)))]
        return self._close(Note("warning", "unexpected message, closing",
                                {"message": type(message).__name__, "fault": "peer"}))

    def joined(self, device: int) -> bool:
        """A request of the session goes to `device`; True the first time (its state may be there from now on)."""
        if device in self._devices:
            return False
        self._devices.add(device)
        return True

    def idle(self) -> list[Action]:
        """The session sat idle for `idle_after()` seconds: free its state on every device."""
        self._expired = True
        return [Reset(self.devices), Note("info", "session idle: freed its KV state",
                                          {"idle_timeout": self._idle_timeout})]

    def _first(self, message: Message) -> list[Action]:
        if isinstance(message, Hello):
            self.state = SessionState.OPEN
            return [Greet()]
        if not isinstance(message, LayerAssignment):
            return self._close(Note("warning", "unexpected first message (expected Hello)",
                                    {"message": type(message).__name__, "fault": "peer"}))
        if self._served is not None and message != self._served:
            served = self._served
            return self._close(
                Note("warning", "master re-setup with another assignment: refused",
                     {"layers": len(message.layers), "model_hash": message.model_hash}),
                Reply(WorkerError(
                    f"this node serves {_span(served.layers)} of model {served.model_hash or '(no hash)'}; "
                    f"restart it to take {_span(message.layers)} of model {message.model_hash or '(no hash)'}")))
        return self._close(Note("info", "master re-setup: accepting layer assignment", {"layers": len(message.layers)}),
                           Reply(LayerAssignmentAck(needs_data=False)), Reply(WorkerReady()))

    def _request(self, x: RawTensor, ops: LayerOps) -> Forward | Refuse:
        try:
            self._admission.check(x, ops)
        except RequestError as e:
            return Refuse(e)
        except Exception as e:  # a bug on this request's path fails this request alone
            return Refuse(InternalError(f"unexpected error in the front: {type(e).__name__}: {e}"))
        if self._expired:  # told once, and only if it relies on the state freed
            self._expired = False
            if any(ops.positions):
                return Refuse(SessionExpired(
                    f"this session was idle for more than {self._idle_timeout:g} s and its KV state "
                    "was freed; start again with a fresh prefill (index_pos 0)"))
        return Forward(x, ops)

    def _close(self, *actions: Action) -> list[Action]:
        self.state = SessionState.CLOSED
        return [*actions, Close()]


def _span(layers: Sequence[str]) -> str:
    """How a message names a layer list: "model.layers.0..model.layers.15 (16 layers)"."""
    if not layers:
        return "no layers"
    return f"{layers[0]}..{layers[-1]} ({len(layers)} layers)" if len(layers) > 1 else layers[0]
