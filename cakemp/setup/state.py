"""Which zero-config setup connection holds the node, as a state machine with no I/O: the phases
of a setup (waiting, pushing, loading, serving) and whose turn it is. `setup/exchange.py` runs the
connections over asyncio and asks it at every step.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable

from cakemp.errors import SetupError


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
