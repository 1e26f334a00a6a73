"""The director over a real endpoint store: KV admission, degradation, and no leaks."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.datalayer.endpoints import EndpointStore, ScrapeResult
from extproc.datalayer.metrics import EngineMetrics
from extproc.director import Admission, Director
from extproc.openai import BadRequest, parse_body
from extproc.wiring import build_director
from limiter import Reject
from limiter.stores import MemoryStore

KEY = "sk-director"


def config(degradation=None, limits=None, big_model="big-model"):
    return parse_config({
        "queue": {"enabled": False},  # these tests are about what is decided at once
        "tiers": {"t": {"limits": limits or {}}},
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 1}},
        "tenants": [{"name": "acme", "tier": "t", "default_class": "batch",
                     "api_keys": [hash_api_key(KEY)]}],
        "pools": [
            {"name": "big", "models": [big_model], "endpoints": ["127.0.0.1:1"],
             **({"degradation": degradation} if degradation else {})},
            {"name": "small", "models": ["small-model"], "endpoints": ["127.0.0.1:2"]},
        ],
    })


async def director_with_usage(cfg, big: float, small: float = 0.0) -> Director:
    endpoints = EndpointStore()
    await endpoints.set_endpoints("big", ["127.0.0.1:1"])
    await endpoints.set_endpoints("small", ["127.0.0.1:2"])
    now = time.monotonic()
    await endpoints.apply([
        ScrapeResult(addr, now, EngineMetrics(kv_cache_usage=usage, kv_capacity_tokens=1000))
        for addr, usage in (("127.0.0.1:1", big), ("127.0.0.1:2", small))
    ])
    return build_director(cfg, MemoryStore(), endpoints)


def request(model="big-model", max_tokens=300):
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * 40}]}
    if max_tokens is None:
        del body["max_tokens"]
    return parse_body("/v1/chat/completions", orjson.dumps(body))


async def test_saturated_pool_sheds_without_degradation():
    director = await director_with_usage(config(), big=0.7)
    tenant = director.authenticate(f"Bearer {KEY}")
    outcome = await director.admit(tenant, request())
    assert isinstance(outcome, Reject) and outcome.reason == "pool_saturated"
    assert not director.schedulers["big"].reservations  # nothing held


async def test_degradation_caps_max_tokens_for_low_priority_classes():
    cfg = config({"classes": ["batch"], "max_tokens_cap": 100})
    director = await director_with_usage(cfg, big=0.7)
    tenant = director.authenticate(f"Bearer {KEY}")
    outcome = await director.admit(tenant, request())
    assert isinstance(outcome, Admission)
    assert outcome.body_overrides == {"max_tokens": 100}
    assert outcome.cost.max_output_tokens == 100


async def test_degradation_caps_each_of_n_answers_and_reserves_them_all():
    """``max_tokens`` is per answer: capped to 50 with ``n: 3`` the engine makes 150
    tokens, but the capped reservation held 50 (and the charge was held to it), so a
    degraded n > 1 request was under-reserved and under-charged by (n - 1) × the cap."""
    cfg = config({"classes": ["batch"], "max_tokens_cap": 50})
    director = await director_with_usage(cfg, big=0.7)
    tenant = director.authenticate(f"Bearer {KEY}")
    body = {"model": "big-model", "max_tokens": 300, "n": 3,
            "messages": [{"role": "user", "content": "x" * 40}]}
    outcome = await director.admit(tenant, parse_body("/v1/chat/completions",
                                                      orjson.dumps(body)))
    assert isinstance(outcome, Admission), outcome
    assert outcome.body_overrides == {"max_tokens": 50}
    assert outcome.cost.max_output_tokens == 3 * 50


async def test_degradation_falls_back_to_a_cheaper_model():
    cfg = config({"classes": ["batch"], "fallback_model": "small-model"})
    director = await director_with_usage(cfg, big=0.9, small=0.1)
    tenant = director.authenticate(f"Bearer {KEY}")
    outcome = await director.admit(tenant, request())
    assert isinstance(outcome, Admission)
    assert outcome.body_overrides == {"model": "small-model"}
    assert (outcome.pool, outcome.endpoint) == ("small", "127.0.0.1:2")


async def test_a_request_without_an_output_cap_runs_to_what_was_reserved():
    """Not to the engine's default (the rest of the model's context): the engine is told the
    model's default_max_tokens, which is what kvgate reserved and priced."""
    model = {"name": "big-model", "default_max_tokens": 200}
    director = await director_with_usage(config(big_model=model), big=0.1)
    tenant = director.authenticate(f"Bearer {KEY}")
    outcome = await director.admit(tenant, request(max_tokens=None))
    assert isinstance(outcome, Admission)
    assert outcome.body_overrides == {"max_tokens": 200}  # the model's default
    assert outcome.cost.max_output_tokens == 200
    capped = await director.admit(tenant, request(max_tokens=50))
    assert capped.body_overrides == {}
    for admitted in (outcome, capped):
        await director.release(admitted, None)
    body = {"model": "big-model", "min_tokens": 250, "messages": [{"content": "x"}]}
    floored = await director.admit(tenant, parse_body("/v1/chat/completions",
                                                      orjson.dumps(body)))
    assert isinstance(floored, Admission), floored
    assert floored.body_overrides == {"max_tokens": 250}  # vLLM refuses a cap below it
    assert floored.cost.max_output_tokens == 250
    await director.release(floored, None)
    # the completions API's own default is 16: kvgate reserves and sends that, not 200
    completion = await director.admit(tenant, parse_body("/v1/completions", orjson.dumps(
        {"model": "big-model", "prompt": "x", "max_tokens": None})))
    assert isinstance(completion, Admission), completion
    assert completion.body_overrides == {"max_tokens": 16}
    assert completion.cost.max_output_tokens == 16


