"""deploy/monitoring/alerts.yaml: every rule's expression parses as PromQL and selects only
series kvgate exports (read from the registry ``extproc/metrics.py`` builds, as the
dashboard's test does) or Prometheus's own ``up``; every alert says how bad it is and what
it means; an alert on a counter's increase() fires on its first event."""

from __future__ import annotations

import re
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.datalayer.endpoints import EndpointState
from extproc.metrics import Metrics
from limiter import QUEUEABLE, Reason, refuse
from tests.deploy.manifests import DEPLOY, named, render
from tests.deploy.test_dashboard import exported, metric_names

ALERTS = DEPLOY / "monitoring" / "alerts.yaml"
PROMETHEUS_OWN = {"up"}
SEVERITIES = {"warning", "critical"}
INCREASE = re.compile(r"increase\((\w+)\{([^}]*)\}\[")
MATCHER = re.compile(r'(\w+)="([^"]*)"')


def rules() -> list[dict[str, Any]]:
    rule = yaml.safe_load(ALERTS.read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_the_rules_ship_with_the_monitoring_kustomization() -> None:
    assert "kvgate" in named(render(DEPLOY / "monitoring"), "PrometheusRule")


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_each_alert_parses_and_selects_only_exported_series(rule: dict[str, Any]) -> None:
    promql_parser.parse(rule["expr"])  # ValueError naming the problem
    unknown = metric_names(rule["expr"]) - exported() - PROMETHEUS_OWN
    assert not unknown, f"{rule['alert']} selects {sorted(unknown)}, which kvgate does not export"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_each_alert_says_how_bad_and_what_it_means(rule: dict[str, Any]) -> None:
    assert rule["alert"].startswith("Kvgate")
    assert rule["labels"]["severity"] in SEVERITIES
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_names_are_unique() -> None:
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))


def at_start(name: str, labels: dict[str, str]) -> bool:
    """A fresh kvgate's /metrics has a series ``name`` with these labels (at 0)."""
    text = generate_latest(Metrics().registry).decode()
    return any(sample.name == name and labels.items() <= sample.labels.items()
               for family in text_string_to_metric_families(text) for sample in family.samples)


@pytest.mark.parametrize("rule", [r for r in rules() if INCREASE.search(r["expr"])],
                         ids=lambda r: r["alert"])
def test_alerts_on_increase_see_the_first_event(rule: dict[str, Any]) -> None:
    """A counter's series born at 1 by the first event has no earlier sample: increase()
    over it reads 0, and an alert on that event never fires. Each series an alert takes
    increase() of is exported at 0 from kvgate's start, or the expression also catches a
    series new in its window (``X unless X offset W``)."""
    expr = " ".join(rule["expr"].split())
    for name, matchers in INCREASE.findall(expr):
        selector = f"{name}{{{matchers}}}"
        born_late = f"{selector} unless {selector} offset" in expr
        assert born_late or at_start(name, dict(MATCHER.findall(matchers))), (
            f"{rule['alert']}: increase({selector}) misses the first event: export the series "
            f"at 0, or add `or sum by (...) ({selector} unless {selector} offset W) > 0`")


def alert(name: str) -> dict[str, Any]:
    (found,) = [r for r in rules() if r["alert"] == name]
    return found


def test_shedding_names_every_reason_kvgate_sheds_for() -> None:
    """decision="shed" is every 503 refusal (extproc/stream.py) and Redis unreachable under
    fail_closed (store_unavailable): the description says which, so none is looked for in
    the wrong place."""
    shed = {r.value for r in Reason if refuse(r, "", None).status == 503}
    description = alert("KvgateShedding")["annotations"]["description"]
    also = {"store_unavailable", "gateway_overloaded"}  # (the latter: extproc/duplex.py)
    assert all(reason in description for reason in shed | also), description


def test_missed_deadlines_name_every_answer_a_queued_request_gets() -> None:
    """A queued request (QUEUEABLE: saturated, or over its share) expires with the refusal
    it queued for: 429 kv_share_exceeded or 503 pool_saturated (extproc/flow.py)."""
    description = alert("KvgateQueueDeadlinesMissed")["annotations"]["description"]
    for reason in QUEUEABLE:
        status = refuse(reason, "", None).status
        assert f"{status} {reason.value}" in description, (reason, description)


def test_stale_scrapes_alert_on_an_endpoint_never_scraped() -> None:
    """An endpoint kvgate has never scraped (down since kvgate started, a wrong address)
    exports kvgate_endpoint_healthy 0 and no kvgate_endpoint_scrape_age_seconds at all
    (extproc/metrics.py's EndpointCollector): an alert on the age alone never fires for it,
    and no other alert does while the pool has another healthy endpoint."""
    metrics = Metrics()
    metrics.watch_endpoints(lambda: [EndpointState("10.0.0.9:8000", "p")], {})
    text = generate_latest(metrics.registry).decode()
    exported_now = {s.name for f in text_string_to_metric_families(text) for s in f.samples
                    if s.labels.get("endpoint") == "10.0.0.9:8000"}
    assert "kvgate_endpoint_scrape_age_seconds" not in exported_now
    assert "kvgate_endpoint_healthy" in exported_now
    expr = " ".join(alert("KvgateEndpointScrapesStale")["expr"].split())
    assert "kvgate_endpoint_healthy) == 0" in expr, expr
