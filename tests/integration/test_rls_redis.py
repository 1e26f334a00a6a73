"""kvgate's Rate Limit Service over real Redis and in memory: an imported envoyproxy/ratelimit
config decides exactly as its hand-written kvgate equivalent, the Redis counters decide as the
in-memory ones for every algorithm (cancels included), and a call that times out on a paused
Redis charges nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Iterator

import grpc
import hypothesis
import pytest
import redis.asyncio as aioredis
import yaml
from envoy.service.ratelimit.v3 import rls_pb2
from hypothesis import HealthCheck, event, given
from hypothesis import strategies as st

from bench.redis_server import RedisServer
from extproc.config import RateLimitSettings, RedisSettings
from extproc.rls import OK, OVER_LIMIT, RateLimitService
from extproc.rls_import import import_files
from extproc.wiring import redis_client
from limiter.ratelimit import Algorithm, Hit, Limit
from limiter.stores.ratelimit import MemoryRateCounters, RateCounters, RedisRateCounters
from tests.paths import REPO
from tests.rls_support import InProcess, descriptor

pytestmark = pytest.mark.redis

IMPORTED = REPO / "tests" / "data" / "envoyproxy-ratelimit.yaml"
MINUTE = 60_000


def fixed(n: int, unit: str, **extra: object) -> dict:
    return {"unit": unit, "requests_per_unit": n, "algorithm": "fixed_window", **extra}


HAND_WRITTEN = {"domains": [{"domain": "edge", "descriptors": [
    {"key": "remote_address", "rate_limit": fixed(3, "second")},
    {"key": "remote_address", "value": "10.0.0.1", "rate_limit": fixed(1, "second",
                                                                      name="office")},
    {"key": "path", "value": "/api/*", "rate_limit": fixed(2, "minute")},
    {"key": "user", "descriptors": [
        {"key": "plan", "value": "premium",
         "rate_limit": fixed(5, "minute", replaces=[{"name": "office"}])},
        {"key": "plan", "rate_limit": fixed(2, "minute")},
    ]},
    {"key": "header_match", "value": "internal", "rate_limit": {"unlimited": True}},
    {"key": "canary", "shadow_mode": True, "rate_limit": fixed(1, "minute")},
]}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_040_000 + 100  # 100 ms into a minute

    def __call__(self) -> int:
        return self.now


class Aborted(Exception):
    pass


class Context:
    """What the service uses of a gRPC context: abort."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code)



async def ask(service: RateLimitService, *descriptors, domain: str = "edge"):
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors)
    return await service.ShouldRateLimit(request, Context())  # type: ignore[arg-type]


def summary(response) -> tuple:
    return (response.overall_code, tuple(
        (s.code, s.current_limit.requests_per_unit, s.limit_remaining,
         s.duration_until_reset.ToMilliseconds()) for s in response.statuses))


# (ms to advance first, descriptors) — each a request as Envoy would send it
SEQUENCE = [
    (0, [[("remote_address", "10.0.0.9")]]),
    (0, [[("remote_address", "10.0.0.9")]]),
    (0, [[("remote_address", "10.0.0.9")]]),
    (0, [[("remote_address", "10.0.0.9")]]),  # 4th in a second: over
    (0, [[("remote_address", "10.0.0.1")]]),
    (0, [[("remote_address", "10.0.0.1")]]),  # office: 1/s
    (0, [[("remote_address", "10.0.0.1")], [("user", "u1"), ("plan", "premium")]]),  # replaced
    (0, [[("path", "/api/chat")]]),
    (0, [[("path", "/api/models")]]),  # the same pattern, but its own counter
    (0, [[("path", "/api/chat")]]),
    (0, [[("path", "/api/chat")]]),  # over
    (0, [[("path", "/other")]]),  # no rule
    (0, [[("user", "u2"), ("plan", "basic")]]),
    (0, [[("user", "u2"), ("plan", "basic")]]),
    (0, [[("user", "u2"), ("plan", "basic")]]),  # over
    (0, [[("user", "u2")]]),  # no limit at that level
    (0, [[("header_match", "internal")]] * 2),
    (0, [[("canary", "x")]]),
    (0, [[("canary", "x")]]),  # shadow: over, answered OK
    (1000, [[("remote_address", "10.0.0.9")], [("remote_address", "10.0.0.1")]]),
    (MINUTE, [[("path", "/api/chat")], [("user", "u2"), ("plan", "basic")]]),
]
EXPECTED = [OK, OK, OK, OVER_LIMIT, OK, OVER_LIMIT, OK, OK, OK, OK, OVER_LIMIT, OK, OK, OK,
            OVER_LIMIT, OK, OK, OK, OK, OK, OK]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


