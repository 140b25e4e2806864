import asyncio
import json
import os
import platform
import time
import urllib.request

import pytest
import torch
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import cakemp
from cakemp.cli import cli
from cakemp.compute.kv_cache import BLOCK
from cakemp.front.metrics import Metrics
from cakemp.front.metrics_server import start_metrics_server
from cakemp.prometheus import Counter, Histogram
from cakemp.wire import Batch, LayerOp, Revision, TensorMessage, encode_frame
from tests.support.checkpoints import TINY
from tests.support.master import CakeMaster, to_raw
from tests.support.node import RunningNode, samples, scrape, write_topology

PROCESS_FAMILIES = {
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
}


def test_fresh_registry_parses_and_declares_every_family():
    """An untouched registry parses and names each metric with its type."""
    families = {family.name: family.type for family in text_string_to_metric_families(Metrics().render())}
    assert families == {
        "cakemp_requests": "counter",
        "cakemp_request_errors": "counter",
        "cakemp_request_duration_seconds": "histogram",
        "cakemp_tokens": "counter",
        "cakemp_layer_ops": "counter",
        "cakemp_received_bytes": "counter",
        "cakemp_sent_bytes": "counter",
        "cakemp_connections": "gauge",
        "cakemp_sessions": "gauge",
        "cakemp_refused_connections": "counter",
        "cakemp_buffered_bytes": "gauge",
        "cakemp_handshakes": "gauge",
        "cakemp_handshakes_displaced": "counter",
        "cakemp_unread_replies": "counter",
        "cakemp_accept_failures": "counter",
        "cakemp_device_request_duration_seconds": "histogram",
        "cakemp_device_requests_waiting": "gauge",
        "cakemp_device_batch_requests": "gauge",
        "cakemp_device_batch_size": "histogram",
        "cakemp_device_step_tokens": "histogram",
        "cakemp_kv_cache_bytes": "gauge",
        "cakemp_kv_cache_budget_bytes": "gauge",
        "cakemp_device_memory_bytes": "gauge",
        "cakemp_prefix_hits": "counter",
        "cakemp_prefix_reused_tokens": "counter",
        "cakemp_prefix_evictions": "counter",
        "cakemp_prefix_retired_bytes": "gauge",
        "cakemp_expert_cache_hits": "counter",
        "cakemp_expert_cache_misses": "counter",
        "cakemp_expert_read_bytes": "counter",
        "cakemp_expert_cache_bytes": "gauge",
        "cakemp_prefix_kept_bytes": "gauge",
        "cakemp_device_restarts": "counter",
        "cakemp_ready": "gauge",
        "cakemp_build_info": "gauge",
        **PROCESS_FAMILIES,
    }


def test_build_info_and_process_metrics_describe_this_process():
    """build_info carries the package version; the process_* figures are this process's own."""
    seen = samples(Metrics().render())
    assert seen["cakemp_build_info", (("python", platform.python_version()),
                                      ("version", cakemp.__version__))] == 1
    assert seen["process_open_fds", ()] == len(os.listdir("/proc/self/fd"))  # both count the fd listing it
    assert 0 < seen["process_start_time_seconds", ()] <= time.time()
    assert seen["process_resident_memory_bytes", ()] > 0
    assert seen["process_virtual_memory_bytes", ()] >= seen["process_resident_memory_bytes", ()]
    assert 0 < seen["process_cpu_seconds_total", ()] <= time.process_time() + 1


def test_served_requests_are_split_by_kind():
    """One token past position 0 is a decode; several tokens, or position 0, a prefill."""
    metrics = Metrics()
    metrics.served(tokens=7, first_position=0, layer_ops=4, seconds=0.2)
    metrics.served(tokens=1, first_position=0, layer_ops=4, seconds=0.1)
    metrics.served(tokens=1, first_position=7, layer_ops=4, seconds=0.01)
    metrics.served(tokens=3, first_position=8, layer_ops=2, seconds=0.05)
    seen = samples(metrics.render())
    assert seen["cakemp_tokens_total", (("kind", "prefill"),)] == 11
    assert seen["cakemp_tokens_total", (("kind", "decode"),)] == 1
    assert seen["cakemp_request_duration_seconds_count", (("kind", "prefill"),)] == 3
    assert seen["cakemp_request_duration_seconds_count", (("kind", "decode"),)] == 1
    assert seen["cakemp_request_duration_seconds_sum", (("kind", "decode"),)] == pytest.approx(0.01)
    assert seen["cakemp_layer_ops_total", ()] == 14


