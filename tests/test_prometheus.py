"""prometheus: labels must be exactly a metric's; an observation lands in the first bucket whose bound holds it."""

import pytest

from cakemp.prometheus import Counter, Gauge, Histogram


def test_labels_must_be_exactly_the_metrics_own():
    gauge = Gauge("cakemp_x", "x", ("device",))
    gauge.inc(device="cpu:0")
    for wrong in ({}, {"gpu": "0"}, {"device": "cpu:0", "gpu": "0"}):
        with pytest.raises(ValueError, match="takes labels"):
            gauge.inc(**wrong)
    with pytest.raises(ValueError, match="takes labels"):
        Counter("cakemp_y_total", "y").inc(device="cpu:0")
    assert gauge.value(device="cpu:0") == 1


def test_an_observation_on_a_bound_counts_in_that_bucket_and_nan_only_in_the_last():
    histogram = Histogram("cakemp_z", "z", buckets=(1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 3.0, float("nan")):
        histogram.observe(value)
    assert [line.rsplit(" ", 1)[1] for line in histogram.render() if "_bucket" in line] == ["2", "4", "6"]


def test_a_series_bound_once_moves_the_same_value_as_its_labels_do_and_a_counter_never_goes_down():
    gauge, counter = Gauge("cakemp_g", "g", ("device",)), Counter("cakemp_c_total", "c", ("device",))
    waiting, done = gauge.labels(device="cpu:0"), counter.labels(device="cpu:0")
    waiting.inc()
    gauge.inc(2, device="cpu:0")
    waiting.dec()
    done.inc(3)
    assert gauge.value(device="cpu:0") == 2 and counter.value(device="cpu:0") == 3
    assert gauge.value(device="cpu:1") == 0  # another label set is another series
    with pytest.raises(ValueError, match="cannot go down"):
        done.dec()
    with pytest.raises(ValueError, match="takes labels"):
        gauge.labels(gpu="0")
