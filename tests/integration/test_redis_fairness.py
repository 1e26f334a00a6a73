"""Shared virtual counters on a real redis-server and on a real 3-shard Redis Cluster: the
same decisions as the memory selector, one global weighted order across replicas, key hygiene
and failure behaviour.

One redis-server serves the module (FLUSHALL between tests); the failure test runs its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from bench.redis_server import RedisServer
from limiter.breaker import CircuitBreaker
from limiter.fairness import DEFAULT_LAG, MAX_CHARGE, SCALE
from limiter.fairqueue import Offer
from limiter.stores import (
    FailoverFairness,
    Fairness,
    MemoryFairness,
    RedisFairness,
    StoreUnavailable,
)
from tests.limiter_support import fairness_step, fairness_steps, one_pool_fairness
from tests.unit.limiter.test_fairness import (
    INTERACTIVE,
    all_backlogged,
    deviation,
    offers,
    req,
    two_replicas,
    worst,
)

pytestmark = pytest.mark.redis


def _client(url: str) -> aioredis.Redis:
    """Short timeouts, one quick retry: a dead Redis must fail fast."""
    return aioredis.Redis.from_url(
        url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 1)
    )


@pytest.fixture(params=["redis", "cluster"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    """One redis-server, or a real 3-shard Redis Cluster (a pool's keys share a hash tag)."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.flushall()
        redis_client = _client(server.url)
    else:
        cluster = request.getfixturevalue("redis_cluster")
        redis_client = RedisCluster.from_url(cluster.url, socket_timeout=1.0,
                                             socket_connect_timeout=1.0,
                                             retry=Retry(NoBackoff(), 1))
        await redis_client.flushdb(target_nodes=RedisCluster.PRIMARIES)
    yield redis_client
    await redis_client.aclose()


def shared(client: aioredis.Redis, **kwargs: object) -> RedisFairness:
    return RedisFairness(client, owns_client=False, **kwargs)  # type: ignore[arg-type]


async def firsts(client: aioredis.Redis, fair: RedisFairness) -> dict[str, int]:
    """The band-0 counters in Redis, raw."""
    raw = await client.hgetall(fair.keys()[3])
    return {tenant.decode(): int(value) for tenant, value in raw.items()}


async def assert_same_state(client: aioredis.Redis, redis_fair: RedisFairness,
                            memory: MemoryFairness) -> None:
    assert await redis_fair.counters() == await memory.counters()
    assert await firsts(client, redis_fair) == memory.core._firsts
    assert await redis_fair.virtual_time() == memory.virtual_time


# --- the simulations --------------------------------------------------------------------


async def test_backlogged_tenants_get_tokens_in_proportion_to_weight(
    client: aioredis.Redis,
) -> None:
    tokens = await all_backlogged(shared(client), 3000, seed=5)
    assert worst(tokens) <= 0.05, deviation(tokens)


async def test_mixed_bands_get_weighted_shares_within_a_bound(client: aioredis.Redis) -> None:
    spread: list[float] = []
    tokens = await all_backlogged(shared(client), 2000, 5, INTERACTIVE, spread)
    assert max(spread) <= 3 * DEFAULT_LAG + 2 * 2000
    assert worst(tokens) <= 0.05, deviation(tokens)


async def test_two_replicas_share_one_global_weighted_order(client: aioredis.Redis) -> None:
    """Replica 1 sees mostly A, replica 2 mostly C. With counters in Redis the fleet serves
    5:3:1 by tokens; two local selectors in the same scenario miss it (B and C over-served,
    A under-served), because each is only fair to the mix it happens to see."""
    global_ = await two_replicas(shared(client), shared(client), 800, seed=3)
    local = await two_replicas(MemoryFairness(), MemoryFairness(), 800, seed=3)
    print(f"\nglobal (redis) {deviation(global_)}\nlocal (memory) {deviation(local)}")
    assert worst(global_) <= 0.10, deviation(global_)
    assert worst(local) > 2 * worst(global_), (deviation(local), deviation(global_))


# --- parity with the memory selector -----------------------------------------------------

@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fairness_steps(), st.sampled_from([0, 100, DEFAULT_LAG]))
async def test_same_decisions_as_memory(client: aioredis.Redis, steps: list[tuple],
                                        lag: int) -> None:
    """Any sequence of activations, corrections and offers (mixed bands, unfit ones,
    duplicate tenants, equal counters and enqueue times, prices that force rebases) gets the
    same choices — waiting included — and the same counters from both selectors."""
    await client.flushdb()
    kwargs = {"lag_tokens": lag, "rebase_at": 2 * MAX_CHARGE}
    memory, redis_fair = MemoryFairness(**kwargs), shared(client, **kwargs)
    for tenant in "AB":  # V > 0 from the start, so "no counter yet = V" matters
        warm = offers(req(f"warm{tenant}", tenant, cost=999, band=1))
        await memory.choose(warm)
        await redis_fair.choose(warm)
    for n, step in enumerate(steps):
        assert await fairness_step(redis_fair, n, step) == await fairness_step(memory, n, step)
    await assert_same_state(client, redis_fair, memory)