def test_recorded_values_appear_in_the_exposition():
    """Counters, gauges and labels recorded on the registry are what the parser reads back."""
    metrics = Metrics()
    metrics.requests.inc()
    metrics.requests.inc()
    metrics.errors.inc(error="UnknownLayer")
    metrics.bytes_received.inc(1024)
    metrics.bytes_sent.inc(512)
    metrics.device_restarts.inc(device="1")
    metrics.connections.inc()
    metrics.connections.inc()
    metrics.connections.dec()
    metrics.kv_bytes.set(4096, device="0")
    metrics.device_loaded("0", 1 << 20, kv_budget_bytes=None)
    metrics.device_loaded("1", 1 << 21, kv_budget_bytes=8192)
    metrics.set_ready(True)
    seen = samples(metrics.render())
    assert seen[("cakemp_requests_total", ())] == 2
    assert seen[("cakemp_request_errors_total", (("error", "UnknownLayer"),))] == 1
    assert seen[("cakemp_received_bytes_total", ())] == 1024
    assert seen[("cakemp_sent_bytes_total", ())] == 512
    assert seen[("cakemp_device_restarts_total", (("device", "1"),))] == 1
    assert seen[("cakemp_connections", ())] == 1
    assert seen[("cakemp_kv_cache_bytes", (("device", "0"),))] == 4096
    assert seen[("cakemp_device_memory_bytes", (("device", "1"),))] == 1 << 21
    assert ("cakemp_kv_cache_budget_bytes", (("device", "0"),)) not in seen  # no budget: no series
    assert seen[("cakemp_kv_cache_budget_bytes", (("device", "1"),))] == 8192
    assert seen[("cakemp_ready", ())] == 1


def test_histogram_buckets_are_cumulative_per_device():
    """Latency observations land in cumulative buckets with the right sum and count per device."""
    metrics = Metrics()
    for seconds in (0.0003, 0.004, 0.004, 3.0, 60.0):
        metrics.device_request_seconds.observe(seconds, device="0")
    metrics.device_request_seconds.observe(0.02, device="1")
    seen = samples(metrics.render())
    name = "cakemp_device_request_duration_seconds"

    def bucket(device, le):
        return seen[(f"{name}_bucket", (("device", device), ("le", le)))]

    assert bucket("0", "0.0005") == 1
    assert bucket("0", "0.005") == 3
    assert bucket("0", "2.5") == 3
    assert bucket("0", "5") == 4
    assert bucket("0", "+Inf") == 5
    assert seen[(f"{name}_count", (("device", "0"),))] == 5
    assert seen[(f"{name}_sum", (("device", "0"),))] == pytest.approx(63.0083)
    assert bucket("1", "0.01") == 0
    assert bucket("1", "0.025") == 1
    assert seen[(f"{name}_count", (("device", "1"),))] == 1


def test_label_values_are_escaped():
    """Quotes, backslashes and newlines in a label value survive the round trip through the parser."""
    counter = Counter("odd_total", "Odd labels.", ["error"])
    counter.inc(error='say "hi"\\\nbye')
    [family] = text_string_to_metric_families("\n".join(counter.render()) + "\n")
    assert family.samples[0].labels == {"error": 'say "hi"\\\nbye'}


def test_wrong_labels_and_negative_counts_are_refused():
    """Recording with the wrong label names, or decreasing a counter, raises ValueError."""
    metrics = Metrics()
    with pytest.raises(ValueError, match="device"):
        metrics.kv_bytes.set(1, gpu="0")
    with pytest.raises(ValueError, match="cannot go down"):
        metrics.requests.inc(-1)
    with pytest.raises(ValueError):
        Histogram("h", "h.", ["device"]).observe(1.0)


