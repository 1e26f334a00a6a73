"""The overhead benchmark's machinery (``bench.overhead``): its parsers and bootstrap edits,
then a one-second run through real Envoy for three modes. Sanity, not performance."""

from __future__ import annotations

import pytest

from bench import overhead
from extproc.config import parse_config
from extproc.envoy_config import (
    EXT_PROC_CLUSTER,
    UPSTREAM_CLUSTER,
    ext_proc_filter_config,
    render_bootstrap,
)

METRICS = """\
# HELP kvgate_extproc_messages_total ext_proc messages received, by kind.
# TYPE kvgate_extproc_messages_total counter
kvgate_extproc_messages_total{kind="request_headers"} 12.0
kvgate_extproc_messages_created{kind="request_headers"} 1.7e+09
kvgate_extproc_messages_total{kind="response_body"} 24.0
kvgate_decisions_total{outcome="admitted",tenant="bench"} 12.0
kvgate_in_flight_requests{tenant="bench"} 0.0
"""


def test_parse_counters_keeps_counters_and_names_message_kinds():
    assert overhead.parse_counters(METRICS) == {
        "messages:request_headers": 12.0,
        "messages:response_body": 24.0,
        'kvgate_decisions_total{outcome="admitted",tenant="bench"}': 12.0,
    }


def _rendered():
    """kvgate's bootstrap with the headers phase, which the floor's is made from."""
    config = overhead.kvgate_config("127.0.0.1:8101", 9001, 9002, attributes=False)
    return render_bootstrap(parse_config(config))


