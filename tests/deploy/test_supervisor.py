"""The project's supervisor program section: as supervisor parses it, and as supervisord runs the node from it."""

import asyncio
import getpass
import json
import os
import re
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from xmlrpc.client import ServerProxy

import pytest
import torch
from supervisor.datatypes import RestartWhenExitUnexpected
from supervisor.options import ServerOptions
from supervisor.xmlrpc import SupervisorTransport

from cakemp.demo.local_node import free_port
from cakemp.errors import CakempError, ConfigError
from cakemp.front.config import check_cluster_key
from cakemp.master.client import WorkerClient
from cakemp.master.probe import probe
from tests.deploy.flags import run_variables
from tests.support.checkpoints import HFLayers
from tests.support.master import from_raw, to_raw
from tests.support.node import children, gone, wait_gone, wait_until, write_topology
from tests.support.tolerance import assert_close

PROGRAM = Path(__file__).parents[2] / "deploy" / "supervisor" / "cakemp.conf"
# supervisor's console script, installed beside the interpreter running the tests (a venv's
# bin/ need not be on PATH).
SUPERVISORD = str(Path(sys.executable).parent / "supervisord")


def write_config(tmp_path: Path, command: str | None = None, environment: dict[str, str] | None = None) -> Path:
    """A minimal supervisord.conf (with its control socket) that [include]s the project's program section.

    The account and log directory, which supervisor checks exist, become the current user and
    tmp_path; `command` and the `environment` values given replace the file's.
    """
    text = PROGRAM.read_text()
    assert "\nuser=cakemp\n" in text and "/var/log/supervisor/" in text
    text = text.replace("\nuser=cakemp\n", f"\nuser={getpass.getuser()}\n").replace("/var/log/supervisor/", f"{tmp_path}/")
    if command is not None:
        assert "\ncommand=/opt/cakemp/bin/cakemp run\n" in text
        text = text.replace("\ncommand=/opt/cakemp/bin/cakemp run\n", f"\ncommand={command}\n")
    for key, value in (environment or {}).items():
        text, count = re.subn(rf'\b{key}="[^"]*"', f'{key}="{value}"', text)
        assert count == 1, f"{key} is not set in {PROGRAM}"
    (tmp_path / "cakemp.conf").write_text(text)
    main = tmp_path / "supervisord.conf"
    main.write_text(
        f"[supervisord]\nlogfile={tmp_path}/supervisord.log\npidfile={tmp_path}/supervisord.pid\n"
        f"[unix_http_server]\nfile={tmp_path}/supervisor.sock\n"
        "[rpcinterface:supervisor]\nsupervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
        "[include]\nfiles = cakemp.conf\n"
    )
    return main


def load(tmp_path: Path):
    """The program's config as supervisord reads it from the project's file."""
    options = ServerOptions()
    options.realize(args=["-c", str(write_config(tmp_path))])
    [group] = options.process_group_configs
    [program] = group.process_configs
    return program


def test_supervisor_accepts_the_program_section(tmp_path):
    """supervisor's own config parser reads the program section and its multi-line environment, which
    sets only variables `cakemp run` reads, CUDA's device order, and where Triton keeps what it compiles
    (the account has no home): inside the directory the file says to make the account's alone."""
    program = load(tmp_path)
    assert program.name == "cakemp"
    assert program.command == "/opt/cakemp/bin/cakemp run"
    assert program.environment["CAKE_CLUSTER_KEY"]
    others = {"CUDA_DEVICE_ORDER", "TRITON_CACHE_DIR"}
    assert {"CAKEMP_MODEL", "CAKEMP_TOPOLOGY", "CAKEMP_DRAIN_TIMEOUT"} <= set(program.environment) - others
    assert set(program.environment) - others <= run_variables()
    assert program.environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    triton = Path(program.environment["TRITON_CACHE_DIR"])
    assert f"install -d -m 0700 -o cakemp -g cakemp {triton.parent}" in PROGRAM.read_text()


def test_the_example_key_is_a_placeholder_the_node_refuses_as_it_is(tmp_path):
    """The program's key says how to make one, and a node given it unchanged exits 78 saying so."""
    key = load(tmp_path).environment["CAKE_CLUSTER_KEY"]
    assert "openssl-rand-hex-32" in key and "`openssl rand -hex 32`" in PROGRAM.read_text()
    with pytest.raises(ConfigError, match="openssl rand -hex 32"):
        check_cluster_key(key)


def test_stop_signals_the_front_and_kills_the_group_after_the_drain(tmp_path):
    """SIGTERM goes to the front alone, the group is SIGKILLed on timeout, and the timeout exceeds the drain."""
    program = load(tmp_path)
    assert program.stopsignal == signal.SIGTERM
    assert (program.stopasgroup, program.killasgroup) == (False, True)
    assert program.stopwaitsecs > int(program.environment["CAKEMP_DRAIN_TIMEOUT"])


def test_restarts_on_crashes_but_not_after_a_clean_stop_or_config_error(tmp_path):
    """Only unexpected exits are restarted, and exits 0 and 78 count as expected."""
    program = load(tmp_path)
    assert program.autorestart is RestartWhenExitUnexpected
    assert sorted(program.exitcodes) == [0, 78]


# supervisord itself running the node from the project's program section. One supervisord
# serves the tests below; the one that stops supervisord starts its own.

KEY = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one: the node refuses the file's placeholder
HIDDEN = 64