_prefixes = itertools.count()


def counters(kind: str, server: RedisServer, clock: Clock) -> RateCounters:
    if kind == "memory":
        return MemoryRateCounters(clock)
    return RedisRateCounters(aioredis.from_url(server.url), prefix=f"t{next(_prefixes)}",
                             clock=clock)


async def replay(service: RateLimitService, clock: Clock) -> list[tuple]:
    out = []
    for advance, descriptors in SEQUENCE:
        clock.now += advance
        out.append(summary(await ask(service, *(descriptor(*d) for d in descriptors))))
    return out


def test_the_import_is_the_hand_written_config():
    text, notes = import_files([IMPORTED])
    assert RateLimitSettings.model_validate(yaml.safe_load(text)["ratelimit"]) == (
        RateLimitSettings.model_validate(HAND_WRITTEN))
    assert notes == [f"{IMPORTED}: descriptors[5].detailed_metric: dropped (metrics or "
                     "response metadata only)"]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_imported_config_decides_as_its_hand_written_equivalent(kind, redis):
    imported = RateLimitSettings.model_validate(
        yaml.safe_load(import_files([IMPORTED])[0])["ratelimit"])
    results = []
    for settings in (imported, RateLimitSettings.model_validate(HAND_WRITTEN)):
        clock = Clock()
        service = RateLimitService(settings, counters(kind, redis, clock), timeout_s=1)
        results.append(await replay(service, clock))
        await service.close()
    assert results[0] == results[1]
    assert [codes[0] for codes in results[0]] == EXPECTED


ALGORITHMS = {"domains": [{"domain": "d", "descriptors": [
    {"key": "tb", "rate_limit": {"unit": "second", "requests_per_unit": 2, "burst": 3}},
    {"key": "sw", "rate_limit": {"unit": "second", "requests_per_unit": 2,
                                 "algorithm": "sliding_window"}},
    {"key": "fw", "rate_limit": {"unit": "second", "requests_per_unit": 2,
                                 "algorithm": "fixed_window"}},
    {"key": "debt", "rate_limit": {"unit": "second", "requests_per_unit": 10, "debt": True}},
    {"key": "fwdebt", "rate_limit": {"unit": "second", "requests_per_unit": 10, "debt": True,
                                     "algorithm": "fixed_window"}},
]}]}


@pytest.mark.parametrize("shared", ["redis", "cluster"])
async def test_redis_counters_decide_as_memory_does(shared, request):
    settings = RateLimitSettings.model_validate(ALGORITHMS)
    runs = []
    for kind in ("memory", shared):
        clock = Clock()
        if kind == "cluster":  # a domain's keys share one hash tag: one shard per call
            client = redis_client(RedisSettings(
                url=request.getfixturevalue("redis_cluster").url, cluster=True, timeout_ms=1000))
            store: RateCounters = RedisRateCounters(client, clock=clock)
        else:
            store = counters(kind, request.getfixturevalue("redis"), clock)
        service = RateLimitService(settings, store, timeout_s=1)
        answers = []
        for step in range(40):
            clock.now += (step * 137) % 400
            key = ("tb", "sw", "fw", "debt", "fwdebt")[step % 5]
            hits = (step * 7) % 15 if key.endswith("debt") else (step % 3)
            answers.append(summary(await ask(service, descriptor((key, "v"), hits=hits),
                                             domain="d")))
        runs.append(answers)
        await service.close()
    assert runs[0] == runs[1]
    assert {a[0] for a in runs[0]} == {OK, OVER_LIMIT}


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_call_refused_by_a_zero_limit_charges_nothing_else(kind, redis):
    """A ``requests_per_unit: 0`` limit refuses without asking the store; the store was
    asked for the call's other descriptors as if it passed, and charged them."""
    settings = RateLimitSettings.model_validate({"domains": [{"domain": "d", "descriptors": [
        *ALGORITHMS["domains"][0]["descriptors"],
        {"key": "zero", "rate_limit": {"unit": "second", "requests_per_unit": 0}}]}]})
    clock = Clock()
    service = RateLimitService(settings, counters(kind, redis, clock), timeout_s=1)
    for _ in range(3):
        response = await ask(service, descriptor(("zero", "v")), descriptor(("tb", "v")),
                             descriptor(("sw", "v")), descriptor(("fw", "v")),
                             descriptor(("debt", "v"), hits=3), domain="d")
        assert response.overall_code == OVER_LIMIT
        assert [s.code for s in response.statuses] == [OVER_LIMIT, OK, OK, OK, OK]
    left = await ask(service, *(descriptor((key, "v"), hits=0) for key in ("tb", "sw", "fw",
                                                                            "debt")), domain="d")
    # nothing spent but the debt rule, which is always charged
    assert [s.limit_remaining for s in left.statuses] == [3, 2, 2, 10 - 3 * 3]
    await service.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("debt", ["debt", "fwdebt"])
