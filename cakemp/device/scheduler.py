"""Which of the messages waiting at a device run in its next step (pure: no torch, no sockets).

A device drains every message waiting on its sockets into a `Scheduler`, then runs one step
at a time. A step takes, in arrival order: every decode hop (one token) up to `max_batch`
requests in all, and prefill chunks (several tokens) while their tokens stay within
`prefill_chunk`, but always the first chunk that waits, so a prompt is never starved; the
front cuts prompts into chunks of at most that many tokens (`--prefill-chunk`), so a step
holding a prompt costs about one chunk more than a step of decodes alone. Decodes are never
starved either: each step takes every one waiting, up to the batch limit, oldest first.

A session's messages keep their order: a step takes at most one hop per session (its next
chunk depends on this one's KV rows), and once one of a session's messages stays behind, so
do all its later ones. Clear and End run before the step's hops, so they are taken only when
none of their session's hops is in the step.

`Gathering` decides how long a device waits, before a step, for sessions of its last step to
come back (see there).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from cakemp.ipc import Clear, End, Hop

# After a step, the device waits for its sessions' next requests at most this fraction of the
# step's time, and never more than GATHER_MAX_S.
GATHER_FRACTION = 0.25
GATHER_MAX_S = 0.02


@dataclass(frozen=True)
class Step:
    controls: tuple[Clear | End, ...]  # to run first, in order
    hops: tuple[Hop, ...]  # to run together
    tokens: int  # the hops' tokens


def tokens(hop: Hop) -> int:
    """Tokens the hop carries: T of its [1, T, H] (a malformed shape counts all but its last dim)."""
    return math.prod(hop.shape[:-1]) if len(hop.shape) > 1 else 1


class Scheduler:
    def __init__(self, max_batch: int, prefill_chunk: int):
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._waiting: deque[Hop | Clear | End] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, message: Hop | Clear | End) -> None:
        self._waiting.append(message)

    def sessions(self) -> set[int]:
        """The sessions with a message waiting."""
        return {message.session for message in self._waiting}

    def next_step(self) -> Step:
        """Take the next step's messages out of the queue (an empty step when none waits)."""
        controls, hops, left = [], [], deque()
        stepped, held = set(), set()  # sessions with a hop in this step; sessions with a message left behind
        prefill = total = 0  # the step's prompt tokens; all its tokens
        for message in self._waiting:
            session = message.session
            if session in held:
                left.append(message)
                continue
            if not isinstance(message, Hop):
                if session in stepped:
                    held.add(session)
                    left.append(message)
                else:
                    controls.append(message)
                continue
            count = tokens(message)
            if session in stepped or len(hops) >= self.max_batch:
                fits = False
            elif count == 1:
                fits = True
            else:
                fits = not prefill or prefill + count <= self.prefill_chunk
            if fits:
                hops.append(message)
                stepped.add(session)
                total += count
                prefill += count if count > 1 else 0
            else:
                held.add(session)
                left.append(message)
        self._waiting = left
        return Step(tuple(controls), tuple(hops), total)


class Gathering:
    """Which sessions of the last step a device waits for before the next, and until when.

    A batch's sessions come back a round trip after their answers, one after another; a step
    started at the first arrival would leave the others waiting a whole step, and the batch
    would split into cohorts taking turns. So the device waits for them, but only briefly
    (GATHER_FRACTION of the last step's time, at most GATHER_MAX_S: 16 sessions' requests took
    more than 5 ms to come back through the front and a master on 2 vCPUs, and half of them then
    missed each step), and only for sessions that came back that fast last time: a Cake master
    whose other layers run on other workers returns long after, and waiting for it would only
    delay the others. A session that does not come back within a step is no longer awaited.
    """

    def __init__(self) -> None:
        self.window_s = 0.0  # how long to wait after the last step
        self._answered: dict[int, float] = {}  # session of the last step -> when its answer left
        self._return_s: dict[int, float] = {}  # session -> how long it took to come back last time

    def arrived(self, session: int, now: float) -> None:
        """A request of `session` arrived."""
        answered = self._answered.pop(session, None)
        if answered is not None:
            self._return_s[session] = now - answered

    def stepped(self, sessions: set[int], step_s: float, now: float) -> None:
        """A step of `sessions` took `step_s` and was answered at `now`."""
        self.window_s = min(GATHER_FRACTION * step_s, GATHER_MAX_S)
        self._answered = dict.fromkeys(sessions, now)

    def owed(self) -> bool:
        """Whether a session of the last step has not come back yet (its next request is due)."""
        return bool(self._answered)

    def ended(self, session: int) -> None:
        self._answered.pop(session, None)
        self._return_s.pop(session, None)

    def awaited(self) -> set[int]:
        """Sessions of the last step not back yet that came back within the window last time (or never left before)."""
        return {session for session in self._answered if self._return_s.get(session, 0.0) <= self.window_s}