@dataclass
class Supervised:
    """A running supervisord and what the tests need to reach it and its node."""

    process: subprocess.Popen
    rpc: ServerProxy
    address: str
    log: Path  # the node's stdout, as supervisord writes it

    def front_pid(self) -> int:
        return self.rpc.supervisor.getProcessInfo("cakemp")["pid"]

    def events(self) -> list[dict]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [json.loads(line) for line in lines if line.startswith("{")]

    def wait_for_event(self, match, after: int = 0, timeout: float = 60.0) -> dict:
        """The first event from event number `after` on (`len(events())` earlier) for which match(event) holds."""
        return wait_until(lambda: next((e for e in self.events()[after:] if match(e)), None), timeout,
                          what=f"the node logging the awaited event (last lines: {self.events()[-5:]})")

    def serve_one_batch(self, checkpoint: Path, timeout: float = 180.0) -> None:
        """Probe until the node answers (auth, Hello), then check one Batch through layers 0-3 against HF's."""
        def answers() -> bool:
            try:
                asyncio.run(probe(self.address, cluster_key=KEY, timeout=5.0))
            except CakempError:
                return False
            return True

        wait_until(answers, timeout, what="the node answering a keyed probe")
        x = torch.randn(1, 3, HIDDEN)

        async def batch():
            host, port = self.address.split(":")
            async with await WorkerClient.connect(host, int(port), cluster_key=KEY) as client:
                await client.hello()
                return from_raw(await client.batch(to_raw(x), [(f"model.layers.{i}", 0, i) for i in range(4)]))

        y = asyncio.run(asyncio.wait_for(batch(), 30))
        assert_close(y, HFLayers(checkpoint, range(4), torch.float32)(x, 0))


def start_supervised(tmp: Path, checkpoint: Path) -> Supervised:
    """supervisord running the project's program section for a node over `checkpoint`, in `tmp`."""
    topology = write_topology(tmp / "topology.yml", ["model.layers.0-3"], name="worker0")
    address = f"127.0.0.1:{free_port()}"
    config = write_config(tmp, command=f"{sys.executable} -m cakemp run", environment={
        "CAKEMP_MODEL": str(checkpoint),
        "CAKEMP_TOPOLOGY": str(topology),
        "CAKEMP_ADDRESS": address,
        "CAKEMP_DTYPE": "f32",
        "CAKEMP_GPUS": "cpu:2",
        "CAKEMP_METRICS_ADDRESS": f"127.0.0.1:{free_port()}",
        "CAKE_CLUSTER_KEY": KEY,
    })
    process = subprocess.Popen([SUPERVISORD, "--nodaemon", "--configuration", str(config)], cwd=tmp,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rpc = ServerProxy("http://localhost", transport=SupervisorTransport(serverurl=f"unix://{tmp}/supervisor.sock"))
    return Supervised(process, rpc, address, tmp / "cakemp.log")


@pytest.fixture(scope="module")
def supervised(tmp_path_factory, checkpoint):
    running = start_supervised(tmp_path_factory.mktemp("supervisord"), checkpoint)
    yield running
    if running.process.poll() is None:
        # SIGTERM: supervisord stops the node before it exits. SIGKILL would orphan the front, which
        # would go on listening (its devices die with it, the front has no parent to die with).
        running.process.terminate()
        try:
            running.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()


def test_supervisord_brings_the_node_up(supervised, checkpoint):
    """Started from the project's program section, the node answers a keyed probe and serves a Batch."""
    supervised.serve_one_batch(checkpoint)


def test_a_killed_device_is_healed_in_place(supervised, checkpoint):
    """SIGKILL of a device process is healed by the same front: it logs the restart and serves again."""
    supervised.serve_one_batch(checkpoint)  # up (again, if another test restarted it)
    front = supervised.front_pid()
    victim = next(e["pid"] for e in reversed(supervised.events()) if e.get("event") == "device ready")
    mark = len(supervised.events())
    os.kill(victim, signal.SIGKILL)
    restarted = supervised.wait_for_event(lambda e: e.get("event") == "device restarted", after=mark)
    assert restarted["pid"] != victim and gone(victim)
    supervised.serve_one_batch(checkpoint)
    assert supervised.front_pid() == front


def test_a_killed_front_takes_its_devices_and_supervisord_restarts_it(supervised, checkpoint):
    """SIGKILL of the front ends its device processes, and supervisord starts a new front that serves."""
    supervised.serve_one_batch(checkpoint)  # up (again, if another test restarted it)
    front = supervised.front_pid()
    spawned = children(front)
    os.kill(front, signal.SIGKILL)
    assert wait_gone(spawned) == set()
    wait_until(lambda: supervised.front_pid() not in (0, front), what="supervisord starting the node again")
    supervised.serve_one_batch(checkpoint)


def test_stopping_supervisord_stops_the_node_cleanly(tmp_path, checkpoint):
    """supervisord's SIGTERM to the front drains it: the front exits 0 and no process of it remains."""
    supervised = start_supervised(tmp_path, checkpoint)
    try:
        supervised.serve_one_batch(checkpoint)
        front = supervised.front_pid()
        spawned = children(front) | {front}
        supervised.process.send_signal(signal.SIGTERM)
        assert supervised.process.wait(timeout=60) == 0
    finally:
        if supervised.process.poll() is None:
            supervised.process.kill()
    assert wait_gone(spawned) == set()
    log = (supervised.log.parent / "supervisord.log").read_text()
    assert "stopped: cakemp (exit status 0)" in log
