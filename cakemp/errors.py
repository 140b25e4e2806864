"""The one exception tree of cakemp, and the codes its errors travel by between processes.

Foreign exceptions (struct, UnicodeDecodeError, zmq, torch) are mapped onto these at the
boundary where they occur, so callers only ever catch what is declared here. Every class
sits in one of three branches, which say who is at fault, as h11 separates remote from local
protocol errors:

    CakempError
    ├── PeerFault               the other end: what it sent or answered, or that it is not there
    │   ├── ProtocolError       bytes that are not Cake protocol: the connection is closed
    │   ├── AuthError           the cluster-key handshake failed: closed unanswered
    │   ├── BadRequest [R]      a sound request this worker cannot serve
    │   │   ├── UnknownLayer
    │   │   ├── BadTensor
    │   │   ├── BadOps
    │   │   ├── ContextLimitExceeded
    │   │   ├── SessionExpired
    │   │   └── PositionGap
    │   │       └── RecurrentRewind
    │   ├── RemoteWorkerError   (master side) the worker answered WorkerError
    │   └── WorkerUnreachable   (master side) nothing accepts a connection at the worker's address
    ├── NodeFault               this node: a device, a budget, a bug
    │   ├── OutOfMemory [R]
    │   ├── CacheBudgetExceeded [R]
    │   ├── DeviceLost [R]
    │   ├── InternalError [R]
    │   ├── EncodeError         cakemp built a Cake message that the protocol cannot carry
    │   └── BadIpcMessage       a message between this node's own processes did not decode
    └── StartupError            the node cannot start as configured or as assigned
        ├── ConfigError         a bad flag, topology or checkpoint: `cakemp run` exits 78
        │   └── CheckpointError
        └── SetupError          a zero-config setup or model push this node cannot accept

[R] marks a `RequestError` as well: the master is answered WorkerError(str(error)) and its
connection stays usable. RequestError is that mark, not a branch: it derives from Exception
alone, is mixed into classes of both fault branches, and is never raised itself.
(cakemp.demo adds NodeFailed and HiddenStateMismatch, under NodeFault.)

An error that crosses from a device process to the front travels as its class's `code`, an
`ErrorCode`: `error_code` reads it, `error_from` rebuilds the class that declares it.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Why a device could not serve a request (or start), as it travels over ipc; each code is
    declared by exactly one class below (its `code`)."""

    INTERNAL = 1
    OUT_OF_MEMORY = 2
    UNKNOWN_LAYER = 3
    BAD_TENSOR = 4
    CONTEXT_LIMIT = 5
    CACHE_BUDGET = 6
    POSITION_GAP = 7
    DEVICE_LOST = 8
    CONFIG = 9
    CHECKPOINT = 10
    BAD_OPS = 11
    SESSION_EXPIRED = 12
    BAD_REQUEST = 13


_DECLARING: dict[ErrorCode, type[CakempError]] = {}  # each code -> the one class that declares it


class CakempError(Exception):
    """Base of every error cakemp raises on purpose."""

    code: ErrorCode  # declared by the classes that can cross from a device to the front

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        code = vars(cls).get("code")
        if code is None:
            return
        if code in _DECLARING:
            raise TypeError(f"{cls.__name__} declares {code!r}, which {_DECLARING[code].__name__} declares already")
        _DECLARING[code] = cls


class RequestError(Exception):
    """The mark of an error a master is answered with WorkerError(str(self)) for, its connection
    kept; mixed into classes of both fault branches, never raised itself."""


# --------------------------------------------------------------------------- the peer's fault


class PeerFault(CakempError):
    """Caused at the other end of a connection; logged as the peer's mistake, never as cakemp's."""


class ProtocolError(PeerFault):
    """The peer sent bytes that are not valid Cake protocol; only its connection is closed."""


class AuthError(PeerFault):
    """The cluster-key handshake failed or timed out; the connection is closed unanswered."""


class BadRequest(RequestError, PeerFault):
    """A well-formed request that asks for what this worker cannot do."""

    code = ErrorCode.BAD_REQUEST


