"""Two engines side by side through the real Envoy: a vLLM pool and an SGLang pool (simulated
engines speaking each one's /metrics names). Both route and admit; kvgate reads each pool's
KV usage through its own engine's names; each gets the priority its engine schedules by."""

from __future__ import annotations

import time

import httpx
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import engines_one_by_one, free_port

pytestmark = pytest.mark.e2e

KEY = "sk-engines"
MODELS = {"vllm-pool": "tiny-llama", "sglang-pool": "tiny-sglang"}


@pytest.fixture(scope="module")
def stack():
    config = parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "scrape": {"interval_s": 0.05},
        "classes": {"interactive": {"priority": 0, "deadline_s": 1},
                    "batch": {"priority": 1, "deadline_s": 1}},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(KEY)],
                     "max_class": "interactive"}],
        "pools": [{"name": pool, "engine": pool.split("-")[0], "priority_scheduling": True,
                   "models": [{"name": model, "default_max_tokens": 16}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
                  for pool, model in MODELS.items()],
    })
    with local_stack(config, engine_options={"ms_per_token": 2, "kv_blocks": 64,
                                             "block_size": 16}) as running:
        yield running


def pool_engines(stack, pool: str) -> dict:
    config = stack.kvgate.server.config
    [endpoints] = [p.endpoints for p in config.pools if p.name == pool]
    return {address: stack.engines[address] for address in endpoints}


def set_usage(stack, pool: str, *usages: float) -> None:
    """Make the pool's engines report these KV usages; wait until kvgate has read them."""
    engines = pool_engines(stack, pool)
    for engine, usage in zip(engines.values(), usages, strict=True):
        engine.set_metrics(kv_cache_usage_perc=usage)
    wanted = dict(zip(engines, usages, strict=True))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        snapshot = stack.kvgate.server.endpoints.snapshot()
        seen = {s.address: s.kv_cache_usage for s in snapshot.endpoints(pool)}
        if all(seen.get(a) == pytest.approx(u) for a, u in wanted.items()):
            return
        time.sleep(0.02)
    raise AssertionError(f"kvgate never saw {wanted} in pool {pool}: {seen}")


def ask(stack, pool: str, request_class: str = "interactive") -> httpx.Response:
    return httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": MODELS[pool], "max_tokens": 4, "priority": -100,
              "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {KEY}", "x-request-class": request_class},
        timeout=30,
    )


def test_both_pools_are_read_through_their_own_engine_names(stack) -> None:
    set_usage(stack, "vllm-pool", 0.3, 0.2)
    set_usage(stack, "sglang-pool", 0.1, 0.4)
    snapshot = stack.kvgate.server.endpoints.snapshot()
    sources = {pool: {s.metrics.kv_usage_source for s in snapshot.endpoints(pool)}
               for pool in MODELS}
    assert sources == {"vllm-pool": {"vllm:kv_cache_usage_perc"},
                       "sglang-pool": {"sglang:token_usage"}}
    assert all(s.kv_capacity_tokens == 64 * 16 for s in snapshot.states())


def served_by(stack, pool: str, n: int) -> set[str | None]:
    return set(engines_one_by_one(stack, lambda: ask(stack, pool), n))


@pytest.mark.parametrize("pool", list(MODELS))
def test_each_pool_routes_to_its_least_loaded_engine(stack, pool: str) -> None:
    first, second = pool_engines(stack, pool)
    set_usage(stack, pool, 0.5, 0.1)
    assert served_by(stack, pool, 4) == {second}
    set_usage(stack, pool, 0.1, 0.5)
    assert served_by(stack, pool, 4) == {first}


@pytest.mark.parametrize(("pool", "sent"), [("vllm-pool", 1), ("sglang-pool", -1)])
def test_each_engine_gets_the_priority_it_schedules_by(stack, pool: str, sent: int) -> None:
    set_usage(stack, pool, 0.1, 0.1)
    for engine in pool_engines(stack, pool).values():
        engine.clear_requests()
    response = ask(stack, pool, request_class="batch")
    assert response.status_code == 200
    received = stack.engines[response.headers["x-bench-engine"]].requests()[-1]
    assert received["body"]["priority"] == sent  # batch, in the engine's order; not -100
    # vLLM salts its prefix cache per tenant; SGLang's request has no such field
    assert ("cache_salt" in received["body"]) == (pool == "vllm-pool")


def test_a_saturated_sglang_pool_sheds_while_the_vllm_pool_serves(stack) -> None:
    set_usage(stack, "vllm-pool", 0.1, 0.1)
    set_usage(stack, "sglang-pool", 0.97, 0.99)  # above the critical watermark (0.95)
    try:
        shed = ask(stack, "sglang-pool")
        assert shed.status_code == 503
        assert shed.json()["error"]["code"] == "pool_saturated"
        assert int(shed.headers["retry-after-ms"]) >= 1000
        assert ask(stack, "vllm-pool").status_code == 200
    finally:
        set_usage(stack, "sglang-pool", 0.1, 0.1)
