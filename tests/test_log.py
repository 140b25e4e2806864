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
