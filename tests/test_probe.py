"""`cakemp probe` against a running node, a wrong key, a port nothing listens on, and a non-Cake server."""

import asyncio
import json
import re
import socket
import sys
import threading
import urllib.request

import pytest
import yaml
from click.testing import CliRunner

from cakemp.cli import cli, main
from cakemp.demo.local_node import LocalNode, free_port
from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from cakemp.errors import ProtocolError, WorkerUnreachable
from cakemp.master.connections import Dialer

KEY = "probe secret"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A one-device f32 node with a cluster key, serving every layer of a tiny checkpoint."""
    work = tmp_path_factory.mktemp("probe")
    write_checkpoint(work, SyntheticSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    port = free_port()
    topology = work / "topology.yml"
    topology.write_text(yaml.safe_dump({"w": {"host": f"127.0.0.1:{port}", "layers": ["model.layers.0-1"]}}))
    node = LocalNode(name="w", model_dir=work, topology=topology, port=port, gpus="cpu", dtype="f32",
                     log_path=work / "node.log", cluster_key=KEY, metrics_port=free_port())
    node.start()
    try:
        asyncio.run(node.wait_ready())
        yield node
    finally:
        assert node.stop() == 0


def probe(*args):
    return CliRunner().invoke(cli, ["probe", *args])


def test_the_node_serves_metrics_where_it_was_told(node):
    """LocalNode's metrics_port is the node's --metrics-address (tools/gpu_check reads its steps there)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as response:
        assert b"# TYPE cakemp_requests_total counter" in response.read()


def test_a_running_node_is_up(node):
    """With the node's key, probe exits 0 and prints the WorkerInfo."""
    result = probe(node.address, "--cluster-key", KEY)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{node.address} is up: version 0.1.0, ")
    assert re.search(r", device cpu 0, dtype F32, latency \d+ ms\n$", result.stdout)


def test_json_output_is_the_worker_info(node):
    """--json prints the WorkerInfo fields as one JSON object."""
    result = probe(node.address, "--cluster-key", KEY, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["address"] == node.address and info["dtype"] == "F32" and info["device"] == "cpu"


def test_another_key_is_refused(node):
    """A different key fails the handshake: exit 2, one line."""
    result = probe(node.address, "--cluster-key", "not the key")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "cluster key refused" in result.stderr


def test_no_key_against_a_keyed_node_times_out(node):
    """Without a key the node waits for a handshake that never comes: exit 3, with a hint."""
    result = probe(node.address, "--timeout", "0.5")
    assert result.exit_code == 3
    assert result.stderr.count("\n") == 1 and "expect a cluster key" in result.stderr


def test_a_master_without_the_key_is_told_the_node_expects_one(node):
    """A master's dial without a key, against a keyed node (which takes the Hello for the start of the
    handshake and waits), ends naming the cluster key rather than as a worker that hangs."""
    with pytest.raises(WorkerUnreachable, match="did not answer Hello within 0.5 s .does it expect a cluster key"):
        asyncio.run(Dialer(timeout=0.5).connect([(0, node.address)]))


def test_a_master_without_a_key_whose_hello_is_closed_unanswered_hears_of_the_key():
    """A keyed node closes a connection whose handshake did not come in time (its own timeout, which may
    come before the master's): a keyless master's dial that sees its Hello closed unanswered names the key."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def close_after_reading():
            conn, _ = server.accept()
            with conn:
                conn.recv(64)

        thread = threading.Thread(target=close_after_reading, daemon=True)
        thread.start()
        with pytest.raises(ProtocolError, match="closed the connection.*does it expect a cluster key"):
            asyncio.run(Dialer(timeout=5).connect([(0, f"127.0.0.1:{server.getsockname()[1]}")]))
        thread.join(5)


def test_nothing_listening_is_down():
    """A port nothing listens on is reported down: exit 1, one line."""
    port = free_port()
    result = probe(f"127.0.0.1:{port}")
    assert result.exit_code == 1
    assert result.stderr == f"cakemp: error: down: cannot connect to 127.0.0.1:{port}: Connection refused\n"


def test_a_server_that_is_not_cake_answers_wrongly():
    """An HTTP server's reply is not a Cake frame: exit 3, one line."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer():
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        result = probe(f"127.0.0.1:{server.getsockname()[1]}")
        thread.join(5)
    assert result.exit_code == 3
    assert result.stderr.count("\n") == 1 and "wrong answer" in result.stderr


def test_a_malformed_address_exits_78(monkeypatch, capsys):
    """An address without a port is a configuration error: exit 78, one line."""
    monkeypatch.setattr(sys, "argv", ["cakemp", "probe", "localhost"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 78
    assert capsys.readouterr().err == "cakemp: error: invalid worker address 'localhost': expected host:port\n"
