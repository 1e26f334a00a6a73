"""The Redis store against a real redis-server: identical decisions to the memory store,
exact retries, lease TTLs, exactly-once release, key hygiene and failure behaviour.

Every test taking ``client`` runs twice: on one redis-server, and on a real 3-shard Redis
Cluster (a tenant's keys share a hash tag, so each script runs on one shard). One server and
one cluster serve the module (FLUSHDB between examples); the failure tests run their own,
since they kill it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from bench.redis_server import RedisServer
from limiter import (
    DAY_MS,
    Admit,
    Cost,
    Period,
    Rate,
    Reason,
    Reject,
    TenantPolicy,
    period_bounds,
    wall_ms,
)
from limiter.stores import LimiterStore, MemoryStore, StoreUnavailable
from limiter.stores.redis_store import RedisStore
from tests.limiter_support import assert_never_faster, policies

pytestmark = pytest.mark.redis

PARITY = settings(
    max_examples=int(os.environ.get("KVGATE_REDIS_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EPOCH_2026 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


class FakeClock:
    """Epoch ms that only move when the test says so (shared by both stores)."""

    def __init__(self, now: int = EPOCH_2026) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def _client(url: str, timeout_s: float = 2.0) -> aioredis.Redis:
    """Short timeouts, one quick retry: a dead Redis must fail fast, not hang admissions."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


def _cluster_client(url: str, timeout_s: float = 2.0) -> RedisCluster:
    return RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 retry=Retry(NoBackoff(), 1))


async def _dbsize(client: aioredis.Redis) -> int:
    """Keys in the database (a cluster's: summed over its primaries)."""
    if isinstance(client, RedisCluster):
        return await client.dbsize(target_nodes=RedisCluster.PRIMARIES)
    return await client.dbsize()


