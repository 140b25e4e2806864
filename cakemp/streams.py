"""Cake frames off an asyncio stream, for the node's serving and setup connections and the master's
client alike: the one asyncio reader around the sans-I/O `wire.FrameDecoder`."""

from __future__ import annotations

import asyncio

from cakemp.wire import HEADER_SIZE, MAX_PAYLOAD, FrameDecoder, Message, Revision

_READ_SIZE = 1 << 20


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
