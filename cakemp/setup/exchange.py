"""Zero-config setup on the node's TCP listener, before it serves (docs/protocol.md, Setup
exchange and Cache directory).

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

Unlike Cake, one bad connection never ends or blocks the setup: a connection that stays
silent, sends something other than LayerAssignment, or pushes something refused is answered
WorkerError where it can be, closed, and the node keeps waiting. One setup runs at a time: a
newer LayerAssignment replaces one still pushing, and is refused while one's layers load.

What setup connections can hold is bounded as a serving connection's is. A connection reaches
`Setup.handle` only once it has proved the cluster key (front/handshakes.py), and at most
MAX_SETUP_CONNECTIONS are handled at once. Each frame's payload is read only once the node's
buffer budget (shared with the serving connections) has room for it, and must be small enough
for what it can be: the first (a LayerAssignment) at most MAX_FIRST_FRAME, a push's frames at
most MAX_SETUP_FRAME (a chunk of Cake's 128 MiB); a frame announcing more closes the connection
unread. A frame's header is due within `idle_timeout` of being owed and its payload within the
frame timeout of its header, however it trickles in; every reply must be read within the frame
timeout too. The cache is looked at off the event loop: a large index takes seconds to check.
Every connection's end is logged with its reason.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cakemp import log
from cakemp.checkpoint.files import PUSH_CHUNK_BYTES, split_layer
from cakemp.errors import BadTensor, ProtocolError, SetupError
from cakemp.setup.cache import ModelCache, ModelPush
from cakemp.setup.state import SetupPhase, SetupState
from cakemp.streams import FrameReader
from cakemp.wire import (
    LayerAssignment,
    LayerAssignmentAck,
    Message,
    ModelDataChunk,
    ModelDataDone,
    Revision,
    WorkerError,
    WorkerReady,
    encode_frame,
)
from cakemp.wire.discovery import cluster_hash

_READ_SIZE = 1 << 20
# After a refusal, how long what the master still sends is read and dropped, so that closing
# with unread bytes does not reset the connection before the master has read why.
_LINGER_S = 5.0
_MAX_LAYERS = 4096
# The largest first frame a setup can need: a LayerAssignment of _MAX_LAYERS names of up to 256
# bytes and the model hash, each length prefix counted as 8 bytes (about 1.04 MiB).
MAX_FIRST_FRAME = _MAX_LAYERS * (8 + 256) + 4096
# The largest frame of a push: a chunk of Cake's 128 MiB and its fields (file name, offsets, CRC).
MAX_SETUP_FRAME = PUSH_CHUNK_BYTES + (64 << 10)
MAX_SETUP_CONNECTIONS = 16


class Budget(Protocol):
    """The node's buffer budget (front/buffer_budget.py), which setup frames share, counted by the peer's host."""

    async def take(self, size: int, host: str) -> object: ...

    def give(self, held: object) -> None: ...


@dataclass(frozen=True)
class SetupConfig:
    """What zero-config mode needs beyond the node's own configuration."""

    cluster_key: str
    cache_root: Path
    max_model_bytes: int | None  # the most a push may announce, all files together (None: what the disk holds)
    discovery_host: str  # the UDP discovery responder's bind address and port (--discovery-bind, --discovery-port)
    discovery_port: int
    idle_timeout: float = 60.0  # seconds for the next frame's header to arrive once one is owed


@dataclass
class Assignment:
    """A setup whose files are whole in the cache, held open until the front answers it."""

    message: LayerAssignment
    cache: ModelCache
    needed_data: bool
    _connection: _SetupConnection
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # set once ready or refuse has run

    @property
    def layers(self) -> tuple[str, ...]:
        return self.message.layers

    @property
    def model_dir(self) -> Path:
        return self.cache.directory

    async def ready(self) -> None:
        """The devices hold the layers: tell the master (the connection then closes)."""
        await self._connection.send_quietly(WorkerReady())
        self.answered.set()

    async def refuse(self, reason: str, *, files_at_fault: bool = True) -> None:
        """The layers could not be loaded: the master is told why. Only when the files are at
        fault does the cache stop counting (and the files this setup pushed go with it); a node
        that stops or lacks memory keeps a cache that may have taken hours to push."""
        if files_at_fault:
            self.cache.invalidate(remove_files=self.needed_data)
        await self._connection.send_quietly(WorkerError(reason))
        self.answered.set()


