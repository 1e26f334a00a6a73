"""KV-aware routing end to end: real Envoy, kvgate scraping three simulated engines whose
reported KV usage the tests set through the engines' ``/debug/metrics`` hook."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import engines_one_by_one, free_port

pytestmark = pytest.mark.e2e

KEY = "sk-kv"
BLOCKS, BLOCK_SIZE = 64, 16  # 1024 tokens of KV per engine


def kv_config(scrape: dict):
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "scrape": scrape,
        # saturated requests queue for at most 1 s here, then get their 503
        "classes": {"interactive": {"priority": 0, "deadline_s": 1},
                    "batch": {"priority": 1, "deadline_s": 1}},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "kv", "models": [{"name": "tiny-llama", "default_max_tokens": 16}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(3)],
                   "priority_scheduling": True}],
    })


def start(scrape: dict):
    return local_stack(kv_config(scrape), engine_options={
        "ms_per_token": 5, "kv_blocks": BLOCKS, "block_size": BLOCK_SIZE})


@pytest.fixture(scope="module")
def stack():
    with start({"interval_s": 0.05}) as running:
        yield running


def engines(stack):
    return list(stack.engines.values())


def set_usage(stack, *usages):
    """Make each engine report this KV usage, and wait until kvgate has scraped it."""
    for engine, usage in zip(engines(stack), usages, strict=True):
        engine.set_metrics(kv_cache_usage_perc=usage)
    wanted = {e.url.removeprefix("http://"): u for e, u in zip(engines(stack), usages,
                                                               strict=True)}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        seen = {s.address: s.kv_cache_usage for s in stack.kvgate.server.endpoints.snapshot()
                .endpoints("kv")}
        if all(seen.get(a) == pytest.approx(u) for a, u in wanted.items()):
            return
        time.sleep(0.02)
    raise AssertionError(f"kvgate never saw {wanted}")


def ask(stack, max_tokens=4, stream=False):
    return httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": "tiny-llama", "max_tokens": max_tokens, "stream": stream,
              "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {KEY}"}, timeout=30,
    )


def served_by(stack, n, **kwargs):
    return engines_one_by_one(stack, lambda: ask(stack, **kwargs), n)


def test_new_requests_go_to_the_least_loaded_engine(stack):
    e1, e2, _e3 = (e.url.removeprefix("http://") for e in engines(stack))
    set_usage(stack, 0.5, 0.1, 0.3)
    assert served_by(stack, 5) == [e2] * 5
    set_usage(stack, 0.2, 0.6, 0.4)
    assert served_by(stack, 5) == [e1] * 5


def test_saturated_and_stale_engines_get_none(stack):
    _e1, e2, e3 = engines(stack)
    set_usage(stack, 0.97, 0.2, 0.3)  # e1 above the critical watermark
    e2.stop()  # e2's scrapes fail: unhealthy, then stale
    try:
        deadline = time.monotonic() + 5
        while stack.kvgate.server.endpoints.snapshot().get("kv", e2.url[7:]).healthy:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert set(served_by(stack, 6)) == {e3.url.removeprefix("http://")}
    finally:
        e2.start()
    set_usage(stack, 0.1, 0.1, 0.1)


def held_by(stack, reason: str) -> float:
    """kvgate_pool_holds_total for the pool and ``reason``, from kvgate's /metrics."""
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
    text = httpx.get(f"{admin}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "kvgate_pool_holds_total"
               and s.labels == {"pool": "kv", "reason": reason})


def test_all_saturated_is_503_with_retry_after(stack):
    set_usage(stack, 0.96, 0.99, 0.97)
    before = held_by(stack, "engine_full")
    response = ask(stack)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "pool_saturated"
    assert int(response.headers["retry-after"]) >= 1
    assert int(response.headers["retry-after-ms"]) >= 1000
    # while it queued, every placement found each of the three engines past critical
    assert held_by(stack, "engine_full") >= before + 3
    set_usage(stack, 0.1, 0.1, 0.1)


def test_request_larger_than_any_kv_cache_is_400(stack):
    response = ask(stack, max_tokens=BLOCKS * BLOCK_SIZE + 1)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "kv_exceeds_capacity"
    assert response.headers["x-should-retry"] == "false"


def test_reservations_spread_a_burst_before_the_next_scrape():
    # scrapes 2 s apart: the burst lands between two of them
    with start({"interval_s": 2.0, "staleness_s": 30}) as slow:
        addresses = [e.url.removeprefix("http://") for e in engines(slow)]
        set_usage(slow, 0.1, 0.1, 0.1)  # returns right after a scrape: ~2 s until the next
        # each request reserves ~200 tokens (20% of an engine): 6 of them must spread 2-2-2
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: ask(slow, max_tokens=190, stream=True),
                                      range(6)))
    assert all(r.status_code == 200 for r in responses)
    served = [r.headers["x-bench-engine"] for r in responses]
    assert sorted(served.count(a) for a in addresses) == [2, 2, 2], served
