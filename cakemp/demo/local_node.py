"""A cakemp node run as a real `cakemp run` subprocess on a loopback port (demo and tests).

The node is started exactly as an operator starts one, with flags, so what the demo and the
end-to-end tests exercise is the shipped command, its device processes and their shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import cakemp
from cakemp.errors import CakempError, NodeFault
from cakemp.master.probe import probe
from cakemp.wire import WorkerInfo

# As long as the node's front waits for a device that loads nothing (its LOAD_SILENCE_S): on a
# loaded machine, starting torch in every device process alone can take minutes.
READY_TIMEOUT_S = 300.0


class NodeFailed(NodeFault):
    """A node started as a subprocess (demo, tests) exited early, never became ready, or did not stop cleanly."""


def free_port() -> int:
    """A TCP port nothing listens on right now on 127.0.0.1 (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalNode:
    """`cakemp run --name NAME ...` listening on `address`, its output in `log_path`."""

    def __init__(
        self,
        *,
        name: str,
        model_dir: Path,
        topology: Path,
        port: int,
        gpus: str,
        dtype: str,
        log_path: Path,
        cluster_key: str | None = None,
        protocol: int = 2,
        metrics_port: int | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        """`metrics_port`: where the node serves /metrics on 127.0.0.1 (None: nowhere); `extra`: more of
        `cakemp run`'s options."""
        self.address = f"127.0.0.1:{port}"
        self.metrics_port = metrics_port
        self.cluster_key = cluster_key
        self.log_path = log_path
        self.command = [
            sys.executable, "-m", "cakemp", "run",
            "--name", name, "--model", str(model_dir), "--topology", str(topology),
            "--address", self.address, "--gpus", gpus, "--dtype", dtype, "--protocol", str(protocol),
            *(() if metrics_port is None else ("--metrics-address", f"127.0.0.1:{metrics_port}")), *extra,
        ]  # fmt: skip
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the subprocess; the key goes through the environment, never the command line.

        The node runs the very package this process imported, whatever the working directory:
        `python -m cakemp` would otherwise import whatever `cakemp` the working directory or the
        environment offers first (a clone's source tree, another install). It runs in the log's
        directory, so nothing in the caller's working directory shadows a module it imports.
        """
        env = {k: v for k, v in os.environ.items() if k != "CAKE_CLUSTER_KEY" and not k.startswith("CAKEMP_")}
        if self.cluster_key is not None:
            env["CAKE_CLUSTER_KEY"] = self.cluster_key
        package_root = str(Path(cakemp.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=self.log_path.parent,
            )

    async def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> WorkerInfo:
        """Probe until the node answers Hello; NodeFailed if it exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise NodeFailed(f"the node exited with status {self._process.returncode}{self.log_tail()}")
            try:
                return await probe(self.address, cluster_key=self.cluster_key, timeout=5.0)
            except CakempError:
                if time.monotonic() > deadline:
                    raise NodeFailed(f"the node was not ready after {timeout:g} s{self.log_tail()}") from None
            await asyncio.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the node to exit; its exit status (SIGKILL after `timeout`)."""
        process = self._process
        if process is None:
            return 0
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the node's output, indented, after a newline ("" when empty)."""
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "".join(f"\n  | {line}" for line in tail)