def _clusters(bootstrap):
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def test_floor_bootstrap_only_swaps_the_upstream_cluster():
    rendered = _rendered()
    floor = overhead.static_upstream(rendered, "127.0.0.1", 8101)
    upstream = _clusters(floor)[UPSTREAM_CLUSTER]
    assert upstream["type"] == "STATIC"
    endpoint = upstream["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8101}
    assert ext_proc_filter_config(floor) == ext_proc_filter_config(rendered)
    assert floor["static_resources"]["listeners"] == rendered["static_resources"]["listeners"]
    assert _clusters(floor)[EXT_PROC_CLUSTER] == _clusters(rendered)[EXT_PROC_CLUSTER]


def test_direct_bootstrap_has_no_ext_proc_and_the_floor_no_meter():
    floor = overhead.without_meter(overhead.static_upstream(_rendered(), "127.0.0.1", 8101))
    assert [f["name"] for f in overhead._http_filters(floor)] == [
        "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    direct = overhead.without_ext_proc(floor)
    filters = [f["name"] for f in overhead._http_filters(direct)]
    assert filters == ["envoy.filters.http.router"]
    # the pools' clusters stay, unused: without kvgate's metadata the catch-all route goes
    # to the upstream cluster
    assert {c for c in _clusters(direct) if not c.startswith("kvgate_pool_")} == {
        UPSTREAM_CLUSTER}


def test_hot_spots_cut_the_entry_point_and_split_loop_time():
    entry = "main (extproc/cli.py:20);run (asyncio/runners.py:118)"
    raw = "\n".join([
        f"{entry};Process (extproc/server.py:52);handle (extproc/stream.py:60) 3",
        f"{entry};Process (extproc/server.py:52) 1",
        f"{entry} 4",
        "_bootstrap (threading.py:995);run (threading.py:982) 2",
    ])
    found = overhead.hot_spots(raw, us_per_sample=10.0)
    assert found["inclusive"][:2] == [["Process (extproc/server.py)", 40.0],
                                      ["handle (extproc/stream.py)", 30.0]]
    own = dict(found["self"])
    assert own["handle (extproc/stream.py:60)"] == 30.0
    assert own["(in the event loop, no Python frame: uvloop, gRPC core, kernel)"] == 40.0
    assert sum(own.values()) == 80.0  # other threads' samples left out: their CPU is measured
    assert overhead._loop_samples(raw) == 8


@pytest.fixture(scope="module")
def rows():
    return overhead.run(["direct", "minimal", "kvgate"], [16], warmup_s=0.3, duration_s=1.0,
                        rounds=2, layout="none", streams=[32], log=lambda _line: None)


@pytest.mark.e2e
def test_every_mode_serves_requests_without_errors(rows):
    pace = rows[3]["paced_rps"]
    assert pace == round(overhead.EQUAL_RATE_SHARE * min(r["rps"] for r in rows[1:3]))
    assert [overhead.label(r) for r in rows] == [
        "direct", "minimal", "kvgate", *(f"{mode} @{pace:.0f}" for mode in
                                         ("direct", "minimal", "kvgate")),
        "direct s32", "minimal s32", "kvgate s32"]
    for row in rows:
        assert row["windows"] == 2
        assert row["requests"] > 0 and row["rps"] > 0, row
        assert row["errors"] == 0, row["statuses"]
        assert 0 < row["p50_ms"] <= row["p99_ms"]


@pytest.mark.e2e
def test_every_process_is_charged_cpu(rows):
    for row in rows:
        cpu = row["cpu_us_per_request"]
        expected = {"envoy", "engine", "loadgen"} | ({"ext_proc"} if row["mode"] != "direct"
                                                    else set())
        assert set(cpu) == expected
        assert all(us >= 0 for us in cpu.values())
        assert cpu["envoy"] > 0 and cpu["loadgen"] > 0


@pytest.mark.e2e
def test_message_counts_per_request(rows):
    """The floor meters over ext_proc: request headers, body, then every response chunk and
    Envoy's empty end-of-stream chunk. kvgate gets one message whatever the response (the
    body, with the headers it reads as attributes), and the Lua meter's reports: one at a
    response's end, and one for a stream's first chunk."""
    by_mode = {overhead.label(r): r for r in rows}
    assert by_mode["direct"]["messages_per_request"] == 0
    # messages are counted as requests start, requests as they end: over windows of half a
    # second, a stream's start and end can fall in different ones (~20 streams per window,
    # 41 starts against 37 ends seen once)
    within = {"minimal": 0.1, "kvgate": 0.1, "minimal s32": 0.2, "kvgate s32": 0.2}
    for mode in ("minimal", "minimal s32"):
        assert by_mode[mode]["messages_by_kind"]["request_headers"] == pytest.approx(
            1, abs=within[mode])
    for mode, tolerance in within.items():
        kinds = by_mode[mode]["messages_by_kind"]
        assert kinds["request_body"] == pytest.approx(1, abs=tolerance)
    assert by_mode["minimal"]["messages_by_kind"]["response_body"] == pytest.approx(2, abs=0.2)
    assert by_mode["minimal s32"]["messages_by_kind"]["response_body"] > 10
    for mode, reports in (("kvgate", {"done": 1}), ("kvgate s32", {"first": 1, "done": 1})):
        assert set(by_mode[mode]["messages_by_kind"]) == {"request_body"}
        # likewise: a stream's first report can fall in the window before its end's
        assert by_mode[mode]["reports_by_kind"] == pytest.approx(reports, abs=0.2)


@pytest.mark.e2e
def test_ratios_and_report(rows):
    result = overhead.ratios(rows)
    assert result["cpu_ratio_by_level"]["16"]["ext_proc"] > 0
    equal = result["cpu_ratio_equal_rate"]
    assert equal["value"] > 0 and equal["paced_rps"] == rows[3]["paced_rps"]
    # paced below every gateway's closed-loop rate: each serves about that rate
    assert equal["rps"]["kvgate"] == pytest.approx(equal["paced_rps"], rel=0.35)
    assert "p50_delta_ms" not in result  # no c=1 row in this run
    text = overhead.markdown({"rows": rows, "ratios": result, "command": "test", "when": "now",
                              "machine": overhead.machine_info("none"), "warmup_s": 0.3,
                              "duration_s": 1.0})
    assert "| kvgate | 16 |" in text and "| kvgate s32 | 16 |" in text
    assert "at an equal request rate" in text
    assert "32" in result["streams"]
    # the TTFT ratio also round by round (the rounds are the noise a reader judges it by)
    rounds = result["streams"]["32"]["ttft_vs_floor"]["by_round"]
    assert len(rounds) == 2 and all(r > 0 for r in rounds)
    assert "round by round" in text
