"""Frame bytes off an asyncio stream, for the serving and the setup connections alike."""

from __future__ import annotations

import asyncio

_READ_SIZE = 1 << 20


async def read_payload(reader: asyncio.StreamReader, size: int) -> bytearray:
    """`size` bytes of the stream into one buffer, allocated once (decoded tensors and pushed
    chunks are views of it; the stream's own buffer never holds more than a read's worth).
    IncompleteReadError when the stream ends first."""
    payload = bytearray(size)
    got = 0
    with memoryview(payload) as view:
        while got < size:
            chunk = await reader.read(min(size - got, _READ_SIZE))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(view[:got]), size)
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
    return payload