async def test_a_client_refused_with_a_debt_charge_is_admitted_at_its_retry_after(
        kind, debt, redis):
    """A refused call charges its debt rules all the same; its wait was taken before that
    charge, so a client that came back when told found its own call's debt, and was
    refused again at every retry."""
    settings = RateLimitSettings.model_validate(ALGORITHMS)
    clock = Clock()
    service = RateLimitService(settings, counters(kind, redis, clock), timeout_s=1)
    call = (descriptor(("fw", "v"), hits=2), descriptor((debt, "v"), hits=10))
    assert (await ask(service, *call, domain="d")).overall_code == OK
    for _ in range(3):
        refused = await ask(service, *call, domain="d")
        assert refused.overall_code == OVER_LIMIT
        told = {h.key: h.value for h in refused.response_headers_to_add}
        clock.now += int(told["retry-after-ms"])
        assert (await ask(service, *call, domain="d")).overall_code == OK
    # a debt rule that fits, charged by a call another rule refuses: the retry-after is
    # the longer of the two (tb: 500 ms, the debt's 10 tokens back: 1 s)
    clock.now += 10_000
    await ask(service, descriptor(("tb", "w"), hits=3), domain="d")
    call = (descriptor(("tb", "w")), descriptor((debt, "w"), hits=10))
    refused = await ask(service, *call, domain="d")
    assert [s.code for s in refused.statuses] == [OVER_LIMIT, OK]
    clock.now += int({h.key: h.value for h in refused.response_headers_to_add}[
        "retry-after-ms"])
    assert (await ask(service, *call, domain="d")).overall_code == OK
    await service.close()


@pytest.mark.parametrize("hits", [2**32, 2**53 + 1, 2**64 - 1])
async def test_absurd_hits_are_answered_alike_in_redis_and_memory(hits, redis):
    """A descriptor's hits_addend is a uint64: past the request's uint32 range it is capped,
    so Redis's Lua numbers stay exact and every answer (a debt's reset too) is valid."""
    settings = RateLimitSettings.model_validate(ALGORITHMS)
    runs = []
    for kind in ("memory", "redis"):
        clock = Clock()
        service = RateLimitService(settings, counters(kind, redis, clock), timeout_s=1)
        answers = []
        for key in ("tb", "sw", "fw", "debt", "fwdebt", "debt"):
            answers.append(summary(await ask(service, descriptor((key, "v"), hits=hits),
                                             descriptor((key, "w"), hits=1), domain="d")))
            clock.now += 250
        runs.append(answers)
        await service.close()
    assert runs[0] == runs[1]


async def test_a_huge_debt_on_a_slow_rate_is_answered_alike_in_redis_and_memory(redis):
    """7 an hour charged 2^32-1 hits: Redis saturates the debt at -2^51 scaled units, and
    memory went on (a retry-after of ~70,000 years against Redis's ~10,000)."""
    settings = RateLimitSettings.model_validate({"domains": [{"domain": "d", "descriptors": [
        {"key": "slow", "rate_limit": {"unit": "hour", "requests_per_unit": 7, "debt": True}},
    ]}]})
    runs = []
    for kind in ("memory", "redis"):
        clock = Clock()
        service = RateLimitService(settings, counters(kind, redis, clock), timeout_s=1)
        answers = []
        for hits in (2**32 - 1, 0, 1):
            response = await ask(service, descriptor(("slow", "v"), hits=hits), domain="d")
            answers.append((summary(response), [(h.key, h.value)
                                                for h in response.response_headers_to_add]))
            clock.now += 1000
        runs.append(answers)
        await service.close()
    assert runs[0] == runs[1]