async def http(port: int, request: bytes) -> tuple[int, str]:
    """Sends raw bytes to the server and returns (status code, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body.decode()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


def serve(scenario, placement=None):
    """Runs `scenario(metrics, port)` against a metrics server on an ephemeral port."""

    async def main():
        metrics = Metrics()
        server = await start_metrics_server(metrics, "127.0.0.1", 0, placement)
        try:
            await scenario(metrics, server.sockets[0].getsockname()[1])
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_endpoint_serves_metrics_that_move_between_scrapes():
    """/metrics over HTTP parses, and a counter recorded between two scrapes has moved."""

    async def scenario(metrics, port):
        status, body = await http(port, get("/metrics"))
        assert status == 200
        before = samples(body)
        metrics.requests.inc(3)
        _, body = await http(port, get("/metrics"))
        after = samples(body)
        assert (before["cakemp_requests_total", ()], after["cakemp_requests_total", ()]) == (0, 3)

    serve(scenario)


def test_readyz_follows_readiness_and_healthz_is_always_ok():
    """/readyz is 503 until set_ready(True), then 200, and 503 again after set_ready(False); /healthz stays 200."""

    async def scenario(metrics, port):
        assert (await http(port, get("/readyz")))[0] == 503
        assert (await http(port, get("/healthz")))[0] == 200
        metrics.set_ready(True)
        assert (await http(port, get("/readyz")))[0] == 200
        metrics.set_ready(False)
        assert (await http(port, get("/readyz")))[0] == 503
        assert (await http(port, get("/healthz")))[0] == 200

    serve(scenario)


def test_bad_requests_get_errors_and_the_server_keeps_serving():
    """Garbage, oversized heads, unknown paths, other methods and early hang-ups leave the server answering."""

    async def scenario(metrics, port):
        assert (await http(port, b"\x00\xff garbage\r\n\r\n"))[0] == 400
        assert (await http(port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n"))[0] == 400
        assert (await http(port, b"GET /metrics SPDY/3\r\n\r\n"))[0] == 400
        assert (await http(port, get("/nope")))[0] == 404
        assert (await http(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /met")
        writer.close()
        assert (await http(port, get("/metrics?x=1")))[0] == 200

    serve(scenario)


def test_layers_shows_the_placement_it_was_given_as_json():
    """/layers answers the placement document as JSON, read at each request; without one it is 404."""
    placement = {"name": "w", "devices": [{"device": "cpu:0", "layers": ["model.layers.0-1"], "count": 2}]}

    async def scenario(metrics, port):
        status, body = await http(port, get("/layers"))
        assert (status, json.loads(body)) == (200, placement)

    serve(scenario, lambda: placement)

    async def without(metrics, port):
        assert (await http(port, get("/layers")))[0] == 404

    serve(without)


# A live node: two CPU devices over the checkpoint's 4 layers, a KV budget, a short stats interval.
LAYERS = [0, 1, 2, 3]
HIDDEN = TINY["hidden_size"]
BUDGET_MIB = 64


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    topology = write_topology(tmp_path_factory.mktemp("topo") / "topology.yml", ["model.layers.0-3"])
    running = RunningNode(checkpoint, topology, "--gpus", "cpu:2", "--dtype", "f32", "--metrics-address",
                          "127.0.0.1:0", "--kv-budget-mib", str(BUDGET_MIB), "--stats-interval", "0.2")
    yield running
    assert running.stop() == 0


def frame_bytes(message) -> int:
    return sum(memoryview(piece).nbytes for piece in encode_frame(message, Revision.V2))


def test_a_known_load_moves_every_series_by_its_exact_amount(node):
    """A prefill of 5 tokens and 3 decode steps through 4 layers on 2 devices move the request,
    token, layer-op, byte, latency, connection, session, waiting and KV series by exactly what
    they served; KV budget, device memory and build info describe the node."""
    port = node.metrics_port()

    async def main():
        master = await CakeMaster.connect(node.port, LAYERS)
        hello = await asyncio.to_thread(scrape, port)  # connections are open, nothing sent yet
        sent = received = 0
        for position, length in ((0, 5), (5, 1), (6, 1), (7, 1)):
            x = torch.randn(1, length, HIDDEN)
            raw = to_raw(x)
            ops = tuple(LayerOp(f"model.layers.{i}", position, i) for i in LAYERS)
            sent += frame_bytes(Batch(raw, ops))
            reply = await master.clients[0].batch(raw, [(op.layer, op.index_pos, op.block_idx) for op in ops])
            received += frame_bytes(TensorMessage(reply))
        during = await asyncio.to_thread(scrape, port)
        await master.close()
        return hello, during, sent, received

    before = scrape(port)
    hello, during, sent, received = asyncio.run(asyncio.wait_for(main(), 60))

    def moved(name, labels=(), since=hello):
        return during.get((name, labels), 0) - since.get((name, labels), 0)

    assert moved("cakemp_requests_total") == 4
    assert moved("cakemp_tokens_total", (("kind", "prefill"),)) == 5
    assert moved("cakemp_tokens_total", (("kind", "decode"),)) == 3
    assert moved("cakemp_layer_ops_total") == 16
    assert moved("cakemp_request_duration_seconds_count", (("kind", "prefill"),)) == 1
    assert moved("cakemp_request_duration_seconds_count", (("kind", "decode"),)) == 3
    assert moved("cakemp_received_bytes_total") == sent
    assert moved("cakemp_sent_bytes_total") == received
    assert moved("cakemp_connections", since=before) == len(LAYERS)
    # Per device, f32: 2 layers x (K and V) x kv heads x one block (its 8 positions) x head dim x 4 bytes.
    kv_bytes = 2 * 2 * TINY["num_key_value_heads"] * BLOCK * (HIDDEN // TINY["num_attention_heads"]) * 4
    for device in ("cpu:0", "cpu:1"):
        labels = (("device", device),)
        assert moved("cakemp_sessions", labels, since=before) == 1  # only the run's first connection sends
        assert moved("cakemp_device_request_duration_seconds_count", labels) == 4
        assert during["cakemp_device_requests_waiting", labels] == 0
        assert during["cakemp_kv_cache_bytes", labels] == kv_bytes
        assert during["cakemp_kv_cache_budget_bytes", labels] == BUDGET_MIB << 20
        assert during["cakemp_device_memory_bytes", labels] > 0
    assert during["cakemp_build_info", (("python", platform.python_version()),
                                        ("version", cakemp.__version__))] == 1

    # Closing the connections gives back the connections, sessions and KV bytes, to the byte.
    def settled(seen):
        return (seen["cakemp_connections", ()] == before["cakemp_connections", ()]
                and all(seen["cakemp_sessions", (("device", d),)] == before.get(("cakemp_sessions", (("device", d),)), 0)
                        and seen["cakemp_kv_cache_bytes", (("device", d),)] == 0 for d in ("cpu:0", "cpu:1")))

    deadline = time.monotonic() + 30
    while not settled(scrape(port)):
        assert time.monotonic() < deadline, "the closed connections are still counted"
        time.sleep(0.05)


def test_stats_lines_add_up_to_the_requests_served(node):
    """The periodic stats lines, summed, count exactly the requests /metrics counts, each line with its rates."""
    port = node.metrics_port()

    async def main():
        master = await CakeMaster.connect(node.port, [0])
        for position in range(3):
            await master.forward(torch.randn(1, 1, HIDDEN), position)
        await master.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    served = scrape(port)["cakemp_requests_total", ()]
    node.wait_for(lambda e: e.get("event") == "stats" and logged_requests(node) >= served)
    assert logged_requests(node) == served
    line = [e for e in node.events() if e.get("event") == "stats"][-1]
    assert line["requests"] > 0 and line["requests_per_s"] > 0 and line["ops_per_s"] > 0 and line["seconds"] > 0
    assert {"tokens_per_s", "read_bytes_per_s", "write_bytes_per_s"} <= set(line)


def logged_requests(node) -> int:
    return sum(e["requests"] for e in node.events() if e.get("event") == "stats")


def test_layers_and_the_start_log_name_each_devices_layers(node):
    """/layers beside /metrics and the start log both say which layers each device serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port()}/layers", timeout=10) as response:
        placement = json.loads(response.read())
    expected = [("cpu:0", ["model.layers.0-1"], 2), ("cpu:1", ["model.layers.2-3"], 2)]
    assert placement["name"] == "worker"
    assert [(d["device"], d["layers"], d["count"]) for d in placement["devices"]] == expected
    logged = [(e["device_label"], e["layers"], e["count"]) for e in node.events() if e.get("event") == "device layers"]
    assert logged == expected


