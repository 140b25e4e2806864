"""structlog, configured once inside each process (the front and every device process).

On a terminal lines are rendered for people; otherwise (journald, supervisor, tests) each event
is one JSON object per line on stdout. Records of the standard `logging` module (asyncio, zmq,
torch, Python's warnings) go through the same processors and renderer, so that a service's
output is JSON throughout. Event names are constant strings; figures go in fields.
Sessions (named by their master's address) and devices are bound by callers
(`log.get_logger(session=…)`); loggers are never pickled into child processes, children call
`configure`. A warning that a peer can make the node repeat many times a second goes through
`Repeats`, which logs its first and then one summary line per interval.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

import structlog

FORMATS = ("auto", "console", "json")
LEVELS = ("debug", "info", "warning", "error")


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
    structlog.configure(
        processors=[*stamped, structlog.processors.format_exc_info, renderer],
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
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(threshold)
    logging.captureWarnings(True)  # warnings.warn(...) from libraries, as `py.warnings` records


def get_logger(**context: object) -> structlog.typing.FilteringBoundLogger:
    """A logger with `context` (conn, session, device, …) bound to every event."""
    return structlog.get_logger().bind(**context)


class Repeats:
    """Warnings of the kinds a flood of connections repeats: of each event the first is logged
    in full, the ones after it within `interval` seconds are only counted, and once the interval
    is over one line says how many there were (and opens the next interval if there were any)."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, interval: float = 60.0,
                 call_later: Callable[[float, Callable[[], None]], object] | None = None):
        """`logger` writes the summaries (the first of each event goes to the caller's own logger);
        `call_later(delay, callback)` times them, by default on the running event loop."""
        self._logger, self._interval = logger, interval
        self._call_later = call_later or (lambda delay, callback: asyncio.get_running_loop().call_later(delay, callback))
        self._counts: dict[str, int] = {}  # event -> repeats in its current interval

    def warning(self, logger: structlog.typing.FilteringBoundLogger, event: str, **fields: object) -> None:
        if event in self._counts:
            self._counts[event] += 1
            return
        logger.warning(event, **fields)
        self._open(event)

    def _open(self, event: str) -> None:
        self._counts[event] = 0
        self._call_later(self._interval, lambda: self._summarise(event))

    def _summarise(self, event: str) -> None:
        repeated = self._counts.pop(event)
        if repeated:
            self._logger.warning(event, repeated=repeated, interval_s=self._interval)
            self._open(event)