@pytest.fixture(params=["redis", "cluster"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    if request.param == "redis":
        redis_client = _client(request.getfixturevalue("redis_server").url)
        await redis_client.flushdb()
    else:
        redis_client = _cluster_client(request.getfixturevalue("redis_cluster").url)
        await redis_client.flushdb(target_nodes=RedisCluster.PRIMARIES)
    yield redis_client
    await redis_client.aclose()


# --- parity with the in-memory store -----------------------------------------------------

def _boundaries() -> st.SearchStrategy[int]:
    """Just before a UTC month (hence day) boundary, leap Februaries included."""
    months = st.tuples(st.integers(2020, 2035), st.integers(1, 12))
    return st.builds(
        lambda ym, back: int(datetime(ym[0], ym[1], 1, tzinfo=UTC).timestamp() * 1000) - back,
        months,
        st.integers(1, 5000),
    )


starts = st.one_of(_boundaries(), st.integers(EPOCH_2026, EPOCH_2026 + 400 * DAY_MS))

permille = st.one_of(st.integers(0, 1000), st.integers(800, 1000), st.integers(0, 1100))
ops = st.one_of(
    st.tuples(st.just("admit"), permille, permille, st.sampled_from([1, 1, 1, 0, 2])),
    st.tuples(st.just("admit"), permille, permille, st.just(1)),
    st.tuples(st.just("admit"), st.integers(0, 400), st.integers(0, 400), st.just(1)),
    st.tuples(st.just("release"), st.integers(0, 10**6),
              st.one_of(st.none(), st.integers(0, 2000))),
    st.tuples(st.just("unserved"), st.integers(0, 10**6)),  # left the queue, or refused
    st.tuples(st.just("check")),
    st.tuples(st.just("renew"), st.integers(0, 10**6)),
    st.tuples(st.just("advance"), st.one_of(st.integers(0, 50), st.integers(0, 3000))),
    st.tuples(st.just("advance"), st.integers(0, 500)),
    st.tuples(st.just("advance"), st.sampled_from([DAY_MS // 2, DAY_MS, 31 * DAY_MS])),
    st.tuples(st.just("switch")),
    st.tuples(st.just("usage")),
)


def _scaled_cost(policy: TenantPolicy, prompt: int, output: int, requests: int) -> Cost:
    """Costs in per-mille of the tenant's token budget, so every dimension gets to say no
    (above 1000 ‰ the request can never fit)."""
    cap = policy.token_burst or 3000
    tokens = cap * prompt // 1000
    return Cost(tokens, max(0, cap - tokens) * output // 1000, requests)


async def _step(
    store: LimiterStore, op: tuple, policy: TenantPolicy, held: dict[str, int], n: int
) -> object:
    """Apply one scripted operation to ``store``; returns what the caller must compare."""
    kind, leases = op[0], sorted(held)
    if kind == "admit":
        return await store.admit("acme", policy, _scaled_cost(policy, *op[1:]), f"lease-{n}")
    if kind == "release":
        lease = leases[op[1] % len(leases)] if leases else "never"
        used = None if op[2] is None else held.get(lease, 0) * op[2] // 1000
        return await store.release("acme", policy, lease, used)
    if kind == "unserved":
        lease = leases[op[1] % len(leases)] if leases else "never"
        return await store.release("acme", policy, lease, 0, served=False)
    if kind == "renew":
        await store.renew("acme", [leases[op[1] % len(leases)]] if leases else [])
        return await store.in_flight("acme")
    if kind == "check":
        return await store.check_requests("acme", policy)
    return await store.usage("acme", policy)


@PARITY
@given(st.data(), st.lists(policies(quotas=True), min_size=1, max_size=2), starts,
       st.sampled_from([None, 700, 5000]))
async def test_parity_with_memory_store(
    client: aioredis.Redis,
    data: st.DataObject,
    pols: list[TenantPolicy],
    start: int,
    lease_ttl: int | None,
) -> None:
    """Scripted arrivals give identical answers (decision, reason, retry, remaining, reset,
    messages, usage) from the memory and the Redis store driven by one fake clock."""
    await client.flushdb()
    clock = FakeClock(start)
    memory = MemoryStore(clock, lease_ttl_ms=lease_ttl)
    shared = RedisStore(client, clock=clock, lease_ttl_ms=lease_ttl or 10**12)
    held: dict[str, int] = {}
    which = 0
    for n, op in enumerate(data.draw(st.lists(ops, min_size=5, max_size=60), label="ops")):
        if op[0] == "advance":
            clock.now += op[1]
            continue
        if op[0] == "switch":
            which = (which + 1) % len(pols)
            continue
        policy = pols[which]
        expected = await _step(memory, op, policy, held, n)
        assert await _step(shared, op, policy, held, n) == expected, (op, clock.now)
        if isinstance(expected, Admit):
            held[expected.lease_id] = expected.cost.tokens
        event(f"{op[0]}: {type(expected).__name__}")
        if isinstance(expected, Reject):
            event(f"reject: {expected.reason}")
    assert await shared.in_flight("acme") == await memory.in_flight("acme")
    assert await shared.usage("acme", pols[which]) == await memory.usage("acme", pols[which])


async def test_a_shaping_change_forgets_the_promised_retry_slots_in_both_stores(
        client: aioredis.Redis) -> None:
    """Found by the parity test above (CI, 2026-12-04): the scripts forgot the retry slots
    promised under the old limits when only the shaping changed, the memory store kept them
    (50 ms against 150 for the fourth refusal below)."""
    await client.flushdb()
    clock = FakeClock()
    memory, shared = MemoryStore(clock), RedisStore(client, clock=clock)
    plain = TenantPolicy(request_rate=Rate(1, 50), request_burst=1)
    shaped = dataclasses.replace(plain, shaping_rate=Rate(1, 50), shaping_backlog=0)
    waits = []
    for n, policy in enumerate([plain, plain, plain, shaped]):
        got = [await store.admit("acme", policy, Cost(0, 0, 1), f"lease-{n}")
               for store in (memory, shared)]
        assert got[0] == got[1]
        waits.append(getattr(got[0], "retry_after_ms", None))
    assert waits == [None, 50, 100, 50]  # a herd's slots, then the exact wait again


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data(), policies(quotas=True), starts)
async def test_clock_stepping_back_is_safe(
    client: aioredis.Redis, data: st.DataObject, policy: TenantPolicy, start: int
) -> None:
    """Steps back in time (exact parity is only promised for a clock that does not go
    back): no script error, every wait positive, no negative count."""
    await client.flushdb()
    clock = FakeClock(start)
    store = RedisStore(client, clock=clock, lease_ttl_ms=700)
    steps = st.one_of(ops, st.tuples(st.just("back"), st.integers(1, 5000)))
    held: dict[str, int] = {}
    for n, op in enumerate(data.draw(st.lists(steps, min_size=5, max_size=40))):
        if op[0] in ("advance", "back"):
            clock.now += op[1] if op[0] == "advance" else -op[1]
            continue
        if op[0] == "switch":
            continue
        result = await _step(store, op, policy, held, n)
        if isinstance(result, Admit):
            held[result.lease_id] = result.cost.tokens
        if isinstance(result, Reject):
            assert result.retry_after_ms is None or result.retry_after_ms > 0
            counts = [v for v in dataclasses.asdict(result.remaining).values() if v is not None]
            assert min(counts, default=0) >= 0
    usage = await store.usage("acme", policy)
    assert usage["in_flight"] >= 0
    assert all(q["used"] >= 0 for q in usage["quotas"].values())


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(-(10**12), 4_102_444_800_000), st.integers(1, 10**6))
async def test_calendar_in_lua_matches_python(client: aioredis.Redis, now: int, quota: int) -> None:
    """The script's UTC day/month arithmetic (from 1938 to 2100) equals period_bounds."""
    clock = FakeClock(now)
    store = RedisStore(client, clock=clock)
    policy = TenantPolicy(daily_token_quota=quota, monthly_token_quota=quota)
    usage = await store.usage("acme", policy)
    for period in Period:
        start, end = period_bounds(now, period)
        got = usage["quotas"][period.value]
        assert (got["period_start_ms"], got["reset_ms"]) == (start, end - now)


# --- retries, leases, release ------------------------------------------------------------


def no_concurrency_policies() -> st.SearchStrategy[TenantPolicy]:
    return policies(concurrency=False, quotas=True)


@PARITY
@given(st.data(), no_concurrency_policies(), starts)
async def test_retry_after_is_exact_through_redis(
    client: aioredis.Redis, data: st.DataObject, policy: TenantPolicy, start: int
) -> None:
    """Rejected with retry_after_ms = w: admitted at now + w, still rejected at now + w − 1."""
    await client.flushdb()
    clock = FakeClock(start)
    store = RedisStore(client, clock=clock)
    for n in range(data.draw(st.integers(0, 15))):
        clock.now += data.draw(st.one_of(st.integers(0, 20), st.integers(0, 400)))
        cost = _scaled_cost(policy, data.draw(st.integers(300, 1000)), 0, 1)
        await store.admit("acme", policy, cost, f"h{n}")
    cost = _scaled_cost(policy, data.draw(permille), data.draw(permille), 1)
    await client.delete(store.keys("acme")[9])  # a client alone: no herd holds slots
    result = await store.admit("acme", policy, cost, "probe")
    if not isinstance(result, Reject) or result.retry_after_ms is None:
        event("admitted at once or never retryable")
        return
    now, wait = clock.now, result.retry_after_ms
    clock.now = now + wait - 1
    assert isinstance(await store.admit("acme", policy, cost, "probe"), Reject)
    clock.now = now + wait
    assert isinstance(await store.admit("acme", policy, cost, "probe"), Admit)


async def test_unreleased_lease_expires_and_renew_keeps_it(client: aioredis.Redis) -> None:
    clock = FakeClock()
    policy = TenantPolicy(max_concurrency=1, concurrency_retry_ms=250)
    for store in (RedisStore(client, clock=clock, lease_ttl_ms=1000),
                  MemoryStore(clock, lease_ttl_ms=1000)):
        start = clock.now
        assert isinstance(await store.admit("acme", policy, Cost(1, 1), "crashed"), Admit)
        clock.now = start + 999
        blocked = await store.check_requests("acme", policy)
        assert blocked is not None and blocked.reason is Reason.CONCURRENCY
        clock.now = start + 1000  # never released: the slot frees itself
        assert await store.in_flight("acme") == 0
        assert await store.release("acme", policy, "crashed", 0) is False
        assert isinstance(await store.admit("acme", policy, Cost(1, 1), "streaming"), Admit)
        clock.now = start + 1900
        await store.renew("acme", ["streaming", "unknown"])
        clock.now = start + 2500  # past the first expiry, inside the renewed one
        assert await store.in_flight("acme") == 1
        assert await store.release("acme", policy, "streaming", 2) is True
        clock.now += 10_000


async def test_release_is_exactly_once(client: aioredis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(client, clock=clock)
    policy = TenantPolicy(token_rate=Rate(1, 1), token_burst=1000, daily_token_quota=5000)
    admitted = await store.admit("acme", policy, Cost(100, 500), "a")
    assert isinstance(admitted, Admit) and admitted.remaining.tokens_remaining == 400
    assert await store.release("acme", policy, "a", 150) is True
    after = await store.usage("acme", policy)
    assert after["tokens"]["available"] == 850
    assert after["quotas"]["daily"]["used"] == 150
    assert await store.release("acme", policy, "a", 0) is False
    assert await store.release("acme", policy, "a", 10_000) is False
    assert await store.usage("acme", policy) == after


CANCELLABLE = TenantPolicy(
    request_rate=Rate(1, 1000), request_burst=10, token_rate=Rate(1, 1000), token_burst=1000,
    window_limit=10, window_ms=60_000, daily_token_quota=5000, max_concurrency=3,
)


def _amounts(usage: dict[str, Any]) -> tuple[int, ...]:
    """What an admission charges, from a store's usage view."""
    return (usage["requests"]["available"], usage["tokens"]["available"],
            usage["window"]["used"], usage["quotas"]["daily"]["used"], usage["in_flight"])


async def test_cancel_refunds_an_admission_that_ran(client: aioredis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(client, clock=clock)
    await store.admit("acme", CANCELLABLE, Cost(10, 10), "kept")
    before = _amounts(await store.usage("acme", CANCELLABLE))
    for lease_id in ("same-ms", "other"):  # one window entry merged with "kept", one apart
        assert isinstance(await store.admit("acme", CANCELLABLE, Cost(100, 200), lease_id), Admit)
        await store.cancel("acme", CANCELLABLE, lease_id)
        assert _amounts(await store.usage("acme", CANCELLABLE)) == before
        assert await store.release("acme", CANCELLABLE, lease_id, 5) is False
        clock.now += 3


async def test_a_request_never_served_gives_back_its_request_on_both_stores(
    client: aioredis.Redis,
) -> None:
    """A request that left kvgate's queue unserved (its deadline passed, its client left)
    got its tokens back but kept its request-rate and window charges: the client's retry
    was refused for a request nobody served (by the window below, for 60 s)."""
    clock = FakeClock()
    policy = dataclasses.replace(CANCELLABLE, request_burst=2, window_limit=2)
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]
    for store in stores:
        assert isinstance(await store.admit("acme", policy, Cost(10, 10), "kept"), Admit)
        before = _amounts(await store.usage("acme", policy))
        for lease_id in ("same-ms", "other"):  # one window entry merged with "kept", one apart
            admitted = await store.admit("acme", policy, Cost(100, 200), lease_id)
            assert isinstance(admitted, Admit)
            assert await store.release("acme", policy, lease_id, 0, served=False)
            assert _amounts(await store.usage("acme", policy)) == before
            clock.now += 3
        retry = await store.admit("acme", policy, Cost(100, 200), "retry")
        assert isinstance(retry, Admit), retry
        clock.now = EPOCH_2026


async def test_cancel_before_the_admission_lands_makes_it_charge_nothing(
    client: aioredis.Redis,
) -> None:
    store = RedisStore(client, clock=FakeClock())
    await store.cancel("acme", CANCELLABLE, "late")
    with pytest.raises(StoreUnavailable, match="cancelled"):
        await store.admit("acme", CANCELLABLE, Cost(100, 200), "late")
    assert [k async for k in client.scan_iter("*")] == [store.keys("acme")[8].encode()]


async def test_duplicate_lease_is_a_bug(client: aioredis.Redis) -> None:
    store = RedisStore(client, clock=FakeClock())
    assert isinstance(await store.admit("acme", TenantPolicy(), Cost(1, 1), "a"), Admit)
    with pytest.raises(ValueError, match="already held"):
        await store.admit("acme", TenantPolicy(), Cost(1, 1), "a")


async def test_quota_reject_carries_reset_time(client: aioredis.Redis) -> None:
    clock = FakeClock(EPOCH_2026 - 10_000)  # 10 s before 2026 (and a new day and month)
    store = RedisStore(client, clock=clock)
    policy = TenantPolicy(daily_token_quota=1000, monthly_token_quota=100_000)
    assert isinstance(await store.admit("acme", policy, Cost(600, 300), "a"), Admit)
    rejected = await store.admit("acme", policy, Cost(100, 100), "b")
    assert isinstance(rejected, Reject)
    assert (rejected.reason, rejected.retry_after_ms, rejected.reset_ms) == (
        Reason.QUOTA, None, 10_000,
    )
    assert rejected.remaining.quota_remaining == 100
    clock.now = EPOCH_2026
    assert isinstance(await store.admit("acme", policy, Cost(100, 100), "b"), Admit)


async def test_server_clock_mode(client: aioredis.Redis) -> None:
    """clock=None: the scripts read Redis TIME; quotas land in today's UTC period."""
    store = RedisStore(client)
    policy = TenantPolicy(request_rate=Rate(1, 60_000), request_burst=1, daily_token_quota=50)
    before = wall_ms()
    assert isinstance(await store.admit("acme", policy, Cost(10, 10), "a"), Admit)
    rejected = await store.admit("acme", policy, Cost(1, 1), "b")
    assert isinstance(rejected, Reject) and rejected.reason is Reason.REQUESTS
    assert rejected.retry_after_ms is not None and 0 < rejected.retry_after_ms <= 60_000
    usage = await store.usage("acme", policy)
    assert usage["quotas"]["daily"]["used"] == 20
    starts = {period_bounds(t, Period.DAY)[0] for t in (before, wall_ms())}
    assert usage["quotas"]["daily"]["period_start_ms"] in starts


# --- keys --------------------------------------------------------------------------------


async def _busy_tenant(store: RedisStore, policy: TenantPolicy, clock: FakeClock) -> None:
    for n in range(5):
        await store.admit("acme", policy, Cost(50, 50), f"l{n}")
        clock.now += 7
    await store.release("acme", policy, "l0", 10)
    await store.cancel("acme", policy, "never-answered")  # a tombstone: the cancelled key


FULL = TenantPolicy(
    request_rate=Rate(1, 100), request_burst=10, token_rate=Rate(1, 1), token_burst=5000,
    window_limit=10, window_ms=1000, max_concurrency=10, daily_token_quota=10**6,
    monthly_token_quota=10**7, shaping_rate=Rate(1, 10), shaping_backlog=10,
)


async def test_every_key_has_a_ttl_and_the_tenant_hash_tag(client: aioredis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(client, clock=clock)
    await _busy_tenant(store, FULL, clock)
    keys = [key async for key in client.scan_iter("*")]
    # (the records of expired leases, ``gone``, exist only once a lease has expired)
    assert sorted(k.decode() for k in keys) == sorted(
        k for k in store.keys("acme") if not k.endswith((":gone", ":gone:meta")))
    for key in keys:
        assert key.startswith(b"kvgate:{kvgate:acme}:")
        assert await client.pttl(key) > 0, key
    assert len({key_slot(key) for key in keys}) == 1


async def test_prefix_and_odd_tenant_names(client: aioredis.Redis) -> None:
    clock = FakeClock()
    store = RedisStore(client, prefix="kvtest", clock=clock)
    for tenant in ("a}b{c", "x%7Dy"):
        await store.admit(tenant, FULL, Cost(1, 1), "l")
    keys = [key.decode() async for key in client.scan_iter("*")]
    assert all(key.startswith("kvtest:{kvtest:") for key in keys)
    assert len({key_slot(k.encode()) for k in store.keys("a}b{c")}) == 1
    assert set(store.keys("a}b{c")).isdisjoint(store.keys("x%7Dy"))
    assert await store.in_flight("a}b{c") == 1 and await store.in_flight("x%7Dy") == 1


async def test_idle_tenant_leaves_nothing_behind(client: aioredis.Redis) -> None:
    """Server clock, short slack: once every dimension is back to its default state (and
    the lease has expired), every key is gone by itself."""
    store = RedisStore(client, lease_ttl_ms=100, ttl_slack_ms=20)
    policy = TenantPolicy(
        request_rate=Rate(1, 20), request_burst=1, window_limit=1, window_ms=50,
        token_rate=Rate(1, 1), token_burst=10, max_concurrency=1,
    )
    assert isinstance(await store.admit("acme", policy, Cost(5, 5), "a"), Admit)
    assert await _dbsize(client) == 6  # both buckets, window + meta, leases + meta
    ttls = [await client.pttl(key) async for key in client.scan_iter("*")]
    assert all(0 < ttl <= 200 for ttl in ttls), ttls
    for _ in range(100):
        if await _dbsize(client) == 0:
            break
        await asyncio.sleep(0.02)
    assert await _dbsize(client) == 0


# --- scripts and failures ----------------------------------------------------------------


async def test_noscript_reload(client: aioredis.Redis) -> None:
    store = RedisStore(client, clock=FakeClock())
    assert isinstance(await store.admit("acme", FULL, Cost(1, 1), "a"), Admit)
    await client.script_flush()
    assert isinstance(await store.admit("acme", FULL, Cost(1, 1), "b"), Admit)
    assert await store.release("acme", FULL, "a", 1) is True
    assert await store.in_flight("acme") == 1


async def test_redis_down_raises_store_unavailable_promptly_then_recovers() -> None:
    with RedisServer() as srv:
        store = RedisStore(_client(srv.url, timeout_s=0.5), clock=FakeClock())
        assert isinstance(await store.admit("acme", FULL, Cost(1, 1), "a"), Admit)
        srv.kill()
        for call in (
            store.admit("acme", FULL, Cost(1, 1), "b"),
            store.release("acme", FULL, "a", 1),
            store.check_requests("acme", FULL),
            store.in_flight("acme"),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await call
            assert time.monotonic() - started < 2.0
        srv.start()  # an empty server: scripts reload on NOSCRIPT, state starts afresh
        assert isinstance(await store.admit("acme", FULL, Cost(1, 1), "c"), Admit)
        assert await store.in_flight("acme") == 1
        await store.close()


async def test_memory_and_redis_satisfy_the_protocol(client: aioredis.Redis) -> None:
    assert isinstance(RedisStore(client), LimiterStore)
    assert isinstance(MemoryStore(), LimiterStore)


async def test_timing_one_admission(client: aioredis.Redis) -> None:
    """Not a benchmark: a sanity bound (one round trip, ~0.1 ms of Lua) that catches a
    script accidentally going O(n) in the window or lease sets."""
    store = RedisStore(client)
    policy = TenantPolicy(
        request_rate=Rate(1, 1), request_burst=10**6, token_rate=Rate(1000, 1),
        token_burst=10**8, window_limit=10**6, window_ms=60_000, max_concurrency=10**6,
        daily_token_quota=10**12,
    )
    started = time.perf_counter()
    for n in range(300):
        await store.admit("acme", policy, Cost(100, 100), f"l{n}")
    per_call = (time.perf_counter() - started) / 300
    assert per_call < 0.01, per_call


# --- the shaper, through both stores -------------------------------------------------------

shaper_steps = st.lists(st.one_of(
    st.tuples(st.just("advance"), st.one_of(st.integers(0, 30), st.integers(0, 600))),
    st.tuples(st.just("admit")),
    st.tuples(st.just("admit")),
    st.tuples(st.just("admit")),
    st.tuples(st.just("leave"), st.integers(0, 10**6)),  # a held request's client leaves
    st.tuples(st.just("retry")),  # wait exactly the last Retry-After
), min_size=3, max_size=40)


@PARITY
@given(st.data(), st.builds(Rate, st.integers(1, 3), st.integers(20, 500)),
       st.integers(0, 5), starts)
async def test_shaper_rate_backlog_and_retry_after_on_both_stores(
    client: aioredis.Redis, data: st.DataObject, rate: Rate, backlog: int, start: int
) -> None:
    """Memory and Redis give the same answers; requests are sent no faster than the rate,
    at most ``backlog`` wait at once (clients leaving give their slot back), a refusal comes
    only when the backlog is full, and its Retry-After is exact."""
    await client.flushdb()
    clock = FakeClock(start)
    policy = TenantPolicy(shaping_rate=rate, shaping_backlog=backlog)
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]
    sends: dict[str, int] = {}  # lease → the ms its request is sent (until it ends)
    finished: dict[str, int] = {}  # sent and ended: still sent, for the rate
    retry, refusals = 0, 0
    for n, step in enumerate(data.draw(shaper_steps, label="steps")):
        if step[0] in ("advance", "retry"):
            clock.now += step[1] if step[0] == "advance" else retry
            continue
        waiting = sorted(lease for lease, at in sends.items() if at > clock.now)
        assert len(waiting) <= backlog
        if step[0] == "leave":  # a request ends: held (its client left), or sent (finished)
            if sends:
                lease = sorted(sends)[step[1] % len(sends)]
                assert [await s.release("acme", policy, lease, 0) for s in stores] == [True] * 2
                if (sent := sends.pop(lease)) <= clock.now:
                    finished[lease] = sent
            continue
        memory, shared = [await s.admit("acme", policy, Cost(5, 5), f"l{n}") for s in stores]
        assert memory == shared, (step, clock.now)
        if isinstance(memory, Admit):
            sends[memory.lease_id] = clock.now + memory.hold_ms
            event(f"held: {memory.hold_ms > 0}")
            continue
        assert memory.reason is Reason.SHAPING and len(waiting) == backlog
        retry = memory.retry_after_ms or 0
        for store in stores:  # exact for the first refused client; a later one of a herd
            clock.now += retry - 1  # is promised a later slot (limiter.herd)
            early = await store.check_requests("acme", policy)
            assert early is not None or refusals, (step, clock.now)
            assert early is None or early.reason is Reason.SHAPING
            clock.now += 1
            assert await store.check_requests("acme", policy) is None
            clock.now -= retry
        refusals += 1
        event("full")
    assert_never_faster([*sends.values(), *finished.values()], rate)
    usage = [await s.usage("acme", policy) for s in stores]
    assert usage[0] == usage[1]


async def test_one_shaper_across_replicas(client: aioredis.Redis) -> None:
    """Two replicas (two stores on one Redis) hand out slots from one schedule: their
    requests leave one spacing apart, and the backlog is shared."""
    clock = FakeClock()
    policy = TenantPolicy(shaping_rate=Rate(1, 100), shaping_backlog=2)
    replicas = [RedisStore(client, clock=clock), RedisStore(client, clock=clock)]
    holds = []
    for n in range(3):
        admitted = await replicas[n % 2].admit("acme", policy, Cost(1, 1), f"l{n}")
        assert isinstance(admitted, Admit)
        holds.append(admitted.hold_ms)
    assert holds == [0, 100, 200]
    full = await replicas[1].admit("acme", policy, Cost(1, 1), "l3")
    assert isinstance(full, Reject) and (full.reason, full.retry_after_ms) == (Reason.SHAPING,
                                                                               100)
    clock.now += 30
    assert await replicas[0].release("acme", policy, "l2", 0)  # held on one replica, left
    moved = await replicas[1].admit("acme", policy, Cost(1, 1), "l4")  # the other takes it
    assert isinstance(moved, Admit) and moved.hold_ms == 170


# --- coalesced releases ------------------------------------------------------------------


async def test_concurrent_releases_are_coalesced_and_each_is_exact(client: aioredis.Redis) -> None:
    """Releases that arrive together go to Redis in one script call per tenant, and settle
    exactly as one call each would: same answers and same usage as the memory store, a lease
    released twice (or never admitted) answers False, cancels and other tenants apart."""
    clock = FakeClock()
    policy = TenantPolicy(token_rate=Rate(1, 1000), token_burst=10_000, max_concurrency=50,
                          daily_token_quota=10**6)
    memory, shared = MemoryStore(clock), RedisStore(client, clock=clock)
    for store in (memory, shared):
        for n in range(12):
            assert isinstance(await store.admit("acme", policy, Cost(50, 50), f"a{n}"), Admit)
        assert isinstance(await store.admit("beta", policy, Cost(50, 50), "b0"), Admit)
    used = [None, 0, 10, 100, 300, *range(5, 12)]
    calls = [("acme", f"a{n}", u) for n, u in enumerate(used)]
    calls += [("acme", "a3", 7), ("acme", "never", 1), ("beta", "b0", 20)]
    if not isinstance(client, RedisCluster):
        before = (await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    answers = await asyncio.gather(*(shared.release(t, policy, lease, u)
                                     for t, lease, u in calls))
    expected = [await memory.release(t, policy, lease, u) for t, lease, u in calls]
    assert answers == expected == [True] * 12 + [False, False, True]
    if not isinstance(client, RedisCluster):
        after = (await client.info("commandstats"))["cmdstat_evalsha"]["calls"]
        assert after - before == 2  # one call per tenant
    for tenant in ("acme", "beta"):
        assert await shared.usage(tenant, policy) == await memory.usage(tenant, policy)
        assert await shared.in_flight(tenant) == 0
    await asyncio.gather(*(shared.cancel("acme", policy, f"a{n}") for n in range(3)))
    assert await shared.usage("acme", policy) == await memory.usage("acme", policy)


def _count_writes(store: RedisStore) -> list[bytes]:
    """The bytes of each write the store's pipe makes from now on."""
    pipe = store._scripts.pipe
    assert pipe is not None and pipe._protocol is not None
    transport, writes = pipe._protocol.transport, []
    assert transport is not None
    write = transport.write

    def counted(data: bytes) -> None:
        writes.append(bytes(data))
        write(data)

    pipe._protocol.transport = type("Counted", (), {  # type: ignore[assignment]
        "write": staticmethod(counted), "close": transport.close})()
    return writes


async def test_a_release_rides_with_the_next_admission(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release goes to Redis with the next call's write, ahead of it: no write of its own,
    and an admission that follows it finds the slot it freed (concurrency 1)."""
    from limiter.stores import redis_pipe

    client = _client(redis_server.url)
    await client.flushdb()
    store = RedisStore(client, clock=FakeClock())
    policy = TenantPolicy(max_concurrency=1)
    assert isinstance(await store.admit("acme", policy, Cost(1, 1), "first"), Admit)
    assert await store.release("acme", policy, "first", 1)  # (the script loaded)
    monkeypatch.setattr(redis_pipe, "RIDE_LINGER_S", 60.0, raising=False)
    assert isinstance(await store.admit("acme", policy, Cost(1, 1), "a"), Admit)
    writes = _count_writes(store)
    released = store.queue_release("acme", policy, "a", 1)
    await asyncio.sleep(0.01)  # ticks later, within the linger
    assert not writes
    assert isinstance(await store.admit("acme", policy, Cost(1, 1), "b"), Admit)
    assert await released == 1
    assert len(writes) == 1 and writes[0].count(b"EVALSHA") == 2
    await store.close()


async def test_a_lone_release_is_sent_after_the_linger_and_close_sends_at_once(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing else to ride with, a release goes by itself once the linger is over;
    closing the store sends the riding releases at once, not after the linger."""
    from limiter.stores import redis_pipe

    client = _client(redis_server.url)
    await client.flushdb()
    store = RedisStore(client, clock=FakeClock())
    for lease in ("a", "b"):
        assert isinstance(await store.admit("acme", FULL, Cost(1, 1), lease), Admit)
    started = time.monotonic()
    assert await store.queue_release("acme", FULL, "a", 1) == 1
    assert redis_pipe.RIDE_LINGER_S <= time.monotonic() - started < 1.0
    monkeypatch.setattr(redis_pipe, "RIDE_LINGER_S", 60.0)
    released = store.queue_release("acme", FULL, "b", 1)
    await asyncio.sleep(0.05)
    assert not released.done()
    started = time.monotonic()
    await store.close()
    assert released.result() == 1 and time.monotonic() - started < 1.0


async def test_riding_releases_survive_a_script_flush_and_a_dropped_connection(
        redis_server: RedisServer) -> None:
    """A riding release that finds its script gone (``SCRIPT FLUSH``, a restart) is sent
    again the way that loads it; one whose connection is dropped before it is written,
    on a new connection. Each is released exactly once."""
    client = _client(redis_server.url)
    await client.flushdb()
    store = RedisStore(client, clock=FakeClock())
    for lease in ("a", "b", "c"):
        assert isinstance(await store.admit("acme", FULL, Cost(5, 5), lease), Admit)
    await client.script_flush()
    assert await store.queue_release("acme", FULL, "a", 2) == 1
    released = store.queue_release("acme", FULL, "b", 3)
    pipe = store._scripts.pipe
    assert pipe is not None
    pipe.drop()
    assert await released == 1
    assert await store.release("acme", FULL, "b", 3) is False  # exactly once
    assert await store.in_flight("acme") == 1
    await store.close()


async def test_the_pipe_authenticates_and_selects_its_database() -> None:
    """The store's own connection (not redis-py's pool) logs in and uses the URL's db."""
    with RedisServer() as srv:
        admin = _client(srv.url)
        await admin.config_set("requirepass", "s3cret")
        url = srv.url.replace("redis://", "redis://:s3cret@") + "/3"
        client = _client(url)
        store = RedisStore(client, clock=FakeClock())
        assert store._scripts.pipe is not None
        assert isinstance(await store.admit("acme", FULL, Cost(1, 1), "a"), Admit)
        assert await client.exists(*store.keys("acme")) > 0  # in db 3, where client looks
        assert await admin.dbsize() == 0  # db 0 (admin's connection logged in before)
        await store.close()
        await admin.aclose()


@PARITY
@given(st.integers(1, 6), st.integers(50, 2000), st.lists(st.integers(0, 1999), max_size=6),
       st.integers(1, 15), starts)
async def test_a_window_herd_is_admitted_on_its_first_retry_on_both_stores(
    client: aioredis.Redis, limit: int, window: int, offsets: list[int], clients: int,
    start: int,
) -> None:
    """A full sliding window with entries bunched anywhere: memory and Redis promise the same
    slot to each refused client (read from the window's log), and each client that comes
    back at its slot is admitted."""
    await client.flushdb()
    clock = FakeClock(start)
    policy = TenantPolicy(window_limit=limit, window_ms=window)
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]

    async def admit(lease: str) -> Admit | Reject:
        memory, shared = [await s.admit("acme", policy, Cost(1, 1), lease) for s in stores]
        assert memory == shared, (lease, clock.now - start)
        return memory

    for i, offset in enumerate(sorted(o % window for o in offsets)):
        clock.now = start + offset
        if isinstance(await admit(f"a{i}"), Reject):
            break
    else:
        filled = 0
        while isinstance(await admit(f"fill{filled}"), Admit):
            filled += 1
    refused_at = clock.now
    waits = []
    for k in range(clients):
        refused = await admit(f"r{k}")
        assert isinstance(refused, Reject) and refused.retry_after_ms is not None
        waits.append(refused.retry_after_ms)
    for k, wait in enumerate(waits):
        clock.now = refused_at + wait
        assert isinstance(await admit(f"retry{k}"), Admit), (k, waits)


@PARITY
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(2, 12),
       st.lists(st.integers(1, 1000), min_size=2, max_size=12), starts)
async def test_a_herd_over_requests_and_tokens_is_admitted_on_its_first_retry_on_both_stores(
    client: aioredis.Redis, burst: int, per_request_ms: int, token_ms: int, clients: int,
    costs: list[int], start: int,
) -> None:
    """A request rate and a token rate, whichever refuses: memory and Redis promise the same
    slots, and each client that comes back at its slot is admitted (a bucket that did not
    refuse it is scheduled too)."""
    await client.flushdb()
    clock = FakeClock(start)
    policy = TenantPolicy(request_rate=Rate(1, per_request_ms * 100), request_burst=burst,
                          token_rate=Rate(1, token_ms), token_burst=1000)
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]

    async def admit(cost: Cost, lease: str) -> Admit | Reject:
        memory, shared = [await s.admit("acme", policy, cost, lease) for s in stores]
        assert memory == shared, (lease, clock.now - start)
        return memory

    assert isinstance(await admit(Cost(1000, 0), "drain"), Admit)
    herd = [Cost(costs[k % len(costs)], 0) for k in range(clients)]
    waits = []
    for k, cost in enumerate(herd):
        refused = await admit(cost, f"r{k}")
        assert isinstance(refused, Reject) and refused.retry_after_ms is not None
        waits.append(refused.retry_after_ms)
    assume(max(waits) < 60_000)  # past a minute, refused clients share the schedule's end
    for k in sorted(range(clients), key=lambda k: waits[k]):
        clock.now = start + waits[k]
        assert isinstance(await admit(herd[k], f"retry{k}"), Admit), (k, waits)


@PARITY
@given(st.data(), starts)
async def test_a_herd_over_a_window_a_token_rate_and_a_shaper_is_admitted_on_its_first_retry(
    client: aioredis.Redis, data: st.DataObject, start: int,
) -> None:
    """A sliding window and a shaper beside a token rate (each maybe, and maybe a request
    rate), a herd refused at once: memory and Redis promise the same slots, and each client
    that comes back at its slot is admitted (spaced by the token rate alone, a herd found
    the window full, or the shaper's backlog)."""
    await client.flushdb()
    draw = data.draw
    clock = FakeClock(start)
    limits: dict[str, Any] = {"token_rate": Rate(1, draw(st.integers(1, 5))),
                              "token_burst": 1000}
    if draw(st.booleans()):
        limits.update(request_rate=Rate(1, draw(st.integers(1, 300))), request_burst=2)
    if draw(st.booleans()):
        limits.update(window_limit=draw(st.integers(1, 5)), window_ms=draw(st.integers(50, 2000)))
    if draw(st.booleans()):
        limits.update(shaping_rate=Rate(draw(st.integers(1, 5)), draw(st.integers(100, 1500))),
                      shaping_backlog=draw(st.integers(0, 3)))
    policy = TenantPolicy(**limits)
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]

    async def admit(cost: Cost, lease: str) -> Admit | Reject:
        memory, shared = [await s.admit("acme", policy, cost, lease) for s in stores]
        assert memory == shared, (lease, clock.now - start)
        return memory

    for i, tokens in enumerate(draw(st.lists(st.integers(0, 1000), max_size=4))):
        await admit(Cost(tokens, 0), f"a{i}")
    herd = [Cost(tokens, 0) for tokens in draw(st.lists(st.integers(1, 600), min_size=2,
                                                        max_size=10))]
    waits: list[int] = []
    for k, cost in enumerate(herd):
        refused = await admit(cost, f"r{k}")
        if isinstance(refused, Reject):
            assert refused.retry_after_ms is not None
            waits.append(refused.retry_after_ms)
        else:  # admitted after one was refused: a newcomer that found room, not the herd
            assume(not waits)
    herd = herd[len(herd) - len(waits):]
    assume(waits and max(waits) < 60_000)
    for k in sorted(range(len(herd)), key=lambda k: waits[k]):
        clock.now = start + waits[k]
        assert isinstance(await admit(herd[k], f"retry{k}"), Admit), (k, waits)


# --- usage reconciled with the reservation, and the retry slots promised ---------------------

RECONCILED = {  # (ms, lease, cost or None for a release, used, the retry-after-ms expected)
    "a refund, the herd back: a client alone gets the exact wait": [
        (0, "a", Cost(100, 0), None, None), (0, "b", Cost(50, 0), None, 5000),
        (5000, "b", Cost(50, 0), None, None), (5100, "b", None, 0, None),
        (5100, "c", Cost(100, 0), None, 4900), (10_000, "c", Cost(100, 0), None, None)],
    "a refund, the herd out: its schedule moves back": [
        (0, "a", Cost(100, 0), None, None), (0, "b", Cost(50, 0), None, 5000),
        (0, "d", Cost(50, 0), None, 10_000), (5000, "b", Cost(50, 0), None, None),
        (5100, "b", None, 0, None), (5100, "c", Cost(100, 0), None, 9900),
        (10_000, "d", Cost(50, 0), None, None), (15_000, "c", Cost(100, 0), None, None)],
    "a refund partly lost before the herd is back": [
        (0, "a", Cost(100, 0), None, None), (0, "b", Cost(50, 0), None, 5000),
        (100, "a", None, 40, None), (100, "c", Cost(100, 0), None, 9900),
        (5000, "b", Cost(50, 0), None, None), (10_000, "c", Cost(100, 0), None, None)],
    "the schedule's rounding, its client back": [
        (0, "a", Cost(3, 0), None, None), (0, "b", Cost(140, 0), None, 4),
        (4, "b", Cost(140, 0), None, None), (5, "c", Cost(2, 0), None, 2),
        (7, "c", Cost(2, 0), None, None)],
}
RECONCILED_POLICIES = {
    "the schedule's rounding, its client back": TenantPolicy(token_rate=Rate(399, 625),
                                                             token_burst=141),
}


@pytest.mark.parametrize("case", sorted(RECONCILED))
async def test_reconciled_usage_moves_the_retry_slots_alike_on_both_stores(
    client: aioredis.Redis, case: str
) -> None:
    """Refunds and the schedule's rounding (tests/unit/limiter/test_herd.py, the reported
    long retry-after-ms): memory and Redis give the same, exact, answers."""
    await client.flushdb()
    clock = FakeClock()
    start = clock.now
    policy = RECONCILED_POLICIES.get(case, TenantPolicy(token_rate=Rate(10, 1000),
                                                        token_burst=100))
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]
    for at, lease, cost, used, told in RECONCILED[case]:
        clock.now = start + at
        if cost is None:
            assert [await s.release("acme", policy, lease, used) for s in stores] == [True] * 2
            continue
        memory, shared = [await s.admit("acme", policy, cost, lease) for s in stores]
        assert memory == shared, (at, lease)
        if told is None:
            assert isinstance(memory, Admit), (at, lease, memory)
        else:
            assert isinstance(memory, Reject) and memory.retry_after_ms == told, (at, lease)


@PARITY
@given(st.data(), no_concurrency_policies(), starts)
async def test_clients_that_honour_retry_after_get_the_same_answers_and_exact_waits(
    client: aioredis.Redis, data: st.DataObject, policy: TenantPolicy, start: int
) -> None:
    """Refused clients come back when told, requests end using less, as much, more or an
    unknown part of their reservation, or are never served: memory and Redis give the same
    answers throughout (test_retry_after_stays_exact_through_refunds_and_overcharges checks
    these on the memory store), and a last client refused alone, no other refused client
    still out, gets the exact wait through Redis too."""
    await client.flushdb()
    draw = data.draw
    clock = FakeClock(start)
    stores: list[LimiterStore] = [MemoryStore(clock), RedisStore(client, clock=clock)]
    held: dict[str, tuple[int, int]] = {}  # lease → reserved tokens, ms it is sent at
    due: list[tuple[int, int, Cost, int]] = []  # retry ms, n, cost, tries
    out_until, n = -1, 0

    async def admit(cost: Cost, tries: int) -> Admit | Reject:
        nonlocal n, out_until
        n += 1
        memory, shared = [await s.admit("acme", policy, cost, f"l{n}") for s in stores]
        assert memory == shared, (n, clock.now - start)
        if isinstance(memory, Admit):
            held[memory.lease_id] = (cost.tokens, clock.now + memory.hold_ms)
        elif memory.retry_after_ms is not None:
            out_until = max(out_until, clock.now + memory.retry_after_ms)
            if tries < 3:
                heapq.heappush(due, (clock.now + memory.retry_after_ms, n, cost, tries + 1))
        return memory

    cap = policy.token_burst or 3000
    for step in range(draw(st.integers(1, 25))):
        now = clock.now + draw(st.one_of(st.just(0), st.integers(0, 50), st.integers(0, 3000)))
        while due and due[0][0] <= now:
            clock.now, _, cost, tries = heapq.heappop(due)
            await admit(cost, tries)
        clock.now = now
        sent = sorted(lease for lease, (_, at) in held.items() if at <= now)
        if sent and draw(st.booleans()):
            lease = draw(st.sampled_from(sent))
            reserved, _ = held.pop(lease)
            used = draw(st.one_of(st.none(), st.integers(0, reserved),
                                  st.integers(reserved, 2 * reserved + 5)))
            served = draw(st.integers(0, 9)) > 0
            answers = [await s.release("acme", policy, lease, used, served=served)
                       for s in stores]
            assert answers == [True, True], (step, lease)
            continue
        prompt = draw(st.integers(0, cap))
        await admit(Cost(prompt, draw(st.integers(0, cap - prompt)), 1), 0)
    clock.now += draw(st.integers(1, 3000))
    alone = out_until < clock.now
    prompt = draw(st.integers(0, cap))
    cost = Cost(prompt, draw(st.integers(0, cap - prompt)), 1)
    result = await admit(cost, 3)
    event(f"last refusal alone: {alone and isinstance(result, Reject)}")
    if not alone or not isinstance(result, Reject) or result.retry_after_ms is None:
        return
    now, wait = clock.now, result.retry_after_ms
    clock.now = now + wait - 1
    assert isinstance(await admit(cost, 3), Reject)
    clock.now = now + wait
    assert isinstance(await admit(cost, 3), Admit)