def test_probe_shows_the_placement_beside_the_worker_info(node):
    """`cakemp probe --metrics-address … --json` adds the /layers document to the WorkerInfo; without
    --json each device's layers follow the status line."""
    metrics = f"127.0.0.1:{node.metrics_port()}"
    as_json = CliRunner().invoke(cli, ["probe", f"127.0.0.1:{node.port}", "--metrics-address", metrics, "--json"])
    assert as_json.exit_code == 0, as_json.output
    answer = json.loads(as_json.stdout)
    assert answer["device"] == "cpu" and answer["placement"]["name"] == "worker"
    assert [d["layers"] for d in answer["placement"]["devices"]] == [["model.layers.0-1"], ["model.layers.2-3"]]
    text = CliRunner().invoke(cli, ["probe", f"127.0.0.1:{node.port}", "--metrics-address", metrics])
    assert text.exit_code == 0, text.output
    assert text.stdout.splitlines()[1:] == ["  cpu:0 serves model.layers.0-1", "  cpu:1 serves model.layers.2-3"]
    wrong = CliRunner().invoke(cli, ["probe", f"127.0.0.1:{node.port}", "--metrics-address", f"127.0.0.1:{node.port}"])
    assert wrong.exit_code == 3, wrong.output  # the Cake port speaks no HTTP
