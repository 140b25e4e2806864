"""`cakemp run` as a real subprocess for tests: started, read line by line, stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

LISTENING = "listening on "


def write_topology(path: Path, layers: list[str], name: str = "worker") -> Path:
    path.write_text(yaml.safe_dump({name: {"host": "127.0.0.1:10128", "layers": layers}}))
    return path


class RunningNode:
    """A `cakemp run` process whose JSON log lines are collected as they come."""

    def __init__(self, model: Path, topology: Path, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0):
        command = [sys.executable, "-m", "cakemp", "run", "--name", "worker", "--model", str(model),
                   "--topology", str(topology), "--address", "127.0.0.1:0", "--log-format", "json", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()
        listening = self.wait_for(lambda e: e.get("event", "").startswith(LISTENING), timeout)
        self.port: int = listening["port"]

    def _collect(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def events(self) -> list[dict]:
        """The JSON log events so far (other output, such as progress bars, is skipped)."""
        events = []
        for line in list(self.lines):
            start = line.find("{")
            if start < 0:
                continue
            try:
                events.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                continue
        return events

    def wait_for(self, match, timeout: float = 30.0) -> dict:
        """The first event for which match(event) holds, waiting for it; fails on exit or timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events():
                    if match(event):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._reader.is_alive():
                    raise AssertionError("node never logged the awaited event; output:\n" + "\n".join(self.lines[-40:]))
                self._changed.wait(min(remaining, 0.2))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)
