"""The one exception tree of cakemp.

Foreign exceptions (struct, UnicodeDecodeError, zmq, torch) are mapped onto these at the
boundary where they occur, so callers only ever catch what is declared here.

Every error also says who is at fault, as h11 separates remote from local protocol errors:
a `PeerFault` is caused by what the other side sent (it must change, not cakemp), a
`NodeFault` by this node (a lost device, a full cache, a bug). `RequestError` is orthogonal:
it is what a master is answered with WorkerError for, whoever is at fault.
"""


class CakempError(Exception):
    """Base of every error cakemp raises on purpose."""


class PeerFault(CakempError):
    """Caused by what the peer sent; logged as the peer's mistake, never as cakemp's."""


class NodeFault(CakempError):
    """Caused by this node, not by the request: a device that died, a full cache, a bug."""


class ProtocolError(PeerFault):
    """The peer sent bytes that are not valid Cake protocol; only its connection is closed."""


class AuthError(PeerFault):
    """The cluster-key handshake failed or timed out; the connection is closed unanswered."""


class ConfigError(CakempError):
    """The configuration cannot work (bad flag, topology, checkpoint); `cakemp run` exits 78."""


class CheckpointError(ConfigError):
    """The checkpoint is unusable: unsupported architecture, missing tensor, bad config."""


class SetupError(CakempError):
    """A zero-config setup or model push that cannot be accepted; answered WorkerError, then the
    connection is closed and the node waits for the next setup."""


class RequestError(CakempError):
    """A well-formed request that cannot be served; the master gets WorkerError(str(self))."""


class BadRequest(RequestError, PeerFault):
    """A well-formed request that asks for what this worker cannot do."""


class UnknownLayer(BadRequest):
    """The request names a layer this worker does not serve."""


class BadTensor(BadRequest):
    """The activation's dtype, shape or byte count does not fit the request."""


class BadOps(BadRequest):
    """The request's layer run is too long, or names a layer or KV slot twice or out of range."""


class ContextLimitExceeded(BadRequest):
    """A position would pass the maximum context length."""


class SessionExpired(BadRequest):
    """The session sat idle past --session-idle-timeout, its KV state was freed, and it asked to continue."""


class CacheBudgetExceeded(RequestError, NodeFault):
    """The KV caches of this device process would exceed their byte budget."""


class DeviceLost(RequestError, NodeFault):
    """The device process serving the request died or stopped answering."""


class InternalError(RequestError, NodeFault):
    """A device failed a request with an error cakemp did not expect (a bug, a device fault): the
    master is told only that, the node's log holds the detail."""


class RemoteWorkerError(CakempError):
    """The worker answered a request with WorkerError; raised by the master client."""


class MalformedTensor(ProtocolError):
    """A well-formed frame whose tensor has an unknown dtype tag or a byte count that does not
    match its shape; Cake's worker answers this with WorkerError and keeps the connection."""


class WorkerUnreachable(CakempError):
    """The master could not connect to a worker: nothing listens there, or the connect timed out."""


class PositionGap(BadRequest):
    """A request's index_pos skips past the positions the session's KV cache holds for that layer."""


class RecurrentRewind(PositionGap):
    """A request's index_pos would rewind a linear-attention layer (Qwen3.5's Gated DeltaNet),
    whose state is a recurrence that keeps no history: only continuing or restarting at 0 works."""


class NodeFailed(CakempError):
    """A node started as a subprocess (demo, tests) exited early, never became ready, or did not stop cleanly."""


class HiddenStateMismatch(CakempError):
    """The pool's hidden states differ from a single-process run of the same layers (the demo's check)."""
