"""The real-time policy benchmark's set-ups and targets (bench.policy_real), without running
it: (d) must be kvgate as shipped, FIFO must be an Envoy that starts, the targets issue 13's."""

from __future__ import annotations

from typing import Any

from bench import policy_real
from extproc.config import BUILT_IN_CLASSES, Classification, QueueSettings, ScrapeSettings

ENDPOINTS = ["127.0.0.1:18001", "127.0.0.1:18002"]


def test_kvgate_setup_sets_no_scheduling_knob() -> None:
    config = policy_real.kvgate_config("kvgate", ENDPOINTS)
    assert config.queue == QueueSettings()
    assert config.scrape == ScrapeSettings()
    assert config.classification == Classification()
    assert {name: (c.priority, c.deadline_s) for name, c in config.classes.items()} == {
        name: (BUILT_IN_CLASSES[name]["priority"], BUILT_IN_CLASSES[name]["deadline_s"])
        for name in ("interactive", "batch")}
    pool = config.pools[0]  # what the engines are: their model, addresses, scheduling policy
    assert pool == type(pool)(name=pool.name, models=pool.models, endpoints=pool.endpoints,
                              priority_scheduling=True)


def _routes_and_clusters(bootstrap: dict[str, Any]) -> tuple[list[dict], set[str], list[str]]:
    resources = bootstrap["static_resources"]
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return routes, {c["name"] for c in resources["clusters"]}, [
        f["name"] for f in hcm["http_filters"]]


def test_fifo_bootstrap_is_envoy_without_kvgate() -> None:
    config = policy_real.kvgate_config("kvgate", ENDPOINTS)
    routes, clusters, filters = _routes_and_clusters(
        policy_real.fifo_bootstrap(config, ENDPOINTS))
    assert filters == ["envoy.filters.http.router"]
    assert len(routes) == 1 and "dynamic_metadata" not in routes[0]["match"]
    assert {r["route"]["cluster"] for r in routes} == clusters  # every route's cluster exists


def _row(p99: float, timeouts: float, batch: float, p50: float = 0.1) -> dict[str, Any]:
    return {"interactive_ttft_p50_s": p50, "interactive_ttft_p99_s": p99,
            "interactive_sla_s": 2.0, "interactive_timeout_rate": timeouts,
            "batch_tokens_per_s": batch, "max_share_error": 0.3,
            "max_share_error_demand_aware": 0.0}


def test_targets_are_issue_13s() -> None:
    fifo = _row(1.0, 0.2, 100.0)
    passing = policy_real.targets({"fifo": fifo, "kvgate": _row(0.3, 0.01, 90.0)})
    assert set(passing) == {"interactive_p99_ratio", "interactive_timeout_rate",
                            "batch_throughput_ratio"}  # shares are no target here
    assert all(check["pass"] for check in passing.values())
    missing = policy_real.targets({"fifo": fifo, "kvgate": _row(0.31, 0.011, 89.0)})
    assert not any(check["pass"] for check in missing.values())


def test_where_fifo_is_not_contended_the_p99_bound_is_no_harm() -> None:
    """FIFO's P99 twice its P50 and within the SLA: 0.3x of it would be below an idle
    engine's first token, so the virtual-time benchmark's no-harm bound applies."""
    calm = _row(0.14, 0.0, 44.8, p50=0.07)
    ok = policy_real.targets({"fifo": calm, "kvgate": _row(0.10, 0.0, 44.8, p50=0.07)})
    assert ok["interactive_p99_ratio"]["pass"]
    assert "not contended" in ok["interactive_p99_ratio"]["target"]
    harm = policy_real.targets({"fifo": calm, "kvgate": _row(0.16, 0.0, 44.8, p50=0.07)})
    assert not harm["interactive_p99_ratio"]["pass"]
    late = _row(2.5, 0.05, 100.0, p50=1.0)  # past the SLA: contended, however flat
    assert policy_real.targets({"fifo": late, "kvgate": _row(0.8, 0.0, 95.0)})[
        "interactive_p99_ratio"]["target"] == "<= 0.3"


def _record(klass: str, sent: float, ttft: float, e2e: float, tokens: int) -> dict[str, Any]:
    return {"klass": klass, "outcome": "ok", "sent_at": sent, "ttft_s": ttft, "e2e_s": e2e,
            "completion_tokens": tokens, "offered_tokens": 100}


def test_explain_says_what_held_work_back() -> None:
    endpoint = {"kv_usage": 0.75, "kv_capacity": 1000, "committed": 970}
    trace = [{"t": 1.0, "pools": {"p": {"endpoints": [endpoint], "queued": [(1, 300)]}}},
             {"t": 2.0, "pools": {"p": {"endpoints": [endpoint], "queued": [(1, 40)]}}}]
    kvgate = {"label": "kvgate", "elapsed_s": 12.0, "trace": trace, "records": [
        _record("batch", 0.0, 1.0, 11.0, 100), _record("interactive", 1.0, 0.5, 1.0, 10)]}
    fifo = {"label": "fifo", "elapsed_s": 10.0, "records": [
        _record("batch", 0.0, 0.0, 10.0, 100)]}
    assert policy_real.tokens_by(kvgate, "batch", 6.0) == 50  # half its decode by then
    text = policy_real.explain({"duration_s": 6.0, "runs": [fifo, kvgate]})
    assert "50 vs FIFO's 60 (0.833)" in text
    # 300 tokens: over the high watermark and the committed bound; 40: the bound only
    assert "held by both 1, committed 1" in text
    assert "interactive at 1.0 s, first token 0.50 s" in text