async def test_a_call_timed_out_on_a_paused_redis_charges_nothing(redis):
    # hour-long windows: no window may roll over while Redis is paused, or "unchanged" is moot
    settings = RateLimitSettings.model_validate(json.loads(json.dumps(ALGORITHMS).replace(
        '"unit": "second"', '"unit": "hour"')))
    client = redis_client(RedisSettings(url=redis.url, timeout_ms=50))
    service = RateLimitService(settings, RedisRateCounters(client, prefix="paused"),
                               timeout_s=0.05)
    calls = [descriptor((key, "p"), hits=2) for key in ("tb", "sw", "fw")]
    assert (await ask(service, *calls, domain="d")).overall_code == OK  # warm connection
    before = [s.limit_remaining for s in (await ask(service, *[
        descriptor((key, "p"), hits=0) for key in ("tb", "sw", "fw")], domain="d")).statuses]
    redis.pause()
    try:
        with pytest.raises(Aborted):
            await ask(service, *[descriptor((key, "p"), hits=1) for key in ("tb", "sw", "fw")],
                      domain="d")
    finally:
        redis.resume()
    await cancels_sent(service)
    after = [s.limit_remaining for s in (await ask(service, *[
        descriptor((key, "p"), hits=0) for key in ("tb", "sw", "fw")], domain="d")).statuses]
    assert after == before  # the late call was undone
    await service.close()


async def test_a_call_timed_out_on_a_long_paused_redis_charges_nothing(redis, monkeypatch):
    """The cancel gave up after 20 tries (~5 s with a 20 ms timeout_ms); the call, queued in
    the paused Redis, ran when it resumed and its charge stayed. The pauses are shortened
    here: the cancel now gives up never, and retries at most every CANCEL_MAX_PAUSE_S."""
    from extproc import rls

    monkeypatch.setattr(rls, "CANCEL_PAUSE_S", 0.01)
    monkeypatch.setattr(rls, "CANCEL_MAX_PAUSE_S", 0.1, raising=False)
    settings = RateLimitSettings.model_validate({"domains": [{"domain": "d", "descriptors": [
        {"key": "tokens", "rate_limit": fixed(10**6, "hour", debt=True)}]}]})
    client = redis_client(RedisSettings(url=redis.url, timeout_ms=50))
    service = RateLimitService(settings, RedisRateCounters(client, prefix="long"),
                               timeout_s=0.05)

    before = await tokens_left(service)  # (a warm connection: the call is written at once)
    redis.pause()
    try:
        with pytest.raises(Aborted):
            await ask(service, descriptor(("tokens", "t"), hits=100), domain="d")
        await asyncio.sleep(2.0)  # 20 tries of 0.05 + 0.01 s: the old cancel gave up
    finally:
        redis.resume()
    await cancels_sent(service)
    assert not service._cancels
    assert await tokens_left(service) == before
    await service.close()


async def tokens_left(service: RateLimitService) -> int:
    """What domain ``d``'s ``tokens``/``t`` counter has left (a call that charges nothing)."""
    check = await ask(service, descriptor(("tokens", "t"), hits=0), domain="d")
    return check.statuses[0].limit_remaining


async def cancels_sent(service: RateLimitService, within_s: float = 4.0) -> None:
    """Wait for the cancels of failed calls, which go out in the background."""
    for _ in range(int(within_s / 0.02)):
        if not service._cancels:
            return
        await asyncio.sleep(0.02)


async def test_an_outage_is_logged_once_and_its_cancels_are_bounded(redis, caplog,
                                                                   monkeypatch):
    """Every call failing on a paused Redis logged a warning of its own (2,000 calls, 2,000
    lines) and kept a cancel task retrying for ~15 s, however many."""
    from extproc import rls

    monkeypatch.setattr(rls, "MAX_PENDING_CANCELS", 5)
    caplog.set_level(logging.INFO, logger="extproc.rls")
    client = redis_client(RedisSettings(url=redis.url, timeout_ms=50))
    service = RateLimitService(RateLimitSettings.model_validate(ALGORITHMS),
                               RedisRateCounters(client, prefix="outage"), timeout_s=0.05)
    assert (await ask(service, descriptor(("tb", "o"), hits=1), domain="d")).overall_code == OK
    redis.pause()
    try:
        for _ in range(12):
            with pytest.raises(Aborted):
                await ask(service, descriptor(("tb", "o"), hits=1), domain="d")
        assert len(service._cancels) == 5
    finally:
        redis.resume()
    assert (await ask(service, descriptor(("tb", "o"), hits=0), domain="d")).overall_code == OK
    failed = [r for r in caplog.records if "ratelimit store failed" in r.getMessage()]
    assert len(failed) == 1
    assert any("ratelimit store answers again" in r.getMessage() for r in caplog.records)
    await service.close()


