import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cakemp.front.metrics import Counter, Histogram, Metrics, start_metrics_server
from tests.front.node import samples


def test_fresh_registry_parses_and_declares_every_family():
    """An untouched registry parses and names each metric with its type."""
    families = {family.name: family.type for family in text_string_to_metric_families(Metrics().render())}
    assert families == {
        "cakemp_requests": "counter",
        "cakemp_request_errors": "counter",
        "cakemp_received_bytes": "counter",
        "cakemp_sent_bytes": "counter",
        "cakemp_device_restarts": "counter",
        "cakemp_active_sessions": "gauge",
        "cakemp_refused_connections": "counter",
        "cakemp_buffered_bytes": "gauge",
        "cakemp_kv_cache_bytes": "gauge",
        "cakemp_ready": "gauge",
        "cakemp_device_request_duration_seconds": "histogram",
    }


def test_recorded_values_appear_in_the_exposition():
    """Counters, gauges and labels recorded on the registry are what the parser reads back."""
    metrics = Metrics()
    metrics.requests.inc()
    metrics.requests.inc()
    metrics.errors.inc(error="UnknownLayer")
    metrics.bytes_received.inc(1024)
    metrics.bytes_sent.inc(512)
    metrics.device_restarts.inc(device="1")
    metrics.active_sessions.inc()
    metrics.active_sessions.inc()
    metrics.active_sessions.dec()
    metrics.kv_bytes.set(4096, device="0")
    metrics.set_ready(True)
    seen = samples(metrics.render())
    assert seen[("cakemp_requests_total", ())] == 2
    assert seen[("cakemp_request_errors_total", (("error", "UnknownLayer"),))] == 1
    assert seen[("cakemp_received_bytes_total", ())] == 1024
    assert seen[("cakemp_sent_bytes_total", ())] == 512
    assert seen[("cakemp_device_restarts_total", (("device", "1"),))] == 1
    assert seen[("cakemp_active_sessions", ())] == 1
    assert seen[("cakemp_kv_cache_bytes", (("device", "0"),))] == 4096
    assert seen[("cakemp_ready", ())] == 1


def test_histogram_buckets_are_cumulative_per_device():
    """Latency observations land in cumulative buckets with the right sum and count per device."""
    metrics = Metrics()
    for seconds in (0.0003, 0.004, 0.004, 3.0, 60.0):
        metrics.request_seconds.observe(seconds, device="0")
    metrics.request_seconds.observe(0.02, device="1")
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


def serve(scenario):
    """Runs `scenario(metrics, port)` against a metrics server on an ephemeral port."""

    async def main():
        metrics = Metrics()
        server = await start_metrics_server(metrics, "127.0.0.1", 0)
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
