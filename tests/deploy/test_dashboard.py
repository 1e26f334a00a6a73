"""deploy/monitoring/kvgate-dashboard.json queries only metrics kvgate exports.

The exported names are read at test time from the registry ``extproc/metrics.py`` builds, so
a renamed or removed metric fails here, naming the dashboard query that still uses it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.metrics import Metrics
from tests.deploy.manifests import DEPLOY

DASHBOARD = DEPLOY / "monitoring" / "kvgate-dashboard.json"
# The series each metric type is exposed as (Prometheus text format, prometheus_client).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'")
_BRACES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,")


def exported() -> set[str]:
    """Every series name kvgate's /metrics can show."""
    metrics = Metrics()
    metrics.watch_endpoints(list, {})  # the endpoint and pool families, as a running
    metrics.watch_pools(dict)  # server has them
    return {family.name + suffix for family in metrics.registry.collect()
            for suffix in SUFFIXES[family.type]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names and
    Grafana's $variables left out)."""
    expr = _GROUPING.sub(" ", _BRACES.sub(" ", _STRING.sub('""', expr)))
    return {m.group() for m in _WORD.finditer(expr)
            if not expr[m.end():].lstrip().startswith("(") and m.group() not in PROMQL_WORDS}


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, set[str]]]:
    """(where, metric names) for every panel target and every templating query."""
    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, set[str]]]:
        for panel in panels:
            for target in panel.get("targets", []):
                yield f"panel {panel['title']!r}: {target['expr']}", metric_names(target["expr"])
            yield from walk(panel.get("panels", []))
    yield from walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        yield f"variable {variable['name']!r}: {text}", set(_LABEL_VALUES.findall(text))


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_queried_metric_is_one_kvgate_exports(dashboard: dict[str, Any]) -> None:
    known = exported()
    unknown = [f"{where} → {sorted(names - known)}" for where, names in queries(dashboard)
               if names - known]
    assert not unknown, "the dashboard queries metrics kvgate does not export:\n" + "\n".join(
        unknown)


def test_every_panel_queries_something(dashboard: dict[str, Any]) -> None:
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert all(metric_names(t["expr"]) for t in panel["targets"]), panel["title"]
    queried = set().union(*(names for _, names in queries(dashboard)))
    # admissions and rejections, queue wait, KV usage per endpoint, tokens per tenant
    assert len({name.removesuffix("_bucket") for name in queried}) >= 4


def test_tokens_per_tenant_shows_reserved_and_used(dashboard: dict[str, Any]) -> None:
    """deploy/README.md and the panel's description say the dashboard shows tokens reserved
    and used per tenant: both series are queried."""
    (panel,) = [p for p in dashboard["panels"] if p["title"] == "Tokens/min per tenant"]
    queried = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
    assert {"kvgate_tokens_reserved_total", "kvgate_tokens_used_total"} <= queried


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (tenant) (rate(kvgate_x_total{outcome="a b", t=~"$t"}[$__rate_interval])) * 60',
     {"kvgate_x_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(a_bucket[5m]))) / on (pool) b",
     {"a_bucket", "b"}),
    ("max without (endpoint) (up) > bool 1e3", {"up"}),
])
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