class UnknownLayer(BadRequest):
    """The request names a layer this worker does not serve."""

    code = ErrorCode.UNKNOWN_LAYER


class BadTensor(BadRequest):
    """The activation's dtype, shape or byte count does not fit the request. Raised by the wire
    decoder too, for a sound frame whose tensor has an unknown dtype tag or a byte count that does
    not match its shape: Cake's worker answers that with WorkerError and keeps the connection."""

    code = ErrorCode.BAD_TENSOR


class BadOps(BadRequest):
    """The request's layer run is too long, or names a layer or KV slot twice or out of range."""

    code = ErrorCode.BAD_OPS


class ContextLimitExceeded(BadRequest):
    """A position would pass the maximum context length."""

    code = ErrorCode.CONTEXT_LIMIT


class SessionExpired(BadRequest):
    """The session sat idle past --session-idle-timeout, its KV state was freed, and it asked to continue."""

    code = ErrorCode.SESSION_EXPIRED


class PositionGap(BadRequest):
    """A request's index_pos skips past the positions the session's KV cache holds for that layer."""

    code = ErrorCode.POSITION_GAP


class RecurrentRewind(PositionGap):
    """A request's index_pos would rewind a linear-attention layer (Qwen3.5's Gated DeltaNet),
    whose state is a recurrence that keeps no history: only continuing or restarting at 0 works."""


class RemoteWorkerError(PeerFault):
    """The worker answered a request with WorkerError; raised by the master client."""


class WorkerUnreachable(PeerFault):
    """The master could not connect to a worker: nothing listens there, or the connect timed out."""


# --------------------------------------------------------------------------- this node's fault


class NodeFault(CakempError):
    """Caused by this node, not by the request: a device that died, a full cache, a bug."""


class OutOfMemory(RequestError, NodeFault):
    """The device ran out of memory for this request; the request fails alone, the device serves on."""

    code = ErrorCode.OUT_OF_MEMORY


class CacheBudgetExceeded(RequestError, NodeFault):
    """This device process's byte budget (--kv-budget-mib) would be exceeded: by its KV caches, or
    by an image component call's activations."""

    code = ErrorCode.CACHE_BUDGET


class DeviceLost(RequestError, NodeFault):
    """The device process serving the request died or stopped answering."""

    code = ErrorCode.DEVICE_LOST


class InternalError(RequestError, NodeFault):
    """A device failed a request with an error cakemp did not expect (a bug, a device fault): the
    master is told only that, the node's log holds the detail."""

    code = ErrorCode.INTERNAL


class EncodeError(NodeFault):
    """A Cake message built here cannot be encoded: a field out of its range, a message the
    protocol revision lacks, a frame past the size limit. cakemp's own mistake, not the peer's."""


class BadIpcMessage(NodeFault):
    """A message between this node's own processes did not decode: only cakemp writes there, so it
    is a bug, logged here and never blamed on a master."""


# --------------------------------------------------------------------------- startup


class StartupError(CakempError):
    """The node cannot start as configured (the operator must act) or as a master assigns it."""


class ConfigError(StartupError):
    """The configuration cannot work (bad flag, topology, checkpoint); `cakemp run` exits 78."""

    code = ErrorCode.CONFIG


class CheckpointError(ConfigError):
    """The checkpoint is unusable: unsupported architecture, missing tensor, bad config."""

    code = ErrorCode.CHECKPOINT


class SetupError(StartupError):
    """A zero-config setup or model push that cannot be accepted; answered WorkerError, then the
    connection is closed and the node waits for the next setup."""


# --------------------------------------------------------------------------- codes


def error_code(error: BaseException) -> ErrorCode:
    """The code of the most specific class of `error` that declares one (attribute lookup walks
    its MRO); INTERNAL for an error that declares none and for anything not raised by cakemp."""
    if isinstance(error, CakempError):
        return getattr(type(error), "code", ErrorCode.INTERNAL)
    return ErrorCode.INTERNAL


def error_from(code: ErrorCode, message: str) -> CakempError:
    """An instance of the class that declares `code`, with `message` (an unknown code: InternalError)."""
    return _DECLARING.get(code, InternalError)(message)
