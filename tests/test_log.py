"""Logging under a service: everything a process writes through structlog or the standard `logging`
module comes out as one JSON object per line."""

import json
import subprocess
import sys

from cakemp import log

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


FLOOD = """
import logging
from cakemp import log
log.configure("json", "info")
logger = log.get_logger()
for i in range(5000):
    logger.warning("a new setup replaces the one in progress", i=i)
    logging.getLogger("asyncio").error("socket.accept() out of system resource")
logger.info("shape refused", shape=[2**62] * 100_000, error="x" * 1_000_000)
"""


def test_a_flood_of_one_warning_is_a_burst_and_every_field_is_clipped():
    """5,000 copies of one warning and of one stdlib error come out as BURST lines each, and an event
    carrying a peer's 100,000-dimension shape and a megabyte of text is one short line saying how long
    each was."""
    done = subprocess.run([sys.executable, "-c", FLOOD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert sum(e["event"] == "a new setup replaces the one in progress" for e in events) == log.BURST
    assert sum(e["event"].startswith("socket.accept()") for e in events) == log.BURST
    last = events[-1]
    assert last["event"] == "shape refused" and len(done.stdout.splitlines()[-1]) < 2000
    assert last["error"].endswith("… (1000000 chars)") and len(last["error"]) < log.MAX_FIELD_CHARS + 32
    assert len(last["shape"]) == log.MAX_FIELD_ITEMS + 1 and last["shape"][-1] == "… (100000 items)"


def test_the_rate_limit_lets_a_kind_through_again_each_window_and_counts_what_it_dropped():
    """Past the burst an event is dropped; in the next window the first one passes carrying the count,
    and other kinds were never affected."""
    now = [0.0]
    limit = log.RateLimit(burst=3, window_s=10.0, clock=lambda: now[0])
    assert [limit.admit("a") for _ in range(5)] == [0, 0, 0, None, None]
    assert limit.admit("b") == 0
    now[0] = 10.0
    assert limit.admit("a") == 2 and limit.admit("a") == 0


def test_a_flood_of_one_close_reason_does_not_hide_another():
    """Closes of one wording (a peer's garbage) flooding past the burst leave closes of another wording
    (an unread reply) logged, each with its own figures."""
    limit = log.RateLimit(burst=2)
    limited = log._Limited(limit)
    garbage = [{"event": "closing connection", "error": f"truncated payload: {n} bytes"} for n in range(10)]
    passed = []
    for event in garbage:
        try:
            passed.append(limited(None, "warning", event))
        except log.structlog.DropEvent:
            pass
    unread = limited(None, "warning", {"event": "closing connection", "error": "the master did not read its reply within 3 s"})
    assert len(passed) == 2 and unread["error"].startswith("the master did not read")


def test_a_refusal_repeating_a_peer_s_text_is_one_kind_by_its_error_type():
    """Errors naming ever new layers (a peer's text, unquoted) are one kind when the caller names the
    error's class: BURST of 1,000 pass, and another wording of the event is untouched."""
    limited = log._Limited(log.RateLimit(burst=3))
    passed = 0
    for i in range(1000):
        try:
            limited(None, "warning", {"event": "request refused", "error": f"could not find layer x{'q' * (i % 40)}",
                                      "error_type": "UnknownLayer"})
            passed += 1
        except log.structlog.DropEvent:
            pass
    assert passed == 3
    assert limited(None, "warning", {"event": "request refused", "error": "positions pass the context limit",
                                     "error_type": "ContextLimitExceeded"})


def test_past_max_kinds_a_new_kind_counts_as_its_family_and_nothing_is_reset():
    """With the table full, new kinds of one event name share one count (its family's), and a kind
    counted before keeps its count: its flood is not let through again."""
    limit = log.RateLimit(burst=2, max_kinds=4)
    assert [limit.admit("a", "f") for _ in range(3)] == [0, 0, None]
    for i in range(3):
        limit.admit(f"g {i}", "g")
    assert sum(limit.admit(f"g new {i}", "g") is not None for i in range(100)) == 2
    assert limit.admit("a", "f") is None


def test_a_window_that_ended_is_reported_with_its_drops_and_forgotten():
    """`ended` lists each kind (and family) whose window is over with what it dropped, then forgets them."""
    now = [0.0]
    limit = log.RateLimit(burst=2, window_s=10.0, clock=lambda: now[0])
    for _ in range(7):
        limit.admit("warning:session freed:", "warning:session freed")
    limit.admit("info:quiet:", "info:quiet")
    assert limit.ended() == []
    now[0] = 10.0
    assert limit.ended() == [("warning:session freed:", 5)]
    assert limit.ended() == []
    assert limit.admit("warning:session freed:", "warning:session freed") == 0


REPORTED = """
from cakemp import log
log.WINDOW_S = 0.4
log.configure("json", "info")
logger = log.get_logger()
for i in range(500):
    logger.info("session freed", device=0, device_sessions=i)
import time
time.sleep(1.5)
"""


def test_a_flood_s_last_count_is_reported_when_its_window_ends():
    """500 lines of one kind and then nothing: BURST come out, and after the window one line says how many
    were suppressed, though no later line of the kind passed."""
    done = subprocess.run([sys.executable, "-c", REPORTED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert sum(e["event"] == "session freed" for e in events) == log.BURST
    reports = [e for e in events if e["event"] == log.SUPPRESSED]
    assert [(e["kind"], e["suppressed"]) for e in reports] == [("info:session freed:", 500 - log.BURST)]
