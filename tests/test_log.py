"""Logging under a service: everything a process writes through structlog or the standard `logging`
module comes out as one JSON object per line."""

import json
import subprocess
import sys

SCRIPT = """
import logging, warnings
from cakemp import log
log.configure("json", "info")
log.get_logger(device=1).info("device ready", layers=2)
logging.getLogger("asyncio").error("Task exception was never retrieved")
try:
    raise ValueError("bad")
except ValueError:
    logging.getLogger("zmq").exception("socket failed")
warnings.warn("deprecated thing")
logging.getLogger("torch").debug("below the level")
"""


def test_stdlib_records_and_warnings_come_out_as_json_lines():
    """A stdlib record (with its logger name, level and traceback) and a Python warning are JSON lines
    like structlog's own events; a record below the level is dropped."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["event"], e["level"]) for e in events[:3]] == [
        ("device ready", "info"), ("Task exception was never retrieved", "error"), ("socket failed", "error"),
    ]
    assert (events[0]["device"], events[0]["layers"]) == (1, 2)
    assert events[1]["logger"] == "asyncio" and "timestamp" in events[1]
    assert events[2]["logger"] == "zmq" and "ValueError: bad" in events[2]["exception"]
    assert events[3]["logger"] == "py.warnings" and "deprecated thing" in events[3]["event"]
    assert len(events) == 4


def test_a_repeated_warning_is_logged_once_then_summarised_per_interval():
    """Of each event the first is logged in full, the repeats within the interval only counted and then
    summarised in one line; an interval without repeats writes nothing, and the next one is logged again."""
    from structlog.testing import capture_logs

    from cakemp.log import Repeats, get_logger

    timers = []  # (delay, callback) in the order set; a test fires them by hand
    repeats = Repeats(get_logger(), interval=10.0, call_later=lambda delay, callback: timers.append((delay, callback)))
    with capture_logs() as logs:
        for i in range(1000):
            repeats.warning(get_logger(conn=i), "setup refused", error=f"reason {i}")
        repeats.warning(get_logger(), "setup connection lost")
        assert [delay for delay, _ in timers] == [10.0, 10.0]
        timers.pop(0)[1]()  # the refusals' interval ends: one summary, and the next interval opens
        timers.pop(0)[1]()  # the lost connection's ends with no repeat: nothing
        repeats.warning(get_logger(conn=1000), "setup refused", error="counted")
        timers.pop(0)[1]()
        timers.pop(0)[1]()  # an interval with no repeat ends
        repeats.warning(get_logger(conn=7), "setup refused", error="again")
    assert logs == [
        {"event": "setup refused", "conn": 0, "error": "reason 0", "log_level": "warning"},
        {"event": "setup connection lost", "log_level": "warning"},
        {"event": "setup refused", "repeated": 999, "interval_s": 10.0, "log_level": "warning"},
        {"event": "setup refused", "repeated": 1, "interval_s": 10.0, "log_level": "warning"},
        {"event": "setup refused", "conn": 7, "error": "again", "log_level": "warning"},
    ]