async def test_rebasing_in_lua_matches_memory(client: aioredis.Redis) -> None:
    """Charges near MAX_CHARGE force several rebases; Lua shifts exactly like Python."""
    memory = MemoryFairness(lag_tokens=10**8, rebase_at=2 * MAX_CHARGE)
    redis_fair = shared(client, lag_tokens=10**8, rebase_at=2 * MAX_CHARGE)
    rebases, last_v = 0, 0.0
    for n in range(40):
        items = offers(*(req(f"{n}{t}", t, (10**9 - 997 * n) * int(w), n, band=(n + i) % 2)
                         for i, (t, w) in enumerate((("A", 5), ("B", 3), ("C", 1)))))
        assert (await redis_fair.choose(items)).id == (await memory.choose(items)).id
        rebases += memory.virtual_time < last_v
        last_v = memory.virtual_time
        assert await redis_fair.virtual_time() == last_v
    await assert_same_state(client, redis_fair, memory)
    assert rebases >= 3 and len(memory.core._firsts) == 3  # band-0 counters shifted too


# --- keys, TTLs, failures -------------------------------------------------------------------


async def test_keys_share_one_hash_tag_per_pool_and_expire(client: aioredis.Redis) -> None:
    fair = shared(client, prefix="kv", pool="gpu-{a}", ttl_ms=5000)
    await fair.activate("t")
    await fair.choose(offers(req("x", "t")))  # band 0: its band-0 counter is written too
    keys = fair.keys()
    assert keys[0] == "kv:{kv:fair:gpu-%7Ba%7D}:c" and keys[3] == "kv:{kv:fair:gpu-%7Ba%7D}:f"
    assert len({key_slot(key.encode()) for key in keys}) == 1
    for key in keys:
        assert 0 < await client.pttl(key) <= 5000
    other = shared(client, prefix="kv", pool="cpu")
    assert await other.counters() == {} and await other.virtual_time() == 0


async def test_idle_tenants_are_forgotten_after_the_ttl(client: aioredis.Redis) -> None:
    fair = shared(client, ttl_ms=150)
    await fair.choose(offers(req("x", "old", cost=5)))
    await asyncio.sleep(0.2)
    assert await client.exists(*fair.keys()) == 0  # the whole pool expired
    await fair.choose(offers(req("y", "old", cost=5)))
    await asyncio.sleep(0.1)
    await fair.choose(offers(req("z", "new", cost=5)))
    await asyncio.sleep(0.1)
    await fair.activate("new")  # "old" last used 200 ms ago: pruned, both its counters
    assert set(await fair.counters()) == {"new"}
    assert set(await firsts(client, fair)) == {"new"}


async def test_waiting_and_correcting_an_unknown_tenant_write_nothing(
    client: aioredis.Redis,
) -> None:
    fair = shared(client, lag_tokens=100)
    await fair.choose(offers(req("y0", "Y", 500, weight=1, band=1)))  # Y at 500, V 0
    await fair.activate("X")
    keys = fair.keys()
    dump = {key: await client.dump(key) for key in keys}
    x, y = req("x", "X", 10, weight=1, band=1), req("y", "Y", 10, weight=1, band=1)
    assert await fair.choose(offers(x, y, unfit=("x",))) is None
    await fair.correct("nobody", -100, 1.0)
    assert {key: await client.dump(key) for key in keys} == dump
    await fair.correct("Y", -450, 1.0)  # one round trip: refunded, floored at 0 if need be
    assert await fair.counters() == {"Y": 50.0, "X": 0.0}
    await fair.correct("Y", -10**6, 1.0)
    assert (await fair.counters())["Y"] == 0


