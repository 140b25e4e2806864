"""The one exception tree of cakemp.

Foreign exceptions (struct, UnicodeDecodeError, zmq, torch) are mapped onto these at the
boundary where they occur, so callers only ever catch what is declared here.
"""


class CakempError(Exception):
    """Base of every error cakemp raises on purpose."""


class ProtocolError(CakempError):
    """The peer sent bytes that are not valid Cake protocol; only its connection is closed."""


class AuthError(CakempError):
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


class UnknownLayer(RequestError):
    """The request names a layer this worker does not serve."""


class BadTensor(RequestError):
    """The activation's dtype, shape or byte count does not fit the request."""


class ContextLimitExceeded(RequestError):
    """A position would pass the maximum context length."""


class CacheBudgetExceeded(RequestError):
    """The KV caches of this device process would exceed their byte budget."""


class DeviceLost(RequestError):
    """The device process serving the request died or stopped answering."""


class RemoteWorkerError(CakempError):
    """The worker answered a request with WorkerError; raised by the master client."""


class MalformedTensor(ProtocolError):
    """A well-formed frame whose tensor has an unknown dtype tag or a byte count that does not
    match its shape; Cake's worker answers this with WorkerError and keeps the connection."""


class WorkerUnreachable(CakempError):
    """The master could not connect to a worker: nothing listens there, or the connect timed out."""


class PositionGap(RequestError):
    """A request's index_pos skips past the positions the session's KV cache holds for that layer."""


class RecurrentRewind(PositionGap):
    """A request's index_pos would rewind a linear-attention layer (Qwen3.5's Gated DeltaNet),
    whose state is a recurrence that keeps no history: only continuing or restarting at 0 works."""


class NodeFailed(CakempError):
    """A node started as a subprocess (demo, tests) exited early, never became ready, or did not stop cleanly."""


class HiddenStateMismatch(CakempError):
    """The pool's hidden states differ from a single-process run of the same layers (the demo's check)."""
