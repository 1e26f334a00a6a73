"""deploy/monitoring/alerts.yaml: every rule's expression parses as PromQL and selects only
series kvgate exports (read from the registry ``extproc/metrics.py`` builds, as the
dashboard's test does) or Prometheus's own ``up``; every alert says how bad it is and what
it means."""

from __future__ import annotations

from typing import Any

import promql_parser
import pytest
import yaml

from tests.deploy.manifests import DEPLOY, named, render
from tests.deploy.test_dashboard import exported, metric_names

ALERTS = DEPLOY / "monitoring" / "alerts.yaml"
PROMETHEUS_OWN = {"up"}
SEVERITIES = {"warning", "critical"}


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
