"""The Grafana dashboard against the metrics the node and `cakemp serve` declare: every query parses as PromQL and names only
metrics (and their labels) that the node exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cakemp.front.metrics import Metrics
from cakemp.master.serve_metrics import ServeMetrics
from cakemp.master.step_loop import StepTimes
from cakemp.prometheus import Histogram

promql = pytest.importorskip("promql_parser")

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "cakemp.json"
# What Grafana puts in for its own variables before Prometheus sees a query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h"}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus when it scrapes


def exported() -> dict[str, set[str]]:
    """Every sample name the node's /metrics, or `cakemp serve`'s, can hold -> its label names, from the
    declarations."""
    metrics = Metrics()
    names = {}
    for metric in [*vars(metrics).values(), *vars(ServeMetrics(lambda: 0, lambda: 0, StepTimes())).values()]:
        if not hasattr(metric, "labelnames"):
            continue
        labels = set(metric.labelnames) | TARGET_LABELS
        names[metric.name] = labels
        if isinstance(metric, Histogram):
            names |= {f"{metric.name}_bucket": labels | {"le"}, f"{metric.name}_sum": labels,
                      f"{metric.name}_count": labels}
    # The process_* family is declared apart from the attributes: read its names off the exposition.
    for line in metrics.render().splitlines():
        if line.startswith("# TYPE process_"):
            names[line.split()[2]] = set(TARGET_LABELS)
    return names


def queries(dashboard: dict) -> list[str]:
    """Every PromQL query of the dashboard: each panel's targets, and the variables' label_values() selectors."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [target["expr"] for target in inner.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(re.fullmatch(r"label_values\((.+), \w+\)", variable["query"]["query"]).group(1))
    return found


def selectors(query: str) -> list:
    """The vector selectors of `query` (after Grafana's variables are put in), as promql_parser reads them."""
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    found = []
    promql.walk(promql.parse(query),
                lambda node: found.append(node) if isinstance(node, promql.VectorSelector) else None)
    return found


def test_every_query_names_only_metrics_and_labels_the_node_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    all_queries = queries(dashboard)
    assert len(all_queries) > 20
    unknown = []
    for query in all_queries:
        found = selectors(query)
        assert found, f"{query} names no metric"
        for selector in found:
            labels = {matcher.name for matcher in selector.matchers.matchers}
            if selector.name not in names or not labels <= names[selector.name]:
                unknown.append(f"{selector.name} {sorted(labels)} in {query}")
    assert unknown == []


def test_the_dashboard_covers_what_an_operator_watches():
    """Latency by phase, tokens/s, KV use against budget, waiting requests, step sizes, restarts, per device."""
    text = DASHBOARD.read_text()
    for metric in ("cakemp_request_duration_seconds_bucket", "cakemp_tokens_total", "cakemp_kv_cache_bytes",
                   "cakemp_kv_cache_budget_bytes", "cakemp_device_requests_waiting", "cakemp_device_batch_size",
                   "cakemp_device_step_tokens", "cakemp_device_restarts_total", "cakemp_prefix_reused_tokens_total",
                   "cakemp_serve_requests_running", "cakemp_serve_time_to_first_token_seconds_bucket",
                   "cakemp_serve_token_latency_seconds_bucket", "cakemp_serve_completion_tokens_total"):
        assert metric in text, metric
    dashboard = json.loads(text)
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance", "device"}
