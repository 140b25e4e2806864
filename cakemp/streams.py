"""Cake frames off an asyncio stream, for the node's setup connections and the master's client: the
one asyncio reader around the sans-I/O `wire.FrameDecoder`; and the stream of an accepted
connection, whose bytes a serving connection takes over as they arrive (front/connection.py)."""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

from cakemp.wire import HEADER_SIZE, MAX_PAYLOAD, FrameDecoder, Message, Revision

_READ_SIZE = 1 << 20


class Taker(Protocol):
    """What takes a stream's bytes over from its reader (`Inbox.hand_over`)."""

    def received(self, data: bytes) -> None:
        """Bytes from the peer, as they arrive."""

    def ended(self, error: Exception | None) -> None:
        """The stream ended: the peer closed its end (None; said again once the connection is gone), or
        `error` lost it."""


class Inbox(asyncio.StreamReader):
    """An accepted connection's StreamReader, read as a stream until a `Taker` takes its bytes over:
    the key handshake and a setup connection await what they read, while a serving connection,
    from its Hello on, handles each frame as its bytes arrive, with no task woken per frame."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._taker: Taker | None = None

    def hand_over(self, taker: Taker) -> None:
        """From now on give every byte to `taker`, first those read and not yet taken, and then the
        stream's end."""
        # (StreamReader's buffer and its pausing are its own: this subclass is their one other user.)
        buffered = bytes(self._buffer)
        self._buffer.clear()
        self._maybe_resume_transport()  # a stream paused with a full buffer reads again
        self._taker = taker
        if buffered:
            taker.received(buffered)
        if self.exception() is not None:
            taker.ended(self.exception())
        elif self.at_eof():
            taker.ended(None)

    def feed_data(self, data: bytes) -> None:
        if self._taker is None:
            super().feed_data(data)
        else:
            self._taker.received(data)

    def feed_eof(self) -> None:
        if self._taker is None:
            super().feed_eof()
        else:
            self._taker.ended(None)

    def set_exception(self, exc: BaseException) -> None:
        if self._taker is None:
            super().set_exception(exc)
        else:
            self._taker.ended(exc)


async def accepted(sock: socket.socket) -> tuple[Inbox, asyncio.StreamWriter]:
    """The stream of a connection accepted on `sock` (as `asyncio.open_connection(sock=...)` makes
    one), its reader an `Inbox`. OSError when the peer is gone already."""
    loop = asyncio.get_running_loop()
    reader = Inbox(loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=sock)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class FrameReader:
    """Frames off `reader`, read in two steps so that its caller acts between a frame's header and
    its payload (takes the payload's size from a buffer budget, starts its deadline): `header`
    reads the 8 header bytes exactly, `message` then the payload, in reads of at most _READ_SIZE
    into one buffer of its size (the stream's own buffer never holds more than a read's worth;
    decoded tensors and pushed chunks are views of it). Nothing past the frame is read.
    Deadlines are the caller's, around each step."""

    def __init__(self, reader: asyncio.StreamReader, revision: Revision, *, max_payload: int = MAX_PAYLOAD,
                 limits: dict[str, int] | None = None) -> None:
        """`max_payload`: the largest payload a header may announce, unless `header` is given
        another; `limits`: `wire.decode_payload`'s bounds on counts."""
        self._reader = reader
        self._decoder = FrameDecoder(revision, max_payload, limits)

    async def header(self, max_payload: int | None = None) -> int | None:
        """The next frame's payload length, once its header is in; None when the stream ended
        between frames. ProtocolError when the header is not Cake's or announces more than
        `max_payload` (given: from this frame on); IncompleteReadError when the stream ends inside it."""
        try:
            header = await self._reader.readexactly(HEADER_SIZE)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise
            return None
        if max_payload is not None:
            self._decoder.max_payload = max_payload
        self._decoder.feed(header)
        return self._decoder.frame_size()

    async def message(self) -> Message:
        """The message of the frame whose header `header` read, once its payload is in: what
        `wire.decode_payload` raises (ProtocolError, BadTensor, BadOps, the frame then consumed);
        IncompleteReadError when the stream ends first."""
        while missing := self._decoder.missing():
            chunk = await self._reader.read(min(missing, _READ_SIZE))
            if not chunk:
                raise asyncio.IncompleteReadError(self._decoder.received(), self._decoder.frame_size())
            self._decoder.feed(chunk)
        return self._decoder.next_message()
