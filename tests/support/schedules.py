"""Seeded random schedules of what masters ask of a worker, for differential fuzzing: sessions coming with
prompts, decoding, sending prompt chunks, rewinding, asking for a position they have not reached, saying
Goodbye (a later session's prompt often repeating the first rows of one that did) and leaving.

A schedule says what each request is (`Asked`: a session, its rows, its position); the test turns it into
requests of its own kind (a runner's, a master's) and tells the schedule which were answered.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch


class Asked(NamedTuple):
    session: int
    x: torch.Tensor  # [1, T, H]
    position: int  # index_pos of every op


class Schedule:
    """Which requests each step holds: every live session most steps (a decode at its next position, now
    and then a prompt chunk, a rewind, or a position past what it holds), new sessions with prompts (often
    the first rows of a prompt whose session said Goodbye, and more), and now and then a session saying
    Goodbye or leaving. A session holding more than `max_context` - 24 positions says Goodbye."""

    def __init__(self, rng: random.Random, hidden: int, max_context: int):
        self.rng, self.hidden, self.max_context = rng, hidden, max_context
        self.cached: dict[int, int] = {}  # live session -> the positions it holds
        self.prompts: dict[int, torch.Tensor] = {}  # session -> the prompt it started with, [1, T, H]
        self.retired: list[torch.Tensor] = []  # the prompts of sessions that said Goodbye
        self._next = 0

    def step(self) -> list[Asked]:
        """A step's requests, of distinct sessions: most live sessions', and up to two new ones' prompts."""
        rng = self.rng
        asked = [self.next(session) for session in self.cached if rng.random() < 0.85]
        for _ in range(rng.choice([0, 0, 1, 2])):
            session, self._next = self._next, self._next + 1
            asked.append(self.start(session))
        rng.shuffle(asked)
        return asked

    def start(self, session: int) -> Asked:
        """`session` (not live) starts with a prompt: fresh, or a retired one's first rows and more."""
        rng = self.rng
        prompt = self._x(rng.randint(1, 40))
        if self.retired and rng.random() < 0.6:
            earlier = rng.choice(self.retired)
            prompt = torch.cat([earlier[:, : rng.randint(1, earlier.shape[1])], prompt[:, : rng.randint(0, 8)]], dim=1)
        self.cached[session], self.prompts[session] = 0, prompt
        return Asked(session, prompt, 0)

    def next(self, session: int) -> Asked:
        """Live `session`'s next request."""
        rng, length = self.rng, self.cached[session]
        roll = rng.random()
        if roll < 0.08:  # a position past what it holds: refused
            return Asked(session, self._x(1), length + rng.randint(1, 3))
        if roll < 0.16 and length:  # a rewind: the rows from there on replaced
            return Asked(session, self._x(rng.randint(1, 5)), rng.randint(0, length - 1))
        if roll < 0.22:  # a prompt chunk
            return Asked(session, self._x(rng.randint(2, 20)), length)
        return Asked(session, self._x(1), length)

    def answered(self, asked: Asked) -> None:
        self.cached[asked.session] = asked.position + asked.x.shape[1]

    def leaving(self) -> list[tuple[int, bool]]:
        """(session, whether it said Goodbye rather than closed its connection) of those leaving now."""
        rng = self.rng
        gone = [(s, rng.random() < 0.7) for s in self.cached if rng.random() < 0.1]
        gone += [(s, True) for s, length in self.cached.items()
                 if length > self.max_context - 24 and all(s != left for left, _ in gone)]
        for session, goodbye in gone:
            del self.cached[session]
            if goodbye:
                self.retired.append(self.prompts[session])
        return gone

    def ended(self, asked: Asked, outcome: str) -> bool:
        """Whether a refusal of `asked` (`outcome`: why) has ended its session's state on the worker: given up for
        another address's room ("given up"), dropped after a request of it failed part-way ("lost"), or a new
        prompt at 0 refused for room ("no room": with prefix reuse it has retired the session's earlier rows all
        the same, docs/cluster.md, Prefix reuse). If so the session leaves, its master to start afresh."""
        if outcome in ("given up", "lost") or (outcome == "no room" and asked.position == 0):
            del self.cached[asked.session]
            return True
        return False

    def _x(self, T: int) -> torch.Tensor:
        return torch.randn(1, T, self.hidden, generator=torch.Generator().manual_seed(self.rng.getrandbits(31)))