async def test_corrections_of_many_tenants_are_one_call_and_match_memory(
    client: aioredis.Redis,
) -> None:
    """The director prices the requests in flight again each scrape round: every tenant's
    correction goes in one script call, and each counter moves as its own call would move
    it (refunds floored at the lag below V, band-0 counters with band-0 work, an unknown
    tenant left alone)."""
    fairs: list[Fairness] = [MemoryFairness(lag_tokens=100), shared(client, lag_tokens=100)]
    for fair in fairs:
        await fair.choose(offers(req("x0", "X", 500, weight=1, band=0)))
        await fair.choose(offers(req("y0", "Y", 300, weight=2, band=1)))
        await fair.activate("Z")
    if not isinstance(client, RedisCluster):
        before = (await client.info("commandstats"))["cmdstat_evalsha"]["calls"]
    corrections = [("X", -450, 1.0, True), ("Y", 90, 2.0, False), ("Z", -5, 1.0, False),
                   ("nobody", 40, 1.0, False), ("X", 0, 1.0, False)]
    for fair in fairs:
        await fair.correct_many(corrections)
    if not isinstance(client, RedisCluster):
        after = (await client.info("commandstats"))["cmdstat_evalsha"]["calls"]
        assert after - before == 1
    memory, redis = fairs
    assert await redis.counters() == await memory.counters()
    await shared(client, lag_tokens=100).correct_many([])  # nothing to send: no call


