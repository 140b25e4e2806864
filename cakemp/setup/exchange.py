"""Zero-config setup on the node's TCP listener, before it serves (spec §7.2, §7.3).

    master → node   auth, LayerAssignment{layers, model_hash}
    node → master   LayerAssignmentAck{needs_data}     (needs_data: the cache does not cover them)
    master → node   ModelDataChunk × N, ModelDataDone   (only when needs_data)
    node → master   WorkerReady                          (once the devices have loaded them)

`Setup.handle` runs each connection that arrives before the node serves; `Setup.next` hands
the front one accepted assignment at a time, its files whole in the cache, and the front
answers it with `ready` once its devices hold the layers, or `refuse` when they cannot load
them. Cake's worker answers WorkerReady before loading; its masters set no deadline on that
answer (only on connecting), so waiting for the load is compatible, and a model that cannot
load is never announced ready.

Unlike Cake, one bad connection never ends or blocks the setup: a connection that fails
auth, stays silent, sends something other than LayerAssignment, or pushes something refused
is answered WorkerError where it can be, closed, and the node keeps waiting. One setup runs at
a time: a newer LayerAssignment replaces one still pushing, and is refused while one's layers
load.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

from cakemp import log
from cakemp.auth import authenticate_master
from cakemp.checkpoint.files import split_layer
from cakemp.errors import AuthError, BadTensor, ProtocolError, SetupError
from cakemp.setup.cache import ModelCache, ModelPush
from cakemp.wire import (
    FrameDecoder, LayerAssignment, LayerAssignmentAck, Message, ModelDataChunk, ModelDataDone, Revision,
    WorkerError, WorkerReady, encode_frame,
)
from cakemp.wire.discovery import cluster_hash

_READ_SIZE = 1 << 20
# After a refusal, how long what the master still sends is read and dropped, so that closing
# with unread bytes does not reset the connection before the master has read why.
_LINGER_S = 5.0
_MAX_LAYERS = 4096


@dataclass(frozen=True)
class SetupConfig:
    """What zero-config mode needs beyond the node's own configuration."""

    cluster_key: str
    cache_root: Path
    max_model_bytes: int | None  # the most a push may announce, all files together (None: what the disk holds)
    discovery_host: str  # the UDP discovery responder's bind address and port (--discovery-bind, --discovery-port)
    discovery_port: int
    handshake_timeout: float = 10.0  # seconds for the cluster-key handshake
    idle_timeout: float = 60.0  # seconds a setup connection may send nothing while one is owed


@dataclass
class Assignment:
    """A setup whose files are whole in the cache, held open until the front answers it."""

    message: LayerAssignment
    cache: ModelCache
    needed_data: bool
    _writer: asyncio.StreamWriter
    _revision: Revision
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # set once ready or refuse has run

    @property
    def layers(self) -> tuple[str, ...]:
        return self.message.layers

    @property
    def model_dir(self) -> Path:
        return self.cache.directory

    async def ready(self) -> None:
        """The devices hold the layers: tell the master (the connection then closes)."""
        await _send_quietly(self._writer, WorkerReady(), self._revision)
        self.answered.set()

    async def refuse(self, reason: str, *, files_at_fault: bool = True) -> None:
        """The layers could not be loaded: the master is told why. Only when the files are at
        fault does the cache stop counting (and the files this setup pushed go with it); a node
        that stops or lacks memory keeps a cache that may have taken hours to push."""
        if files_at_fault:
            self.cache.invalidate(remove_files=self.needed_data)
        await _send_quietly(self._writer, WorkerError(reason), self._revision)
        self.answered.set()


class SetupPhase(enum.Enum):
    WAITING = "waiting"  # for a setup: none holds the node
    PUSHING = "pushing"  # a setup is between its LayerAssignment and the end of its push
    LOADING = "loading"  # a setup's files are whole and its layers load; it is answered once they have
    SERVING = "serving"  # a setup's layers loaded: the node serves them, later connections are not setups