class Setup:
    def __init__(self, config: SetupConfig, revision: Revision, budget: Budget, frame_timeout: float):
        """`budget`: the node's buffer budget; `frame_timeout`: seconds for a frame's payload to
        arrive once its header has, and for a reply to be read (--frame-timeout)."""
        self.config = config
        self.revision = Revision(revision)
        self.cluster_hash = cluster_hash(config.cluster_key)
        self.budget, self.frame_timeout = budget, frame_timeout
        self._accepted: asyncio.Queue[Assignment] = asyncio.Queue()
        self._state = SetupState()
        self._change = asyncio.Event()  # set (and replaced) whenever _state changes, for those waiting their turn
        self._open: set[_SetupConnection] = set()  # the connections being handled

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
        """One connection that arrived before the node serves, once it proved the key; never
        raises, always closes it, and logs why."""
        connection = _SetupConnection(self, reader, writer)
        try:
            if len(self._open) >= MAX_SETUP_CONNECTIONS:
                raise SetupError(f"{MAX_SETUP_CONNECTIONS} setup connections are open already: try again later")
            self._open.add(connection)
            await self._serve(connection)
        except SetupError as e:
            connection.logger.warning("setup refused", error=str(e))
            connection.frames.release()  # what it still sends is dropped, never held
            await connection.send_quietly(WorkerError(str(e)))
            await _linger(reader, writer)
        except (ProtocolError, BadTensor) as e:
            connection.logger.warning("setup connection closed: not Cake protocol", error=str(e), fault="peer")
        except asyncio.IncompleteReadError as e:
            connection.logger.warning("setup connection lost", error=f"the master closed it inside a frame "
                                      f"({len(e.partial)} of {e.expected} bytes came)")
        except OSError as e:
            connection.logger.warning("setup connection lost", error=f"{type(e).__name__}: {e}")
        except asyncio.CancelledError:
            connection.logger.info("closing setup connection", error="the node is stopping")
            raise
        finally:
            self._open.discard(connection)
            connection.frames.release()
            self._state.closed(connection)
            self._changed()
            writer.close()

    async def _serve(self, connection: _SetupConnection) -> None:
        """The connection's setup, from its first frame until the front answered it; SetupError
        (or the stream's errors) when it cannot be."""
        first = await connection.frames.next(MAX_FIRST_FRAME)
        connection.frames.release()  # a decoded LayerAssignment holds none of its frame's bytes
        if first is None:
            connection.logger.debug("setup connection closed by the master")
            return
        if not isinstance(first, LayerAssignment):
            raise SetupError(f"this node is waiting for setup: expected LayerAssignment, got {type(first).__name__}")
        assignment = await self._take_over(connection, first)
        self._accepted.put_nowait(assignment)
        await assignment.answered.wait()
        connection.logger.info("closing setup connection", reason="its setup was answered")

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
        self._writer, self._frame_timeout = writer, setup.frame_timeout
        peer = writer.get_extra_info("peername")
        self.frames = _Frames(reader, peer[0] if peer else "?", setup.revision, setup.budget,
                              setup.config.idle_timeout, setup.frame_timeout)
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

    async def send(self, message: Message) -> None:
        """Send `message`; SetupError if the master does not read it within the frame timeout (the
        connection is then aborted, its unsent bytes dropped)."""
        self._writer.writelines(encode_frame(message, self._revision))
        try:
            async with asyncio.timeout(self._frame_timeout):
                await self._writer.drain()
        except TimeoutError:
            self._writer.transport.abort()
            raise SetupError(f"the master did not read the node's reply within {self._frame_timeout:g} s") from None

    async def send_quietly(self, message: Message) -> None:
        """Send if the master still listens; a gone master needs no answer, one that does not read it is closed."""
        try:
            await self.send(message)
        except (ConnectionError, RuntimeError):
            pass
        except SetupError as e:
            self.logger.warning("closing setup connection", error=str(e), fault="peer")

    async def _run_exchange(self, message: LayerAssignment) -> Assignment:
        layers = _check_layers(message.layers)
        cache = ModelCache.for_model(self._config.cache_root, self._cluster_hash, message.model_hash)
        # Off the event loop: an index of many MiB, checked against thousands of layers, takes seconds.
        needs_data = not await _off_loop(cache.covers, layers)
        self.logger.info("layer assignment", layers=len(layers), first=layers[0], last=layers[-1],
                         model_hash=message.model_hash, cache=str(cache.directory), needs_data=needs_data)
        push = None
        if needs_data:
            try:
                push = cache.begin_push(layers, self._config.max_model_bytes, self._revision >= Revision.V2)
            except OSError as e:
                raise SetupError(f"cannot prepare the model cache: {e.strerror}") from None
        try:
            await self.send(LayerAssignmentAck(needs_data))
            if push is not None:
                await self._push(push)
        except BaseException:
            if push is not None:
                push.abort()
            raise
        return Assignment(message, cache, needs_data, self)

    async def _push(self, push: ModelPush) -> None:
        chunks = received = 0
        while True:
            message = await self.frames.next(MAX_SETUP_FRAME)
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
            # Freed before the next frame is awaited, as the budget it held is given back then.
            del message


class _Frames:
    """Messages off one setup connection, each read within the node's buffer budget: a frame's
    header due within `idle_timeout` of being asked for, its payload within `frame_timeout` of
    the header. A message's bytes stay taken from the budget until the next is asked for, or
    `release` (a pushed chunk's data is a view of them until it is written)."""

    def __init__(self, reader: asyncio.StreamReader, host: str, revision: Revision, budget: Budget,
                 idle_timeout: float, frame_timeout: float):
        self._frames, self._host, self._budget = FrameReader(reader, revision), host, budget
        self._idle_timeout, self._frame_timeout = idle_timeout, frame_timeout
        self._held: object | None = None  # what the last message holds of the budget

    async def next(self, max_payload: int) -> Message | None:
        """The next message, of at most `max_payload` bytes (ProtocolError, unread, if more is
        announced); None when the master closed the connection between frames."""
        self.release()
        try:
            async with asyncio.timeout(self._idle_timeout):
                size = await self._frames.header(max_payload)
        except TimeoutError:
            raise SetupError(f"no frame within {self._idle_timeout:g} s") from None
        if size is None:
            return None
        self._held = await self._budget.take(size, self._host)
        try:
            async with asyncio.timeout(self._frame_timeout):
                return await self._frames.message()
        except TimeoutError:
            raise SetupError(f"a frame did not arrive within {self._frame_timeout:g} s of its header") from None

    def release(self) -> None:
        """Give back the budget the last message holds (it is done with)."""
        if self._held is not None:
            self._budget.give(self._held)
            self._held = None


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