async def test_a_call_envoy_abandons_on_a_paused_redis_charges_nothing(redis):
    """Envoy's ratelimit timeout (100 ms) is below a redis.timeout_ms above it: Envoy reset
    the call first, gRPC cancelled it, and no cancel was sent. The first such call ran in
    Redis once it resumed and stayed charged; the others never ran; none was counted."""
    settings = RateLimitSettings.model_validate({"domains": [{"domain": "d", "descriptors": [
        {"key": "tokens", "rate_limit": {"unit": "hour", "requests_per_unit": 10**9,
                                         "debt": True, "algorithm": "fixed_window"}}]}]})
    client = redis_client(RedisSettings(url=redis.url, timeout_ms=250))
    service = RateLimitService(settings, RedisRateCounters(client, prefix="abandoned"),
                               timeout_s=0.25)

    before = await tokens_left(service)  # (a warm connection: the first call is written at once)
    redis.pause()
    try:
        calls = [asyncio.create_task(ask(service, descriptor(("tokens", "t"), hits=100),
                                         domain="d")) for _ in range(5)]
        await asyncio.sleep(0.1)  # Envoy's RATELIMIT_TIMEOUT: it resets each call
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(0.3)
    finally:
        redis.resume()
    await cancels_sent(service)
    assert await tokens_left(service) == before
    await service.close()


# -- a refused herd is scheduled: each client its own retry-after-ms (limiter.herd) ----------

def herd_rules(algorithm: str, per_second: int) -> RateLimitSettings:
    return RateLimitSettings.model_validate({"domains": [{"domain": "d", "descriptors": [
        {"key": "user", "rate_limit": {"unit": "second", "requests_per_unit": per_second,
                                       "algorithm": algorithm}},
        {"key": "route", "rate_limit": {"unit": "second", "requests_per_unit": per_second + 1,
                                        "burst": 2 * per_second}},
    ]}]})


def herd_store(kind: str, request: pytest.FixtureRequest, clock: Clock) -> RateCounters:
    if kind == "cluster":  # a domain's keys share one hash tag: one shard per call
        return RedisRateCounters(redis_client(RedisSettings(
            url=request.getfixturevalue("redis_cluster").url, cluster=True, timeout_ms=1000)),
            prefix=f"t{next(_prefixes)}", clock=clock)
    return counters(kind, request.getfixturevalue("redis"), clock)


def retry_after_ms(response: rls_pb2.RateLimitResponse) -> int:
    return int(next(h.value for h in response.response_headers_to_add
                    if h.key == "retry-after-ms"))


async def herd_run(kind: str, request: pytest.FixtureRequest, algorithm: str, per_second: int,
                   clients: int, route: bool) -> tuple[list, int]:
    """Fill the rule, refuse ``clients`` in the same ms, bring each back exactly after its
    ``retry-after-ms``: every answer, and how many were refused again."""
    clock = Clock()
    service = RateLimitService(herd_rules(algorithm, per_second),
                               herd_store(kind, request, clock), timeout_s=1)
    call = [descriptor(("user", "u"))] + ([descriptor(("route", "r"))] if route else [])
    answers = []
    while (response := await ask(service, *call, domain="d")).overall_code == OK:
        answers.append(summary(response))
    start, waits = clock.now, []
    for _ in range(clients):
        response = await ask(service, *call, domain="d")
        assert response.overall_code == OVER_LIMIT
        answers.append((summary(response), [(h.key, h.value)
                                            for h in response.response_headers_to_add]))
        waits.append(retry_after_ms(response))
    again = 0
    for wait in sorted(waits):
        clock.now = start + wait
        response = await ask(service, *call, domain="d")
        answers.append(summary(response))
        again += response.overall_code == OVER_LIMIT
    await service.close()
    return answers, again


