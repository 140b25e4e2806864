"""Which of the work waiting at a device runs in its next step (pure: no torch, no sockets).

A device drains every message waiting on its sockets into a `Scheduler`, then runs one step
at a time. A step takes, in arrival order: every decode (one token) up to `max_batch` requests
in all, and prefill pieces (several tokens) while their tokens stay within `prefill_chunk`, but
always the first piece that waits, so a prompt is never starved. A prompt longer than
`prefill_chunk` that comes whole (its route is this device alone) is cut here while the device
is shared: while another session holds state on it or has work waiting, each step takes the
prompt's next piece of at most `prefill_chunk` tokens (`chunk_bounds` over what is left, so the
pieces come out even), and a step holding a prompt costs about one chunk more than a step of
decodes alone. A prompt alone on its device has no decode to make wait, and a smaller piece costs
more per token (on a CPU, 128-token pieces of a 512-token prompt of hidden 256 took 1.1-1.3x the
whole prompt's time): it runs in pieces as large as the device computes in about ALONE_STEP_S, at
the rate its last step holding a prompt's piece ran (`ran`), never fewer than `prefill_chunk`
tokens (and so, before any such step, of `prefill_chunk`) nor more than ALONE_CHUNK.
A session arriving meanwhile waits for at most about that long (or one such smallest piece); a
step whose rows prefix reuse kept ran faster than its tokens say, and the next lone piece may then
be larger than ALONE_STEP_S's worth, never past ALONE_CHUNK. The prompt is answered once its
last piece has run. Decodes are never starved either: each step takes every one waiting, up to the
batch limit, oldest first.

A session's work keeps its order: a step takes at most one piece per session (its next piece
depends on this one's KV rows), and once one of a session's messages stays behind (or has pieces
left), so do all its later ones. Clear and End run before the step's pieces, so they are taken
only when none of their session's work is in the step.

What waits is a `Work` (the device's request: its session and its tokens) or a Clear or End.
`Gathering` decides how long a device waits, before a step, for sessions of its last step to
come back (see there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from cakemp.ipc import Clear, End
from cakemp.ipc.spec import ALONE_CHUNK, ALONE_STEP_S, chunk_bounds

# After a step, until its steps' fixed cost is known (Gathering), the device waits for its sessions' next
# requests at most this fraction of the step's time, but at least GATHER_MIN_S; never more than GATHER_MAX_S.
GATHER_FRACTION = 0.25
GATHER_MIN_S = 0.005
GATHER_MAX_S = 0.02
# A step's fixed cost is read off the decode steps of the smallest and the largest batch size run within
# the last GATHER_STALE steps, where the largest is at least twice the smallest.
GATHER_STALE = 1000
# Without two such sizes, one step in this many decode steps waits for no one (a probe: it takes the sessions
# back so far, in lockstep none but the first), for a second batch size to read the fixed cost off.
GATHER_PROBE = 100
STEP_COST_WEIGHT = 0.1  # the weight of a step's time in its batch size's running average


class Work(Protocol):
    session: int
    tokens: int  # T of its [1, T, H]


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of `work`: all of them, or one piece of a prompt cut here."""

    work: Work
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.work.tokens


@dataclass(frozen=True)
class Step:
    controls: tuple[Clear | End, ...]  # to run first, in order
    pieces: tuple[Piece, ...]  # to run together
    tokens: int  # the pieces' tokens

    @property
    def decodes(self) -> int | None:
        """Its requests, where each is one token (decodes alone: a batch size `StepCost` reads); None where a
        prompt's piece is among them."""
        return len(self.pieces) if self.tokens == len(self.pieces) else None


class _Waiting:
    """A work waiting, and the first of its tokens not run yet."""

    __slots__ = ("work", "session", "start")

    def __init__(self, work: Work):
        self.work, self.session, self.start = work, work.session, 0


class Scheduler:
    def __init__(self, max_batch: int, prefill_chunk: int, cut: bool = True):
        """`cut`: a prompt longer than `prefill_chunk` is cut into pieces (a text model's; an image
        component's call never is)."""
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.cut = cut
        self._waiting: deque[_Waiting | Clear | End] = deque()
        self._token_s: float | None = None  # seconds a token took in the last step holding a prompt's piece

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, item: Work | Clear | End) -> None:
        if isinstance(item, Clear | End):
            self._waiting.append(item)
            return
        self._waiting.append(_Waiting(item))

    def drop(self, work: Work) -> None:
        """Forget the pieces of `work` still waiting (its request failed)."""
        self._waiting = deque(item for item in self._waiting if not (isinstance(item, _Waiting) and item.work is work))

    def sessions(self) -> set[int]:
        """The sessions with something waiting."""
        return {item.session for item in self._waiting}

    def ran(self, step: Step, seconds: float) -> None:
        """`step` took `seconds`: one holding a prompt's piece (more tokens than pieces) sets the rate a
        lone prompt's pieces are sized by. A step of decodes alone would overstate a prompt's time per
        token (each of its rows pays for a whole pass over the weights)."""
        if step.tokens > len(step.pieces):
            self._token_s = seconds / step.tokens

    def _alone_chunk(self) -> int:
        """Tokens of a lone prompt's next piece."""
        if self._token_s is None:
            return self.prefill_chunk
        return max(self.prefill_chunk, min(ALONE_CHUNK, int(ALONE_STEP_S / max(self._token_s, 1e-9))))

    def next_step(self, live: Collection[int] = ()) -> Step:
        """Take the next step's work out of the queue (an empty step when none waits); `live`: the
        sessions holding state on this device (a prompt is cut while any other than its own does)."""
        controls, pieces, left = [], [], deque()
        stepped, held = set(), set()  # sessions with a piece in this step; sessions with something left behind
        prefill = total = 0  # the step's prompt tokens; all its tokens
        sharing: set[int] | None = None  # the sessions sharing the device, once a prompt asks
        for item in self._waiting:
            session = item.session
            if session in held:
                left.append(item)
                continue
            if not isinstance(item, _Waiting):
                if session in stepped:
                    held.add(session)
                    left.append(item)
                else:
                    controls.append(item)
                continue
            start, tokens = item.start, item.work.tokens
            end = tokens
            if self.cut and tokens - start > self.prefill_chunk:
                if sharing is None:
                    sharing = {*live, *self.sessions()}
                chunk = self.prefill_chunk if sharing - {session} else self._alone_chunk()
                end = start + chunk_bounds(tokens - start, chunk)[0][1]
            count = end - start
            if session in stepped or len(pieces) >= self.max_batch:
                fits = False
            elif count == 1:
                fits = True
            else:
                fits = not prefill or prefill + count <= self.prefill_chunk
            if fits:
                pieces.append(Piece(item.work, start, end))
                stepped.add(session)
                total += count
                prefill += count if count > 1 else 0
                item.start = end
                if end == tokens:
                    continue
            held.add(session)
            left.append(item)
        self._waiting = left
        return Step(tuple(controls), tuple(pieces), total)


