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
most BURST times per WINDOW_S seconds; the next one to pass says how many were dropped (`suppressed`), and so does a line
("log lines suppressed", with the kind) once the window has ended, so a flood's last counts are
never lost. An event's kind is its level, its name and its error's class when the caller names it
(`error_type`, for errors that repeat a peer's text), else the wording of its `error` up to the
first figure or quote (garbage closing a connection is one kind, an unread reply another), or a
stdlib record's logger and message. At most MAX_KINDS kinds are counted one by one; past that a
new kind is counted as its event name's, and nothing is ever reset.
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
MAX_KINDS = 4096
SUPPRESSED = "log lines suppressed"  # the event that reports, at a window's end, what a kind dropped


class RateLimit:
    """Lets each kind of event through at most `burst` times per `window_s`; counts the rest. At most
    `max_kinds` kinds are counted one by one: past that a new kind is counted as its family (its event
    name at its level: a set the code fixes), so the table stays bounded and nothing is reset. A
    window's count is kept until `ended` is called after the window, which forgets it and says what
    it dropped."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 max_kinds: int = MAX_KINDS):
        self._burst, self._window_s, self._clock, self._max_kinds = burst, window_s, clock, max_kinds
        self._kinds: dict[str, list] = {}  # kind -> [window start, passed in it, dropped since the last pass]
        self._lock = threading.Lock()  # the stdlib path may log from other threads, and `ended` runs on its own

    def admit(self, kind: str, family: str | None = None) -> int | None:
        """None: drop this event; else how many of its kind were dropped before it (usually 0)."""
        now = self._clock()
        with self._lock:
            if kind not in self._kinds and len(self._kinds) >= self._max_kinds and family is not None:
                kind = family  # no room to count it on its own
            return _counted(self._kinds, kind, now, self._window_s, self._burst)

    def ended(self) -> list[tuple[str, int]]:
        """The kinds whose window has ended, now forgotten, with how many of each were dropped since the
        last of them passed (those that dropped none are not listed)."""
        now = self._clock()
        with self._lock:
            done = [kind for kind, state in self._kinds.items() if now - state[0] >= self._window_s]
            return [(kind, dropped) for kind in done if (dropped := self._kinds.pop(kind)[2])]


def _counted(table: dict[str, list], kind: str, now: float, window_s: float, burst: int) -> int | None:
    """Count one event of `kind` in `table`: None if past `burst` in its window, else the drops before it."""
    state = table.get(kind)
    if state is None or now - state[0] >= window_s:
        state = table[kind] = [now, 0, 0 if state is None else state[2]]
    if state[1] >= burst:
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
    """The rate limit as a structlog processor (drops an event) and as a logging filter (a record), with
    a thread that reports what each kind dropped once its window has ended."""

    def __init__(self, limit: RateLimit, window_s: float = WINDOW_S):
        self._limit, self._window_s = limit, window_s
        self._stopped = threading.Event()

    def __call__(self, logger: object, method: str, event: dict) -> dict:
        family = f"{method}:{event.get('event')}"
        # The error's class when the caller names it (its wording may repeat a peer's text), else its wording.
        detail = event.get("error_type") or _wording(event.get("error"))
        dropped = self._limit.admit(f"{family}:{detail}", family)
        if dropped is None:
            raise structlog.DropEvent
        return {**event, "suppressed": dropped} if dropped else event

    def filter(self, record: logging.LogRecord) -> bool:
        family = f"{record.name}:{record.levelno}"
        dropped = self._limit.admit(f"{family}:{record.msg}", family)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it suppressed)"
        return dropped is not None

    def start_reporting(self) -> None:
        threading.Thread(target=self._report, name="log-suppressed", daemon=True).start()

    def stop_reporting(self) -> None:
        self._stopped.set()

    def _report(self) -> None:
        """Every quarter window, one line per kind whose window ended having dropped events: a flood's
        last counts appear though no later line of its kind passes."""
        while not self._stopped.wait(self._window_s / 4):
            for kind, dropped in self._limit.ended():
                structlog.get_logger().warning(SUPPRESSED, kind=kind, suppressed=dropped, window_s=self._window_s)


_reporting: _Limited | None = None  # the limit configured last in this process, whose thread reports


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
    global _reporting
    if _reporting is not None:
        _reporting.stop_reporting()
    limited = _reporting = _Limited(RateLimit(window_s=WINDOW_S), WINDOW_S)
    limited.start_reporting()
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
