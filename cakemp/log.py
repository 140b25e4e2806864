"""structlog, configured once inside each process (the front and every device process).

On a terminal lines are rendered for people; otherwise (journald, supervisor, tests) each event
is one JSON object per line on stdout. Records of the standard `logging` module (asyncio, zmq,
torch, Python's warnings) go through the same processors and renderer, so that a service's
output is JSON throughout. Event names are constant strings; figures go in fields.
Sessions (named by their master's address) and devices are bound by callers
(`log.get_logger(session=…)`); loggers are never pickled into child processes, children call
`configure`.

Much of what is logged comes from peers (names, shapes, error texts), so no peer can make a line
long or the log fast: every string field is clipped to MAX_FIELD_CHARS (a traceback to
MAX_TRACEBACK_CHARS) and every long list to MAX_FIELD_ITEMS, and each kind of event passes at
most BURST times per WINDOW_S seconds; the next one to pass says how many were dropped
(`suppressed`). An event's kind is its level, its name and the wording of its `error` up to the
first figure or quote (garbage closing a connection is one kind, an unread reply another), or a
stdlib record's logger and message.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable

import structlog

FORMATS = ("auto", "console", "json")
LEVELS = ("debug", "info", "warning", "error")
MAX_FIELD_CHARS = 256
MAX_TRACEBACK_CHARS = 8192
MAX_FIELD_ITEMS = 32
BURST = 50  # events of one kind per window; a flood of them costs one line per window after that
WINDOW_S = 10.0


class RateLimit:
    """Lets each kind of event through at most `burst` times per `window_s`; counts the rest."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self._burst, self._window_s, self._clock = burst, window_s, clock
        self._kinds: dict[str, list] = {}  # kind -> [window start, passed in it, dropped since the last pass]
        self._lock = threading.Lock()  # the stdlib path may log from other threads

    def admit(self, kind: str) -> int | None:
        """None: drop this event; else how many of its kind were dropped before it (usually 0)."""
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is None or now - state[0] >= self._window_s:
                if state is None and len(self._kinds) >= 4096:  # bounded whatever the kinds
                    self._kinds.clear()
                state = self._kinds[kind] = [now, 0, 0 if state is None else state[2]]
            if state[1] >= self._burst:
                state[2] += 1
                return None
            state[1] += 1
            dropped, state[2] = state[2], 0
            return dropped


def clipped(value: object, limit: int = MAX_FIELD_CHARS) -> object:
    """`value` with long strings cut to `limit` characters and long lists to MAX_FIELD_ITEMS items,
    each saying how long it was."""
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}… ({len(value)} chars)"
    if isinstance(value, bytes | bytearray | memoryview):
        return clipped(repr(bytes(value[: limit + 1])), limit)
    if isinstance(value, list | tuple):
        items = [clipped(item, limit) for item in value[:MAX_FIELD_ITEMS]]
        return items if len(value) <= MAX_FIELD_ITEMS else [*items, f"… ({len(value)} items)"]
    return value


def _wording(error: object) -> str:
    """What makes an error text one kind: its words before the first figure or quoted name."""
    return re.split(r"[0-9'\"]", error, maxsplit=1)[0][:48] if isinstance(error, str) else ""


def _clip_fields(logger: object, method: str, event: dict) -> dict:
    return {key: clipped(value, MAX_TRACEBACK_CHARS if key == "exception" else MAX_FIELD_CHARS)
            for key, value in event.items()}


class _Limited:
    """The rate limit as a structlog processor (drops an event) and as a logging filter (a record)."""

    def __init__(self, limit: RateLimit):
        self._limit = limit

    def __call__(self, logger: object, method: str, event: dict) -> dict:
        dropped = self._limit.admit(f"{method}:{event.get('event')}:{_wording(event.get('error'))}")
        if dropped is None:
            raise structlog.DropEvent
        return {**event, "suppressed": dropped} if dropped else event

    def filter(self, record: logging.LogRecord) -> bool:
        dropped = self._limit.admit(f"{record.name}:{record.levelno}:{record.msg}")
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it suppressed)"
        return dropped is not None


def configure(fmt: str = "auto", level: str = "info") -> None:
    """Set up structlog and the root `logging` logger for this process; `fmt` is auto (console on a
    TTY, else JSON), console or json."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    console = sys.stdout.isatty() if fmt == "auto" else fmt == "console"
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    threshold = logging.getLevelNamesMapping()[level.upper()]
    stamped = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    limited = _Limited(RateLimit())
    structlog.configure(
        processors=[limited, *stamped, structlog.processors.format_exc_info, _clip_fields, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # One write per line: the front and its device processes share stdout, and a line
        # written in two pieces could interleave with another process's.
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    # A stdlib record's message becomes the event; its logger's name a field. StreamHandler
    # also writes each line in one call.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*stamped, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _clip_fields,
                renderer,
            ],
        )
    )
    handler.addFilter(limited)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(threshold)
    logging.captureWarnings(True)  # warnings.warn(...) from libraries, as `py.warnings` records


def get_logger(**context: object) -> structlog.typing.FilteringBoundLogger:
    """A logger with `context` (conn, session, device, …) bound to every event."""
    return structlog.get_logger().bind(**context)