class SetupState:
    """Which setup connection holds the node, with no I/O (connections are any hashable names).

    The newest LayerAssignment takes the setup at once, replacing one still pushing (a master that
    reconnected must not wait for its stale push); the connections it replaced are told so. A
    connection begins its exchange (the Ack, the push) only once no other connection's exchange
    still runs, since that one may hold files of the same cache open. Everything is decided when
    it happens: nothing waits for a replaced connection to clear a flag, so no sequence of
    connections, however they overlap, end or are cancelled, keeps the next from its turn.
    """

    def __init__(self) -> None:
        self.phase = SetupPhase.WAITING
        self._holder: Hashable | None = None  # the connection whose setup is PUSHING or LOADING
        self._exchanging: set[Hashable] = set()  # connections whose exchange runs (they may hold files open)

    def assigned(self, connection: Hashable) -> Hashable | None:
        """`connection` sent a LayerAssignment and holds the setup now; returns the connection it
        replaced, if one was pushing. SetupError when no setup may start: one's layers load, or the
        node serves already."""
        if self.phase is SetupPhase.SERVING:
            raise SetupError("this node has just been set up: connect again")
        if self.phase is SetupPhase.LOADING:
            raise SetupError("another setup is loading its layers")
        replaced, self._holder, self.phase = self._holder, connection, SetupPhase.PUSHING
        return replaced

    def holds(self, connection: Hashable) -> bool:
        return self._holder == connection

    def may_exchange(self, connection: Hashable) -> bool:
        """Whether `connection` may begin its exchange now: it holds the setup and no exchange runs."""
        return self.holds(connection) and not self._exchanging

    def exchanging(self, connection: Hashable) -> None:
        """`connection`'s exchange begins (`may_exchange` said it may)."""
        self._exchanging.add(connection)

    def exchanged(self, connection: Hashable) -> None:
        """`connection`'s exchange ended (whatever its outcome), its files closed."""
        self._exchanging.discard(connection)

    def pushed(self, connection: Hashable) -> bool:
        """`connection`'s files are whole in the cache; True if it still holds the setup (its
        layers load next), False if a newer one replaced it meanwhile."""
        if not self.holds(connection):
            return False
        self.phase = SetupPhase.LOADING
        return True

    def closed(self, connection: Hashable) -> None:
        """`connection` is done (refused, replaced, lost, or its load answered): a setup it held
        and that did not make the node serve is over."""
        self._exchanging.discard(connection)
        if self.holds(connection):
            self._holder = None
            if self.phase is not SetupPhase.SERVING:
                self.phase = SetupPhase.WAITING

    def serving(self) -> None:
        """The held setup's layers loaded: the node serves them."""
        self.phase = SetupPhase.SERVING


class Setup:
    def __init__(self, config: SetupConfig, revision: Revision):
        self.config = config
        self.revision = Revision(revision)
        self.cluster_hash = cluster_hash(config.cluster_key)
        self._accepted: asyncio.Queue[Assignment] = asyncio.Queue()
        self._state = SetupState()
        self._change = asyncio.Event()  # set (and replaced) whenever _state changes, for those waiting their turn

    @property
    def serves(self) -> bool:
        """A setup succeeded: the node serves its layers, and connections are no longer setups."""
        return self._state.phase is SetupPhase.SERVING

    def serving(self) -> None:
        """The node serves now: a setup connection still open takes no new assignment (the
        files in the cache are in use)."""
        self._state.serving()

    async def next(self) -> Assignment:
        """The next setup whose files are in the cache; answer it with `ready` or `refuse`."""
        return await self._accepted.get()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection that arrived before the node serves; never raises, always closes it."""
        connection = _SetupConnection(self, reader, writer)
        try:
            await authenticate_master(reader, writer, self.config.cluster_key, self.config.handshake_timeout)
            first = await connection.frames.next()
            if first is None:
                return
            if not isinstance(first, LayerAssignment):
                raise SetupError(f"this node is waiting for setup: expected LayerAssignment, got {type(first).__name__}")
            assignment = await self._take_over(connection, first)
            self._accepted.put_nowait(assignment)
            await assignment.answered.wait()
        except AuthError as e:
            connection.logger.warning("setup connection: authentication failed", error=str(e))
        except SetupError as e:
            connection.logger.warning("setup refused", error=str(e))
            await connection.send_quietly(WorkerError(str(e)))
            await _linger(reader, writer)
        except (ProtocolError, BadTensor) as e:
            connection.logger.warning("setup connection closed: not Cake protocol", error=str(e))
        except (ConnectionError, asyncio.IncompleteReadError):
            connection.logger.warning("setup connection lost")
        finally:
            self._state.closed(connection)
            self._changed()
            writer.close()

    async def _take_over(self, connection: _SetupConnection, message: LayerAssignment) -> Assignment:
        """Take the setup for `connection` and run its exchange once its turn has come; the setup
        whose files are whole. SetupError when it may not, or is replaced before its push ends."""
        replaced = self._state.assigned(connection)
        self._changed()
        if replaced is not None:
            connection.logger.warning("a new setup replaces the one in progress")
            replaced.replace()
        while not self._state.may_exchange(connection):
            if not self._state.holds(connection):
                raise SetupError("a newer setup replaced this one")
            await self._change.wait()
        self._state.exchanging(connection)
        try:
            assignment = await connection.exchange(message)
        finally:
            self._state.exchanged(connection)
            self._changed()
        if assignment is None or not self._state.pushed(connection):
            raise SetupError("a newer setup replaced this one")
        return assignment

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()


class _SetupConnection:
    """One setup connection: its stream, its messages and its logger, and its exchange while it runs."""

    def __init__(self, setup: Setup, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._config, self._cluster_hash, self._revision = setup.config, setup.cluster_hash, setup.revision
        self._writer = writer
        self.frames = _Frames(reader, setup.revision, setup.config.idle_timeout)
        peer = writer.get_extra_info("peername")
        self.logger = log.get_logger(conn=f"{peer[0]}:{peer[1]}" if peer else "?")
        self._exchange: asyncio.Task | None = None

    async def exchange(self, message: LayerAssignment) -> Assignment | None:
        """LayerAssignment → Ack, then the push if the cache does not cover the layers; None when
        `replace` stopped it first. Run as a task of its own, so that a newer setup can stop it;
        returns (or raises) only once it has ended, its files closed."""
        self._exchange = asyncio.create_task(self._run_exchange(message))
        try:
            await _ended(self._exchange)
        finally:
            exchange, self._exchange = self._exchange, None
        return None if exchange.cancelled() else exchange.result()

    def replace(self) -> None:
        """A newer setup took over: stop this one's exchange if it runs (it aborts its push)."""
        if self._exchange is not None:
            self._exchange.cancel()

    async def send_quietly(self, message: Message) -> None:
        await _send_quietly(self._writer, message, self._revision)

    async def _run_exchange(self, message: LayerAssignment) -> Assignment:
        layers = _check_layers(message.layers)
        cache = ModelCache.for_model(self._config.cache_root, self._cluster_hash, message.model_hash)
        needs_data = not cache.covers(layers)
        self.logger.info("layer assignment", layers=len(layers), first=layers[0], last=layers[-1],
                         model_hash=message.model_hash, cache=str(cache.directory), needs_data=needs_data)
        push = None
        if needs_data:
            try:
                push = cache.begin_push(layers, self._config.max_model_bytes, self._revision >= Revision.V2)
            except OSError as e:
                raise SetupError(f"cannot prepare the model cache: {e.strerror}") from None
        try:
            await _send(self._writer, LayerAssignmentAck(needs_data), self._revision)
            if push is not None:
                await self._push(push)
        except BaseException:
            if push is not None:
                push.abort()
            raise
        return Assignment(message, cache, needs_data, self._writer, self._revision)

    async def _push(self, push: ModelPush) -> None:
        chunks = received = 0
        while True:
            message = await self.frames.next()
            if message is None:
                raise SetupError(f"the master closed the connection after {chunks} chunks of the push")
            if isinstance(message, ModelDataDone):
                await _off_loop(push.finish)
                self.logger.info("model received", chunks=chunks, bytes=received)
                return
            if not isinstance(message, ModelDataChunk):
                raise SetupError(f"expected ModelDataChunk or ModelDataDone, got {type(message).__name__}")
            # Off the event loop: CRC, zstd and disk writes of up to 128 MiB would stall discovery
            # and the other connections.
            await _off_loop(push.receive, message)
            chunks += 1
            received += len(message.data)


