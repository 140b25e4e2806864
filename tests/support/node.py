"""`cakemp run` as a real subprocess for tests: started, read line by line, stopped; and its processes."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

LISTENING = "listening"


def children(pid: int) -> set[int]:
    """The pids of `pid`'s child processes (a node's device processes)."""
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: its state first (the name may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def gone(pid: int) -> bool:
    """True once `pid` no longer runs (a zombie nobody reaps counts as gone)."""
    try:
        return _stat(pid)[0] == "Z"
    except FileNotFoundError:
        return True


def minor_faults(pid: int) -> int:
    """The minor page faults process `pid` has taken so far (/proc/<pid>/stat's minflt)."""
    return int(_stat(pid)[7])


def rss(pid: int) -> int:
    """The resident memory of process `pid` in bytes (/proc/<pid>/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    """How many file descriptors process `pid` has open (ls /proc/<pid>/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_until(condition, timeout: float = 30.0, what: str = "the awaited condition"):
    """condition()'s first truthy value, asked again every 50 ms; fails after `timeout` seconds
    (a limit for a test that would otherwise hang, not a claim about how fast anything is)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.05)
    return value


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """The pids still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := {p for p in pids if not gone(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition as prometheus_client's parser reads it:
    (name, sorted labels) -> value."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a node's /metrics, as `samples` reads them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples(response.read().decode())


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def kv_bytes(metrics: Samples, device: str) -> float:
    """The KV bytes `device` (cpu:0, ...) reported last (0 before it has answered anything)."""
    return metrics.get(("cakemp_kv_cache_bytes", (("device", device),)), 0.0)


def answered(metrics: Samples, device: str) -> float:
    """How many requests `device` has answered: its request-duration histogram's count."""
    return metrics.get(("cakemp_device_request_duration_seconds_count", (("device", device),)), 0.0)


def quiescent(port: int) -> Samples:
    """/metrics once no master connection is open any more, so every earlier session has been
    freed on every device (the front counts a connection until its devices answered its End)
    and each device's KV gauge is what it holds now."""
    return wait_until(lambda: (m := scrape(port))["cakemp_connections", ()] == 0 and m,
                      what="closing every connection")


def waiting(metrics: Samples, device: str) -> float:
    """How many requests `device` owes the front now (sent down a route through it, not yet answered)."""
    return metrics.get(("cakemp_device_requests_waiting", (("device", device),)), 0.0)


def wait_waiting(port: int, device: str, count: float = 1) -> None:
    """Wait until `device` owes `count` requests: the front has sent them down a route through it."""
    wait_until(lambda: waiting(scrape(port), device) >= count, what=f"{device} owing {count:g} request(s)")


def http_status(port: int, path: str) -> int:
    """The status code of GET `path` on a node's metrics endpoint."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def write_topology(path: Path, layers: list[str], name: str = "worker") -> Path:
    path.write_text(yaml.safe_dump({name: {"host": "127.0.0.1:10128", "layers": layers}}))
    return path


class LoggedProcess:
    """A `cakemp` command as a subprocess whose JSON log lines are collected as they come."""

    def __init__(self, command: list[str], ready: str, env: dict[str, str] | None = None, timeout: float = 60.0,
                 nofile: int | None = None):
        """Start `python -m cakemp *command` and wait for its event starting with `ready` (which carries
        its port). `nofile`: the file descriptor limit it runs under (ulimit -n), soft and hard."""
        limit = None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.process = subprocess.Popen([sys.executable, "-m", "cakemp", *command], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                                        preexec_fn=limit)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()
        self.started = self.wait_for(lambda e: e.get("event", "").startswith(ready), timeout)
        self.port: int = self.started["port"]

    def _collect(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def mark(self) -> int:
        """A position in the output, for `events` and `wait_for` to look only at what comes after it."""
        return len(self.lines)

    def events(self, after: int = 0) -> list[dict]:
        """The JSON log events so far, from output line `after` on (other output, such as progress bars, is skipped)."""
        events = []
        for line in self.lines[after:]:
            start = line.find("{")
            if start < 0:
                continue
            try:
                events.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                continue
        return events

    def wait_for(self, match, timeout: float = 30.0, after: int = 0) -> dict:
        """The first event (from output line `after` on) for which match(event) holds, waiting for it;
        fails on exit or timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events(after):
                    if match(event):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._reader.is_alive():
                    raise AssertionError("the process never logged the awaited event; output:\n"
                                         + "\n".join(self.lines[-40:]))
                self._changed.wait(min(remaining, 0.2))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL the process if it still runs, and reap it: a teardown that does not judge how it ends
        (a node's device processes die with it)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class RunningNode(LoggedProcess):
    """A `cakemp run` process whose JSON log lines are collected as they come."""

    def __init__(self, model: Path | None, topology: Path | None, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0, ready: str = LISTENING, name: str | None = "worker",
                 nofile: int | None = None):
        """Start the node and wait for its event starting with `ready` (which carries its TCP port);
        without `model` and `topology` it starts in zero-config mode (give it a cluster key).
        `nofile`: the file descriptor limit it runs under (ulimit -n), soft and hard."""
        where = [] if topology is None else ["--model", str(model), "--topology", str(topology)]
        super().__init__(["run", *(["--name", name] if name else []), *where, "--address", "127.0.0.1:0",
                          "--log-format", "json", *args], ready, env, timeout, nofile)

    def device_pid(self, index: int) -> int:
        """The pid of device `index`'s current process (its latest "device ready")."""
        self.wait_for(lambda e: e.get("event") == "device ready" and e.get("device") == index)
        return [e for e in self.events() if e.get("event") == "device ready" and e.get("device") == index][-1]["pid"]

    def metrics_port(self) -> int:
        """The port of the metrics endpoint (started with --metrics-address)."""
        return self.wait_for(lambda e: e.get("event") == "metrics endpoint")["port"]


class ZeroConfigNode(RunningNode):
    """`cakemp run` in zero-config mode (cluster key, no topology) on one f32 CPU device, waiting for
    setup; discovery answers on 127.0.0.1 at `discovery_port`, the cache lives under `home`."""

    KEY = "zero-config secret"

    def __init__(self, home: Path, revision: int = 2, *args: str, name: str | None = "worker",
                 nofile: int | None = None):
        self.home = home  # XDG_CACHE_HOME; the cache is home/cake/<cluster hash>-<model hash>
        super().__init__(None, None, "--gpus", "cpu", "--dtype", "f32", "--protocol", str(int(revision)),
                         "--discovery-port", "0", "--discovery-bind", "127.0.0.1", *args,
                         env={"CAKE_CLUSTER_KEY": self.KEY, "XDG_CACHE_HOME": str(home)}, ready="waiting for setup",
                         name=name, nofile=nofile)
        self.revision = revision
        self.discovery_port: int = self.started["discovery_port"]

    def files(self) -> set[Path]:
        """Every file under the node's cache home."""
        return {p for p in self.home.rglob("*") if not p.is_dir()}
