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
from dataclasses import dataclass, field
from pathlib import Path

from cakemp import log
from cakemp.auth import authenticate_master
from cakemp.checkpoint.files import split_layer
from cakemp.errors import AuthError, ProtocolError, SetupError
from cakemp.setup.cache import ModelCache
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

    async def refuse(self, reason: str) -> None:
        """The layers could not be loaded: the cache no longer counts, the master is told why."""
        self.cache.invalidate()
        await _send_quietly(self._writer, WorkerError(reason), self._revision)
        self.answered.set()


class Setup:
    def __init__(self, config: SetupConfig, revision: Revision):
        self.config = config
        self.revision = Revision(revision)
        self.cluster_hash = cluster_hash(config.cluster_key)
        self._accepted: asyncio.Queue[Assignment] = asyncio.Queue()
        self._pushing: asyncio.Task | None = None  # the setup between its LayerAssignment and its push's end
        self._loading = False  # a setup's layers are being loaded: it is answered once they are
        self._served = False  # a setup succeeded: the node serves, later connections are not setups
        self._log = log.get_logger()

    def serving(self) -> None:
        """The node serves now: a setup connection still open takes no new assignment (the
        files in the cache are in use)."""
        self._served = True

    async def next(self) -> Assignment:
        """The next setup whose files are in the cache; answer it with `ready` or `refuse`."""
        return await self._accepted.get()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection that arrived before the node serves; never raises, always closes it."""
        peer = writer.get_extra_info("peername")
        logger = self._log.bind(conn=f"{peer[0]}:{peer[1]}" if peer else "?")
        try:
            await authenticate_master(reader, writer, self.config.cluster_key, self.config.handshake_timeout)
            frames = _Frames(reader, self.revision, self.config.idle_timeout)
            first = await frames.next()
            if first is None:
                return
            if not isinstance(first, LayerAssignment):
                raise SetupError(f"this node is waiting for setup: expected LayerAssignment, got {type(first).__name__}")
            assignment = await self._take_over(first, frames, writer, logger)
            self._loading = True
            try:
                self._accepted.put_nowait(assignment)
                await assignment.answered.wait()
            finally:
                self._loading = False
        except AuthError as e:
            logger.warning("setup connection: authentication failed", error=str(e))
        except SetupError as e:
            logger.warning("setup refused", error=str(e))
            await _send_quietly(writer, WorkerError(str(e)), self.revision)
            await _linger(reader, writer)
        except ProtocolError as e:
            logger.warning("setup connection closed: not Cake protocol", error=str(e))
        except (ConnectionError, asyncio.IncompleteReadError):
            logger.warning("setup connection lost")
        finally:
            writer.close()

    async def _take_over(self, message: LayerAssignment, frames: _Frames, writer: asyncio.StreamWriter,
                         logger) -> Assignment:
        """Run this setup's assignment and push. A newer setup replaces one still pushing (a master
        that reconnected, say: the stale push must not hold it up), but not one whose layers load."""
        if self._served:
            raise SetupError("this node has just been set up: connect again")
        if self._loading:
            raise SetupError("another setup is loading its layers")
        while self._pushing is not None:  # again if another newcomer got in first: the last one wins
            logger.warning("a new setup replaces the one in progress")
            stale = self._pushing
            stale.cancel()
            await asyncio.wait({stale})  # its push aborted, its files closed; it cleared _pushing
        pushing = self._pushing = asyncio.create_task(self._receive(message, frames, writer, logger))
        try:
            await asyncio.wait({pushing})
        except asyncio.CancelledError:
            pushing.cancel()
            raise
        if pushing.cancelled():
            raise SetupError("a newer setup replaced this one")
        return pushing.result()

    async def _receive(self, message: LayerAssignment, frames: _Frames, writer: asyncio.StreamWriter,
                       logger) -> Assignment:
        """The task `_pushing` names: the exchange, after which it clears `_pushing` itself,
        before it counts as done (what `_take_over` relies on)."""
        try:
            return await self._exchange(message, frames, writer, logger)
        finally:
            if self._pushing is asyncio.current_task():
                self._pushing = None

    async def _exchange(self, message: LayerAssignment, frames: _Frames, writer: asyncio.StreamWriter,
                        logger) -> Assignment:
        """LayerAssignment → Ack, then the push if the cache does not cover the layers."""
        layers = _check_layers(message.layers)
        cache = ModelCache.for_model(self.config.cache_root, self.cluster_hash, message.model_hash)
        needs_data = not cache.covers(layers)
        logger.info("layer assignment", layers=len(layers), first=layers[0], last=layers[-1],
                    model_hash=message.model_hash, cache=str(cache.directory), needs_data=needs_data)
        push = None
        if needs_data:
            try:
                push = cache.begin_push(layers, self.config.max_model_bytes, self.revision >= Revision.V2)
            except OSError as e:
                raise SetupError(f"cannot prepare the model cache: {e.strerror}") from None
        try:
            await _send(writer, LayerAssignmentAck(needs_data), self.revision)
            if push is not None:
                await self._push(push, frames, logger)
        except BaseException:
            if push is not None:
                push.abort()
            raise
        return Assignment(message, cache, needs_data, writer, self.revision)

    async def _push(self, push, frames: _Frames, logger) -> None:
        chunks = received = 0
        while True:
            message = await frames.next()
            if message is None:
                raise SetupError(f"the master closed the connection after {chunks} chunks of the push")
            if isinstance(message, ModelDataDone):
                await _off_loop(push.finish)
                logger.info("model received", chunks=chunks, bytes=received)
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