@pytest.mark.parametrize("shared", ["redis", "cluster"])
@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_window", "fixed_window"])
@pytest.mark.parametrize(("per_second", "clients", "route"), [(2, 10, False), (10, 300, False),
                                                              (3, 40, True)])
async def test_a_refused_herd_is_not_refused_again_after_its_retry_after(
    shared, algorithm, per_second, clients, route, request
):
    """A herd refused in the same ms used to be told one wait (at 2 a second, 10 clients:
    500 ms for a token bucket, 1 s for a sliding window) and 8 or 9 of 10 were refused again.
    Each is told its own slot, in memory as in Redis (the same answers, headers included)
    and in a Redis Cluster, and none is refused again — with a second descriptor (a route's
    bucket the client also takes from) too."""
    runs = [await herd_run(kind, request, algorithm, per_second, clients, route)
            for kind in ("memory", shared)]
    assert runs[0] == runs[1]
    assert runs[0][1] == 0


@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_window", "fixed_window"])
async def test_a_hostile_herd_keeps_a_bounded_schedule_in_redis_as_in_memory(algorithm, redis):
    """A client refused in a loop, never waiting: the answers stay the same in both stores,
    no wait goes past a minute (or the exact wait), and the schedule Redis keeps for the
    counter is a few fields, with at most a window's limit of entries and a TTL to its
    last slot."""
    settings = herd_rules(algorithm, 5)
    runs, stores = [], []
    for kind in ("memory", "redis"):
        clock = Clock()
        store = counters(kind, redis, clock)
        service = RateLimitService(settings, store, timeout_s=1)
        answers = []
        for _ in range(3000):
            response = await ask(service, descriptor(("user", "u")), domain="d")
            answers.append((summary(response), [(h.key, h.value)
                                                for h in response.response_headers_to_add]))
            clock.now += 1
        assert max(int(dict(h).get("retry-after-ms", 0)) for _, h in answers) <= MINUTE + 1000
        runs.append(answers)
        stores.append(store)
        if kind == "redis":
            client = aioredis.from_url(redis.url)
            keys = [k async for k in client.scan_iter(match=f"{store._prefix}:*h:*")]
            assert len(keys) == 1, keys
            schedule = await client.hgetall(keys[0])
            assert set(schedule) <= {b"sig", b"at", b"n", b"wp", b"b"}
            assert len([e for e in schedule[b"wp"].split(b",") if e]) <= 5
            assert 0 < await client.pttl(keys[0]) <= 2 * MINUTE + 1000  # slack: 60 s
            await client.aclose()
        await service.close()
    assert runs[0] == runs[1]


async def test_a_hung_redis_opens_the_domains_breaker(redis, caplog):
    """Without a breaker every call on a hung Redis waited out redis.timeout_ms (each of
    Envoy's rate-limited requests that much later) and left a cancel to retry; past 1,024
    of those the charges could stay. After ``breaker_failures`` failures the domain's calls
    are answered UNAVAILABLE at once, nothing sent, no cancel; one probe per
    ``breaker_open_ms`` closes it once Redis answers."""
    from extproc.metrics import Metrics
    from limiter.breaker import CircuitBreaker

    caplog.set_level(logging.INFO, logger="extproc.rls")
    settings = RateLimitSettings.model_validate({"domains": [{"domain": "d", "descriptors": [
        {"key": "tokens", "rate_limit": fixed(10**6, "hour", debt=True)}]}]})
    client = redis_client(RedisSettings(url=redis.url, timeout_ms=50))
    metrics = Metrics()
    service = RateLimitService(settings, RedisRateCounters(client, prefix="breaker"),
                               timeout_s=0.05, metrics=metrics,
                               breaker=CircuitBreaker(2, 300))
    metrics.ratelimit_breakers.set_function(service.breakers_open)

    def breakers_open() -> float | None:
        return metrics.registry.get_sample_value("kvgate_ratelimit_breaker_open")

    before = await tokens_left(service)
    redis.pause()
    try:
        for _ in range(2):  # each waits out the timeout, and leaves a cancel
            with pytest.raises(Aborted):
                await ask(service, descriptor(("tokens", "t"), hits=100), domain="d")
        cancels = len(service._cancels)
        started = asyncio.get_running_loop().time()
        for _ in range(20):
            with pytest.raises(Aborted):
                await ask(service, descriptor(("tokens", "t"), hits=100), domain="d")
        assert asyncio.get_running_loop().time() - started < 0.05  # not 20 × 50 ms
        assert len(service._cancels) <= cancels  # nothing sent, nothing to cancel
        assert breakers_open() == 1
        assert "ratelimit domain d: Redis circuit breaker closed → open" in caplog.text
    finally:
        redis.resume()
    await cancels_sent(service)
    await asyncio.sleep(0.3)  # breaker_open_ms: the next call probes, and Redis answers
    assert await tokens_left(service) == before  # the two timed-out calls were undone
    assert breakers_open() == 0
    assert "Redis circuit breaker half_open → closed" in caplog.text
    await service.close()


