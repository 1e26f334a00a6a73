"""The load generator: its arrival process, its openai-python-like retries, its summaries,
and one short real run through Envoy + kvgate + simulated engines."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench.loadgen import (
    REFERENCE_SCENARIO,
    Arrival,
    Record,
    build_schedule,
    jain_index,
    kvgate_tenants,
    load_scenario,
    poisson_times,
    retry_delay,
    run_load,
    send_request,
    weighted_max_min,
)
from extproc.config import parse_config
from extproc.demo import local_stack
from tests.conftest import free_port


def test_poisson_schedule_has_the_right_mean_rate_and_is_seeded():
    times = poisson_times(50, 200, random.Random(7))
    assert abs(len(times) / 200 - 50) < 50 * 0.03
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert abs(statistics.mean(gaps) - 1 / 50) < 0.03 / 50
    assert abs(statistics.stdev(gaps) - 1 / 50) < 0.05 / 50  # exponential: sd == mean
    scenario = load_scenario("reference")
    first, again = (build_schedule(scenario, 20, 60, seed=3) for _ in range(2))
    assert first == again
    assert first != build_schedule(scenario, 20, 60, seed=4)
    interactive = sum(a.klass == "interactive" for a in first) / len(first)
    assert abs(interactive - 0.7) < 0.05


def test_retry_delay_honours_hints_only_within_sixty_seconds():
    rng = random.Random(1)
    assert retry_delay({"retry-after-ms": "250", "retry-after": "9"}, 0, rng) == 0.25
    assert retry_delay({"retry-after": "2"}, 0, rng) == 2.0
    for headers in ({"retry-after": "61"}, {"retry-after-ms": "0"}, {}):
        assert 0.375 <= retry_delay(headers, 0, rng) <= 0.5  # 0.5 s minus ≤ 25% jitter
    assert 6.0 <= retry_delay({}, 10, rng) <= 8.0  # capped at 8 s


def test_fairness_helpers():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    alloc = weighted_max_min({"a": 10, "b": 100, "c": 100}, {"a": 5, "b": 3, "c": 1}, 90)
    assert alloc["a"] == pytest.approx(10)  # asked for less than its share: gets it all
    assert alloc["b"] / alloc["c"] == pytest.approx(3)  # the rest split 3:1
    assert sum(alloc.values()) == pytest.approx(90)


# -- retries against a tiny local server --------------------------------------------------


SSE = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
       b'data: {"choices":[{"index":0,"delta":{"content":"hi "}}]}\n\n'
       b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,'
       b'"total_tokens":4}}\n\ndata: [DONE]\n\n')


async def start_server(answers: list[tuple[int, dict[str, str]]], seen: list[float]
                       ) -> tuple[web.AppRunner, str]:
    """Answers each POST with the next (status, headers) of ``answers``; 200 is an SSE
    stream. Records when every request arrived."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen.append(time.monotonic())
        status, headers = answers[min(len(seen), len(answers)) - 1]
        if status != 200:
            body = orjson.dumps({"error": {"message": "busy", "type": "rate_limit_error"}})
            return web.Response(status=status, body=body, headers=headers)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def one_request(answers: list[tuple[int, dict[str, str]]]) -> tuple[Record, list[float]]:
    seen: list[float] = []
    runner, url = await start_server(answers, seen)
    scenario = load_scenario("reference")
    arrival = Arrival(0.0, "gold", "interactive", 3, 1)
    record = Record("gold", "interactive", 0.0)
    try:
        async with aiohttp.ClientSession() as session:
            await send_request(session, url, scenario, arrival, random.Random(0), record)
    finally:
        await runner.cleanup()
    return record, seen


async def test_waits_retry_after_ms_then_succeeds():
    record, seen = await one_request([(429, {"retry-after-ms": "300", "retry-after": "1"}),
                                      (200, {})])
    assert (record.outcome, record.status, record.statuses) == ("ok", 200, [429, 200])
    assert record.retries == 1
    assert 0.3 <= seen[1] - seen[0] < 0.6  # retry-after-ms wins over retry-after
    assert (record.prompt_tokens, record.completion_tokens) == (3, 1)
    assert record.ttft_s is not None and record.ttft_s >= 0.3


async def test_never_retries_when_told_not_to():
    record, seen = await one_request([(429, {"retry-after-ms": "50", "x-should-retry": "false"}),
                                      (200, {})])
    assert len(seen) == 1
    assert (record.outcome, record.status, record.retries) == ("rejected", 429, 0)


async def test_gives_up_after_two_retries():
    record, seen = await one_request([(503, {"retry-after": "0.05"})])
    assert record.statuses == [503, 503, 503]
    assert (record.outcome, record.retries) == ("rejected", 2)
    assert len(seen) == 3


async def test_400_is_final():
    record, seen = await one_request([(400, {})])
    assert (record.outcome, len(seen)) == ("error", 1)


# -- a short real run through Envoy and kvgate -----------------------------------------------


@pytest.mark.e2e
def test_short_run_through_the_stack_gives_sane_summaries():
    scenario = load_scenario(REFERENCE_SCENARIO)
    config = parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "scrape": {"interval_s": 0.05},
        "classes": {"interactive": {"priority": 0, "deadline_s": 20},
                    "batch": {"priority": 1, "deadline_s": 20}},
        **kvgate_tenants(scenario),
        "pools": [{"name": "tiny", "models": [{"name": "tiny-llama"}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(2)],
                   "priority_scheduling": True}],
    })
    with local_stack(config, engine_options={"ms_per_token": 2}) as stack:
        result = asyncio.run(run_load(stack.url, scenario, duration_s=4, rate=8, seed=2))
    summary = result.summary()
    assert set(summary["classes"]) == {"interactive", "batch"}
    for name, c in summary["classes"].items():
        assert c["requests"] > 0, name
        assert c["ok"] == c["requests"], c  # lightly loaded: everything answered
        assert 0 < c["ttft_p50_s"] <= c["ttft_p99_s"] < 5
        assert c["e2e_p50_s"] >= c["ttft_p50_s"]
        assert c["tokens_per_s"] > 0
    assert 0 < summary["jain"] <= 1
    assert 0 < summary["jain_demand_aware"] <= 1
    assert sum(t["share"] for t in summary["tenants"].values()) == pytest.approx(1)
    assert all(r.completion_tokens > 0 and r.prompt_tokens > 0 for r in result.records)