async def test_degradation_caps_a_request_without_an_output_cap_to_its_own_cap():
    cfg = config({"classes": ["batch"], "max_tokens_cap": 100},
                 big_model={"name": "big-model", "default_max_tokens": 300})
    director = await director_with_usage(cfg, big=0.7)
    outcome = await director.admit(director.authenticate(f"Bearer {KEY}"),
                                   request(max_tokens=None))
    assert outcome.body_overrides == {"max_tokens": 100}


async def test_classes_not_listed_are_not_degraded():
    cfg = config({"classes": ["interactive"], "max_tokens_cap": 100})
    director = await director_with_usage(cfg, big=0.7)
    outcome = await director.admit(director.authenticate(f"Bearer {KEY}"), request())
    assert isinstance(outcome, Reject)


async def test_a_limiter_rejection_undoes_the_kv_reservation():
    director = await director_with_usage(config(limits={"tokens_per_minute": 100}), big=0.1)
    outcome = await director.admit(director.authenticate(f"Bearer {KEY}"), request())
    assert isinstance(outcome, Reject)
    assert not director.schedulers["big"].reservations
    assert not director.active


@pytest.mark.parametrize(("limits", "reason", "status"), [
    ({"max_context_tokens": 8}, "context_length_exceeded", 400),
    ({"tokens_per_minute": 500}, "tokens_exceed_capacity", 429),  # a budget of 500 tokens
])
async def test_the_tenants_own_limit_is_named_before_the_kv_cache(limits, reason, status):
    # a prompt over the tenant's max_context_tokens was a 400 kv_exceeds_capacity as soon as
    # it was also larger than every endpoint's KV (1000 tokens here), context_length_exceeded
    # only when it was not
    director = await director_with_usage(config(limits=limits), big=0.1)
    tenant = director.authenticate(f"Bearer {KEY}")
    outcome = await director.admit(tenant, request(max_tokens=2000))
    assert isinstance(outcome, Reject)
    assert (outcome.reason, outcome.status) == (reason, status)
    assert outcome.remaining is not None and not outcome.retryable
    assert not director.schedulers["big"].reservations and not director.active
    assert await director.store.in_flight("acme") == 0
    # within the tenant's limits, the KV cache still refuses what no endpoint can hold
    director = await director_with_usage(config(), big=0.1)
    outcome = await director.admit(director.authenticate(f"Bearer {KEY}"),
                                   request(max_tokens=2000))
    assert isinstance(outcome, Reject) and outcome.reason == "kv_exceeds_capacity"


async def test_release_frees_everything_exactly_once():
    director = await director_with_usage(config(), big=0.1)
    admission = await director.admit(director.authenticate(f"Bearer {KEY}"), request())
    assert isinstance(admission, Admission)
    await director.release(admission, 50)
    assert not director.schedulers["big"].reservations
    assert not director.active
    assert await director.store.in_flight("acme") == 0


@pytest.mark.parametrize("model", ["nope", "other"])
async def test_unknown_model_is_404(model):
    director = await director_with_usage(config(), big=0.1)
    with pytest.raises(BadRequest) as info:
        await director.admit(director.authenticate(f"Bearer {KEY}"), request(model=model))
    assert info.value.status == 404


async def test_a_request_too_costly_for_its_tenants_weight_does_not_wedge_the_queue():
    """price · 1000 / weight past the fair counters' range raised in the dispatcher on every
    try: nobody in the pool was placed until that request's deadline (503 for all)."""
    cfg = parse_config({
        "tiers": {"tiny": {"weight": 0.0001}, "normal": {}},
        "classes": {"interactive": {"priority": 0, "deadline_s": 5}, "batch": {"priority": 1}},
        "tenants": [{"name": "small", "tier": "tiny", "api_keys": [hash_api_key("k1")]},
                    {"name": "big", "tier": "normal", "api_keys": [hash_api_key("k2")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:1"],
                   "max_unstarted": None}],
    })
    endpoints = EndpointStore()
    await endpoints.set_endpoints("p", ["127.0.0.1:1"])

    async def scrape(usage):
        await endpoints.apply([ScrapeResult("127.0.0.1:1", time.monotonic(), EngineMetrics(
            kv_cache_usage=usage, kv_capacity_tokens=10_000_000, num_requests_running=0,
            num_requests_waiting=0))])

    await scrape(0.99)  # saturated: both queue
    director = build_director(cfg, MemoryStore(), endpoints)
    director.flows["p"].start()
    body = parse_body("/v1/chat/completions", orjson.dumps(
        {"model": "m", "max_tokens": 60_000, "messages": [{"content": "x"}]}))
    tasks = [asyncio.create_task(director.admit(director.authenticate(f"Bearer {key}"), body))
             for key in ("k1", "k2")]
    await asyncio.sleep(0.2)
    await scrape(0.0)
    director.kick("p")
    try:
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    finally:
        await director.flows["p"].stop()
    assert all(isinstance(o, Admission) for o in outcomes), outcomes
    for outcome in outcomes:
        await director.release(outcome, None)
    scheduler = director.schedulers["p"]
    assert not scheduler.reservations and not any(scheduler.committed.values())