class _Frames:
    """Messages off one setup connection; a connection silent for `idle_timeout` is lost."""

    def __init__(self, reader: asyncio.StreamReader, revision: Revision, idle_timeout: float):
        self._reader, self._idle_timeout = reader, idle_timeout
        self._decoder = FrameDecoder(revision)

    async def next(self) -> Message | None:
        """The next message, or None when the master closed the connection."""
        while (message := self._decoder.next_message()) is None:
            try:
                data = await asyncio.wait_for(self._reader.read(_READ_SIZE), self._idle_timeout)
            except TimeoutError:
                raise SetupError(f"nothing received for {self._idle_timeout:g} s") from None
            if not data:
                return None
            self._decoder.feed(data)
        return message


def _check_layers(layers: tuple[str, ...]) -> tuple[str, ...]:
    """The assigned layers if they are a non-empty list of distinct `<prefix>.<index>` names; else SetupError."""
    if not layers:
        raise SetupError("the assignment names no layer")
    if len(layers) > _MAX_LAYERS or len(set(layers)) != len(layers):
        raise SetupError("the assignment must name distinct layers")
    for layer in layers:
        if split_layer(layer) is None:
            raise SetupError(f"invalid layer name {layer[:64]!r}")
    return layers


async def _ended(task: asyncio.Task) -> None:
    """Wait until `task` has ended, however: a cancelled waiter cancels it and still waits for it."""
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        raise


async def _off_loop(function, *args):
    """`function(*args)` in a thread. A cancelled caller still waits for the thread to end, so
    that the push is never aborted (its file closed) while the thread writes to it."""
    future = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait({future})
        raise
    except (ConnectionError, TimeoutError):
        raise  # not the disk's: the caller's handlers see them as they are
    except OSError as e:  # the disk: full, read-only, permissions
        raise SetupError(f"cannot write the model cache: {e.strerror or e}") from None


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then drop what the master still sends until it closes or _LINGER_S pass."""
    try:
        writer.write_eof()
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(_READ_SIZE):
                pass
    except (OSError, RuntimeError, TimeoutError):
        pass


async def _send(writer: asyncio.StreamWriter, message: Message, revision: Revision) -> None:
    writer.writelines(encode_frame(message, revision))
    await writer.drain()


async def _send_quietly(writer: asyncio.StreamWriter, message: Message, revision: Revision) -> None:
    """Send if the master still listens; a gone master needs no answer."""
    try:
        await _send(writer, message, revision)
    except (ConnectionError, RuntimeError):
        pass