# -- a token bucket's promise is over once its last client is back (limiter.herd) -----------

TEN_A_SECOND = Limit(10, "second", burst=100)
ALONE = {  # (ms, call, limit, cost, the retry-after-ms told: None when admitted)
    "a client that did not come back": [
        (0, "a", TEN_A_SECOND, 100, None), (0, "b", TEN_A_SECOND, 50, 5000),
        (5100, "c", TEN_A_SECOND, 100, 4900), (10_000, "c2", TEN_A_SECOND, 100, None)],
    "the schedule's rounding, its client back": [
        (0, "a", Limit(38_304, "minute", burst=141), 3, None),
        (0, "b", Limit(38_304, "minute", burst=141), 140, 4),
        (4, "b2", Limit(38_304, "minute", burst=141), 140, None),
        (5, "c", Limit(38_304, "minute", burst=141), 2, 2),
        (7, "c2", Limit(38_304, "minute", burst=141), 2, None)],
    "a herd still out keeps its schedule": [
        (0, "a", TEN_A_SECOND, 100, None), (0, "b", TEN_A_SECOND, 50, 5000),
        (0, "d", TEN_A_SECOND, 50, 10_000), (5000, "b2", TEN_A_SECOND, 50, None),
        (5100, "c", TEN_A_SECOND, 100, 14_900), (10_000, "d2", TEN_A_SECOND, 50, None),
        (20_000, "c2", TEN_A_SECOND, 100, None)],
}


@pytest.mark.parametrize("case", sorted(ALONE))
async def test_a_client_alone_gets_the_exact_wait_in_redis_as_in_memory(case, redis):
    """tests/unit/limiter/test_ratelimit.py's cases (a client alone was told 9,900 ms for a
    4,900 ms wait, or 3 ms for 2): both stores give the same, exact, answers."""
    runs = []
    for kind in ("memory", "redis"):
        clock = Clock()
        start, store = clock.now, counters(kind, redis, clock)
        answers = []
        for at, call, limit, cost, expected in ALONE[case]:
            clock.now = start + at
            verdict, = await store.hit("d", [Hit("d|k=v", limit, cost)], call)
            answers.append(None if verdict.fits else verdict.wait_ms)
            assert answers[-1] == expected, (kind, at, call)
        runs.append(answers)
        await store.close()
    assert runs[0] == runs[1]


async def test_a_cancelled_charge_does_not_space_a_client_alone(redis):
    """B, refused (5,000 ms), came back and was charged its 50, but its answer was lost and
    the call cancelled (refunded). C, alone at 5,100 ms, was told 9,900 ms for a 4,900 ms
    wait: the promise still counted B's 50, given back for good."""
    clock = Clock()
    start, store = clock.now, counters("redis", redis, clock)
    hit = Hit("d|k=v", TEN_A_SECOND, 100)
    half = dataclasses.replace(hit, cost=50)
    assert (await store.hit("d", [hit], "a"))[0].fits
    assert (await store.hit("d", [half], "b"))[0].wait_ms == 5000
    clock.now = start + 5000
    assert (await store.hit("d", [half], "b2"))[0].fits
    await store.cancel("d", [half], "b2")
    clock.now = start + 5100
    assert (await store.hit("d", [hit], "c"))[0].wait_ms == 4900
    clock.now = start + 9999
    assert not (await store.hit("d", [hit], "c2"))[0].fits
    clock.now = start + 10_000
    assert (await store.hit("d", [hit], "c3"))[0].fits
    await store.close()