class Gathering:
    """Which sessions of the last step a device waits for before the next, and until when.

    A batch's sessions come back a round trip after their answers (the turnaround: the front, the
    master, the front again), one after another. A step started at the first arrival leaves the
    others for a step of their own, and the batch splits into cohorts taking turns; a step started
    at the last one leaves the device idle for the turnaround. Two cohorts taking turns pay one more
    fixed cost a round (a step's weights read, whatever its rows: most of a GPU's step, and a CPU's at
    real sizes); one batch pays the turnaround. So the device waits for a straggler as long as a
    step's fixed cost, what a step of its own would cost it, once its decode steps at two batch sizes
    say what that is (`StepCost`). Measured through a `cpu:1` node, a step of 8 sessions through 2
    layers of hidden 256 (fixed ~0.5 ms, a turnaround ~1.6 ms) then splits; at hidden 1024 (fixed
    ~30 ms) it does not.

    Until the fixed cost is known (and again once GATHER_STALE steps have run without a second batch
    size), the window is GATHER_FRACTION of the last step's time, at least GATHER_MIN_S (after a step
    of a millisecond on 2 vCPUs, 8 sessions took 2 to 5 ms to come back), and one decode step in
    GATHER_PROBE waits for no one, to see a second size. Never past GATHER_MAX_S (16 sessions'
    requests took more than 5 ms to come back through the front and a master on 2 vCPUs).

    It waits only for sessions that came back within the window last time: a Cake master whose other
    layers run on other workers returns long after, and waiting for it would only delay the others. A
    session that does not come back within a step is no longer awaited.
    """

    def __init__(self) -> None:
        self.window_s = 0.0  # how long to wait after the last step
        self.cost = StepCost()
        self._answered: dict[int, float] = {}  # session of the last step -> when its answer left
        self._return_s: dict[int, float] = {}  # session -> how long it took to come back last time

    def arrived(self, session: int, now: float) -> None:
        """A request of `session` arrived."""
        answered = self._answered.pop(session, None)
        if answered is not None:
            self._return_s[session] = now - answered

    def stepped(self, sessions: set[int], step_s: float, now: float, decodes: int | None = None) -> None:
        """A step of `sessions` took `step_s` and was answered at `now`; `decodes`: its requests, where it
        was one of decodes alone (None: a prompt's piece was in it)."""
        if decodes is not None:
            self.cost.ran(decodes, step_s)
        fixed = self.cost.fixed_s()
        if fixed is None and decodes is not None and self.cost.steps % GATHER_PROBE == 0:
            fixed = 0.0  # a probe
        window = max(GATHER_FRACTION * step_s, GATHER_MIN_S) if fixed is None else fixed
        self.window_s = min(window, GATHER_MAX_S)
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


class StepCost:
    """What a device's steps of decodes cost: a running average of their time at each batch size, and
    from those the fixed part (the time of a step of no requests, extrapolated along a straight line)."""

    def __init__(self) -> None:
        self.steps = 0  # decode steps run
        self._seconds: dict[int, tuple[float, int]] = {}  # batch size -> (average seconds, the step it last ran)

    def ran(self, requests: int, seconds: float) -> None:
        """A step of `requests` decodes took `seconds`."""
        self.steps += 1
        average = self._seconds.get(requests)
        average = seconds if average is None else average[0] + STEP_COST_WEIGHT * (seconds - average[0])
        self._seconds[requests] = average, self.steps

    def fixed_s(self) -> float | None:
        """A step's fixed cost, from the smallest and largest batch sizes run lately (None until two of them,
        the larger at least twice the smaller), at least 0 and at most the smaller's step."""
        recent = {size: seconds for size, (seconds, last) in self._seconds.items() if self.steps - last < GATHER_STALE}
        if len(recent) < 2 or max(recent) < 2 * min(recent):
            return None
        small, large = min(recent), max(recent)
        per_request = (recent[large] - recent[small]) / (large - small)
        return min(max(recent[small] - per_request * small, 0.0), recent[small])
