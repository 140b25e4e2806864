"""The periodic stats line: rates over the time between two readings of the metrics, none while idle."""

from cakemp.front.metrics import Metrics
from cakemp.front.stats import StatsLine


def test_a_line_gives_the_rates_since_the_previous_one():
    """Two decode requests over 4 layers, 10 s apart readings: the line's rates are the counters' differences over 10 s."""
    metrics = Metrics()
    line = StatsLine(metrics, now=100.0)
    for _ in range(2):
        metrics.requests.inc()
        metrics.served(tokens=1, first_position=5, layer_ops=4, seconds=0.01)
        metrics.bytes_received.inc(3000)
        metrics.bytes_sent.inc(1000)
    assert line.take(now=110.0) == {
        "seconds": 10.0,
        "requests": 2,
        "requests_per_s": 0.2,
        "ops_per_s": 0.8,
        "tokens_per_s": 0.2,
        "read_bytes_per_s": 600.0,
        "write_bytes_per_s": 200.0,
    }


def test_no_line_while_idle_and_the_next_line_starts_where_the_last_ended():
    """An interval without requests gives no line (bytes alone, such as a Hello, do not count); the next
    line covers only what came after the previous reading."""
    metrics = Metrics()
    line = StatsLine(metrics, now=0.0)
    metrics.requests.inc(5)
    assert line.take(now=60.0)["requests"] == 5
    metrics.bytes_received.inc(100)
    assert line.take(now=120.0) is None
    metrics.requests.inc()
    later = line.take(now=150.0)
    assert (later["seconds"], later["requests"], later["requests_per_s"]) == (30.0, 1, 0.033)
