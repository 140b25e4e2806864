"""The bytes all master connections together may hold in frames being read or served.

A connection takes a whole frame's payload size once its header is in, before reading the
payload, and gives it back once the request is answered. When the budget is spent it waits,
reading nothing more, so the peer's TCP window fills and it is slowed down (backpressure)
instead of the front buffering past the cap. Taking a frame's size all at once means no
connection ever holds part of the budget while waiting for more: no two wait on each other.
Waiters are served in order, so a large frame is not starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class BufferBudget:
    def __init__(self, capacity: int, on_change: Callable[[int], None] | None = None):
        self.capacity = capacity
        self.held = 0
        self._on_change = on_change  # told the bytes held after every change (the front's gauge)
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    async def take(self, size: int) -> None:
        """Hold `size` bytes (at most `capacity`), waiting until they are free; returns at once when they are."""
        if size > self.capacity:
            raise ValueError(f"{size} bytes is more than the whole budget of {self.capacity}")
        if not self._waiters and self.held + size <= self.capacity:
            self._hold(size)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((size, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted just as it was cancelled: give it back
                self.give(size)
            else:
                self._waiters.remove((size, waiter))
                self._grant()
            raise

    def give(self, size: int) -> None:
        """Return `size` bytes taken before."""
        self._hold(-size)
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.capacity:
            size, waiter = self._waiters.popleft()
            self._hold(size)
            waiter.set_result(None)

    def _hold(self, change: int) -> None:
        self.held += change
        if self._on_change is not None:
            self._on_change(self.held)