def test_lag_is_bounded_for_exact_lua() -> None:
    with pytest.raises(ValueError, match="lag_tokens"):
        RedisFairness(aioredis.Redis(), lag_tokens=MAX_CHARGE // SCALE + 1)
    with pytest.raises(ValueError):
        RedisFairness(aioredis.Redis(), lag_tokens=-1)


async def test_redis_errors_become_store_unavailable() -> None:
    with RedisServer() as srv:
        fair: Fairness = RedisFairness(_client(srv.url))
        await fair.activate("a")
        srv.kill()
        for call in (fair.activate("a"), fair.choose(offers(req("x", "a"))),
                     fair.correct("a", -5, 1.0), fair.counters()):
            with pytest.raises(StoreUnavailable):
                await call
        await fair.close()
    assert isinstance(fair, Fairness)


# --- a paused Redis: the failover's breaker, and choices that timed out ---------------------


def pool_sample(metrics: Any, name: str) -> float | None:
    """Pool ``one``'s sample of ``name`` (``one_pool_fairness``'s metrics)."""
    return metrics.registry.get_sample_value(name, {"pool": "one"})


async def test_choices_a_paused_redis_runs_late_charge_only_what_was_served(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """A choice that timed out runs in Redis once it answers: it is undone there and the
    request the fallback dispatched is charged instead. After ``breaker_failures`` timeouts
    the breaker keeps decisions from waiting on Redis at all."""
    redis_server.flushall()
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=0.1,
                                     socket_connect_timeout=0.1, retry=Retry(NoBackoff(), 0))
    fair = FailoverFairness(shared(client), 0.1, breaker=CircuitBreaker(3, 60_000))
    for tenant in "AB":
        await fair.activate(tenant)
    for n in range(5):  # A far ahead in Redis: Redis would pick B, the fallback takes turns
        await fair.shared.choose(offers(req(f"a-{n}", "A", 1000, band=1)))
    before = await fair.shared.counters()
    queue = {t: [req(f"{t}{n}", t, 100, at=n, weight=1, band=1) for n in range(6)] for t in "AB"}
    served = {"A": 0.0, "B": 0.0}
    redis_server.pause()
    try:
        start = time.monotonic()
        for n in range(6):
            chosen = await fair.choose([Offer(q[0], 1, True) for q in queue.values()])
            assert chosen is not None
            queue[chosen.tenant].remove(chosen)
            if n < 3:  # the breaker's 3 failures reached Redis; the rest stayed local
                served[chosen.tenant] += chosen.cost
        assert time.monotonic() - start < 0.5  # 3 waits of 100 ms, not 6
        assert "fair queue breaker closed → open" in caplog.text
    finally:
        redis_server.resume()
    for _ in range(50):
        await asyncio.sleep(0.05)
        if not fair._undos:
            break
    after = await fair.shared.counters()
    assert {t: after[t] - before[t] for t in "AB"} == served
    assert served["A"] and served["B"]
    # an undo sent again changes nothing; a choice undone before it runs writes nothing
    assert await fair.shared.undo("never-ran", None) is False
    assert await fair.shared.undo("never-ran", None) is False
    x = req("x", "A", 100, weight=1, band=1)
    assert await fair.shared.choose([Offer(x, 1, True), Offer(req("y", "B", 1, band=1), 1, True)],
                                    "never-ran") is None
    assert await fair.shared.counters() == after
    await fair.close()
    await client.aclose()


async def test_a_pools_fair_order_on_its_own_counters_shows_in_its_metrics() -> None:
    """``kvgate_queue_breaker_open{pool}`` is 1 while the pool's fair order is this
    process's own, and each choice made so is counted, as the store's breaker is."""
    with RedisServer() as server:
        fair, metrics = one_pool_fairness({"url": server.url, "timeout_ms": 100,
                                           "breaker_failures": 2, "breaker_open_ms": 60_000})

        def two(n: object) -> list[Offer]:  # two tenants: a choice Redis must make
            return offers(req(f"a{n}", "A", 10, band=1), req(f"b{n}", "B", 10, band=1))

        assert pool_sample(metrics, "kvgate_queue_breaker_open") == 0
        assert await fair.choose(two("x")) is not None
        assert pool_sample(metrics, "kvgate_queue_fallback_choices_total") == 0
        server.pause()
        try:
            for n in range(4):  # two reach Redis and time out, then the breaker skips it
                assert await fair.choose(two(n)) is not None
            assert pool_sample(metrics, "kvgate_queue_breaker_open") == 1
            assert pool_sample(metrics, "kvgate_queue_fallback_choices_total") == 4
        finally:
            server.resume()
        await fair.close()


async def test_a_queued_client_gone_during_the_probe_does_not_keep_the_order_local() -> None:
    """Redis paused: a request whose client leaves while its queue's ``activate`` is the
    breaker's probe cancels the probe, which then reports nothing. The pool's fair order
    stayed this process's own for good (``kvgate_queue_breaker_open`` 1) with Redis back;
    now the next call after ``breaker_open_ms`` probes again."""
    with RedisServer() as server:
        # a long call budget holds the probe while its client leaves
        fair, metrics = one_pool_fairness({"url": server.url, "timeout_ms": 1000,
                                           "breaker_failures": 1, "breaker_open_ms": 300})
        assert isinstance(fair, FailoverFairness)

        def two(n: object) -> list[Offer]:  # two tenants: a choice Redis must make
            return offers(req(f"a{n}", "A", 10, band=1), req(f"b{n}", "B", 10, band=1))

        assert await fair.choose(two("x")) is not None
        server.pause()
        try:
            assert await fair.choose(two(0)) is not None  # timed out: the breaker opens
            await asyncio.sleep(0.3)  # breaker_open_ms: the next call probes
            probe = asyncio.create_task(fair.activate("A"))
            await asyncio.sleep(0.05)
            assert fair.breaker.state == "half_open"
            probe.cancel()  # the queued request's client went away
            with pytest.raises(asyncio.CancelledError):
                await probe
        finally:
            server.resume()
        resumed, n = time.monotonic(), 1
        # within breaker_open_ms, plus a call
        while pool_sample(metrics, "kvgate_queue_breaker_open"):
            assert time.monotonic() - resumed < 1.5, "Redis is back but never probed"
            assert await fair.choose(two(n)) is not None
            n += 1
            await asyncio.sleep(0.02)
        local = pool_sample(metrics, "kvgate_queue_fallback_choices_total")
        assert await fair.choose(two("y")) is not None
        assert pool_sample(metrics, "kvgate_queue_fallback_choices_total") == local  # Redis chose
        while fair._undos:  # the choice that timed out is undone in Redis
            assert time.monotonic() - resumed < 3.0
            await asyncio.sleep(0.02)
        await fair.close()


async def test_a_paused_redis_opens_the_breaker_on_choices_that_never_wait() -> None:
    """A choice of one offer that fits is only queued on the pipe (no round trip): it was
    taken as Redis answering, so with Redis hung the breaker stayed closed (and the order
    "on Redis") for as long as the queue offered one request at a time. Now its answer, or
    its timeout, tells the breaker; once open, the choices are this process's own, and a
    waited probe closes it again when Redis is back."""
    with RedisServer() as server:
        fair, metrics = one_pool_fairness({"url": server.url, "timeout_ms": 100,
                                           "breaker_failures": 2, "breaker_open_ms": 300})
        assert isinstance(fair, FailoverFairness)

        def one(n: object) -> list[Offer]:
            return offers(req(f"a{n}", "A", 10, band=1))

        await fair.activate("A")
        assert await fair.choose(one("x")) is not None
        server.pause()
        try:
            started = time.monotonic()
            n = 0
            while fair.breaker.state == "closed":
                assert time.monotonic() - started < 2.0, "the breaker never opened"
                assert await fair.choose(one(n)) is not None  # never waits
                n += 1
                await asyncio.sleep(0.05)
            assert time.monotonic() - started < 0.2 * n + 0.5
            assert pool_sample(metrics, "kvgate_queue_breaker_open") == 1
            local = pool_sample(metrics, "kvgate_queue_fallback_choices_total")
            assert await fair.choose(one("local")) is not None
            assert pool_sample(metrics, "kvgate_queue_fallback_choices_total") == local + 1
        finally:
            server.resume()
        resumed = time.monotonic()
        while fair.breaker.state != "closed":
            assert time.monotonic() - resumed < 2.0, "Redis is back but the breaker stays open"
            assert await fair.choose(one(n)) is not None
            n += 1
            await asyncio.sleep(0.05)
        assert pool_sample(metrics, "kvgate_queue_breaker_open") == 0
        await fair.close()