async def test_a_schedule_kept_before_its_clients_return_was_known_stands(redis):
    """A schedule hash without ``b`` (when its last client is back: written by an older
    kvgate) is read as before: its promise stands until its virtual full time."""
    clock = Clock()
    start, store = clock.now, counters("redis", redis, clock)
    hit = Hit("d|k=v", TEN_A_SECOND, 100)
    assert (await store.hit("d", [hit], "a"))[0].fits
    assert (await store.hit("d", [dataclasses.replace(hit, cost=50)], "b"))[0].wait_ms == 5000
    client = aioredis.from_url(redis.url)
    key, = [k async for k in client.scan_iter(match=f"{store._prefix}:*th:*")]
    assert await client.hdel(key, "b") == 1
    await client.aclose()
    clock.now = start + 5100
    assert (await store.hit("d", [hit], "c"))[0].wait_ms == 9900
    await store.close()


# -- a cancelled call's charge moves a token bucket's schedule back (limiter.ratelimit.refund) --


async def test_a_cancel_while_the_herd_is_out_moves_its_schedule_back_in_redis(redis):
    """tests/unit/limiter/test_ratelimit.py's case: A's call (60) cancelled at 100 ms while
    B is out (5,000 ms). C was told 14,900 ms, as if nothing had come back; 9,900 ms now
    (the 50 of the 60 that B's schedule keeps for sure), and C is refused 1 ms before."""
    clock = Clock()
    start, store = clock.now, counters("redis", redis, clock)
    hit = Hit("d|k=v", TEN_A_SECOND, 100)
    a = [dataclasses.replace(hit, cost=60)]
    assert (await store.hit("d", a, "a"))[0].fits
    assert (await store.hit("d", [dataclasses.replace(hit, cost=40)], "a2"))[0].fits
    half = [dataclasses.replace(hit, cost=50)]
    assert (await store.hit("d", half, "b"))[0].wait_ms == 5000
    clock.now = start + 100
    await store.cancel("d", a, "a")
    assert (await store.hit("d", [hit], "c"))[0].wait_ms == 9900
    clock.now = start + 5000
    assert (await store.hit("d", half, "b2"))[0].fits
    clock.now = start + 9999
    assert not (await store.hit("d", [hit], "early"))[0].fits
    clock.now = start + 10_000
    assert (await store.hit("d", [hit], "c2"))[0].fits
    await store.close()


ROUTE = Hit("d|route=r", Limit(3, "second", burst=6), 1)


@hypothesis.settings(
    max_examples=int(os.environ.get("KVGATE_REDIS_EXAMPLES", "60")), deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.sampled_from(["token_bucket"] * 3 + ["sliding_window", "fixed_window"]),
       st.integers(1, 20), st.integers(0, 10), st.data())
async def test_cancels_answer_alike_in_redis_and_in_memory(redis, algorithm, per_second,
                                                          extra, data):
    """Calls, herds and cancels (of calls admitted, refused, or cancelled already) at a
    clock the test moves: the Redis store (its script's cancel) answers every call as the
    in-process counters given back by limiter.ratelimit.refund do."""
    burst = per_second + extra if algorithm == "token_bucket" else None
    limit = Limit(per_second, "second", Algorithm(algorithm), burst=burst)
    clock = Clock()
    model, store = InProcess(clock.now), counters("redis", redis, clock)
    sent: list[tuple[str, list[Hit]]] = []
    cancels = 0
    for n in range(data.draw(st.integers(1, 40))):
        clock.now += data.draw(st.one_of(st.just(0), st.integers(0, 100), st.integers(0, 1500)))
        model.now = clock.now
        if sent and data.draw(st.integers(0, 2)) == 0:
            charged = [c for c in sent if model.charges.get(c[0])]  # else a no-op, mostly
            pick = charged if charged and data.draw(st.integers(0, 3)) else sent
            call_id, hits = pick[data.draw(st.integers(0, len(pick) - 1))]
            await store.cancel("d", hits, call_id)
            model.cancel(call_id)
            cancels += 1
            continue
        cap = limit.capacity
        cost = data.draw(st.one_of(st.integers(0, cap), st.integers(cap // 2, cap)))
        hits = [Hit("d|k=v", limit, cost)]
        if data.draw(st.booleans()):
            hits.append(ROUTE)
        call_id = f"c{n}"
        sent.append((call_id, hits))
        assert await store.hit("d", hits, call_id) == model.call(call_id, *hits), \
            (n, clock.now, sent)
    event(f"cancels: {min(cancels, 3)}")
    await store.close()
