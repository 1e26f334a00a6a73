"""Shared virtual counters on a real redis-server: the same decisions as the memory selector,
one global weighted order across replicas, key hygiene and failure behaviour.

One redis-server serves the module (FLUSHALL between tests); the failure test runs its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from bench.redis_server import RedisServer
from limiter.fairness import MAX_CHARGE
from limiter.stores import Fairness, MemoryFairness, RedisFairness, StoreUnavailable
from tests.unit.limiter.test_fairness import all_backlogged, deviation, req, two_replicas, worst

pytestmark = pytest.mark.redis


def _client(url: str) -> aioredis.Redis:
    """Short timeouts, one quick retry: a dead Redis must fail fast."""
    return aioredis.Redis.from_url(
        url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 1)
    )


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis_server.flushall()
    redis_client = _client(redis_server.url)
    yield redis_client
    await redis_client.aclose()


def shared(client: aioredis.Redis, **kwargs: object) -> RedisFairness:
    return RedisFairness(client, owns_client=False, **kwargs)  # type: ignore[arg-type]


# --- the simulations --------------------------------------------------------------------


async def test_backlogged_tenants_get_tokens_in_proportion_to_weight(
    client: aioredis.Redis,
) -> None:
    tokens = await all_backlogged(shared(client), 3000, seed=5)
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

offer = st.lists(
    st.tuples(st.sampled_from("ABCDE"), st.integers(0, 5000),
              st.sampled_from([0.5, 1, 3, 5, 7.5]), st.integers(0, 3)),
    min_size=1, max_size=5,
)
step = st.one_of(st.tuples(st.just("activate"), st.sampled_from("ABCDE")),
                 st.tuples(st.just("choose"), offer))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(step, max_size=40))
async def test_same_decisions_as_memory(client: aioredis.Redis, steps: list[tuple]) -> None:
    """Any sequence of activations and offers (duplicate tenants, equal counters and enqueue
    times included) gets the same choices and the same counters from both selectors."""
    await client.flushdb()
    memory, redis_fair = MemoryFairness(), shared(client)
    for tenant in "AB":  # V > 0 from the start, so "no counter yet = V" matters
        await memory.choose([req(f"warm{tenant}", tenant, cost=999)], 0)
        await redis_fair.choose([req(f"warm{tenant}", tenant, cost=999)], 0)
    for n, (kind, arg) in enumerate(steps):
        if kind == "activate":
            await memory.activate(arg)
            await redis_fair.activate(arg)
            continue
        items = [req(f"{n}.{i}", t, cost, at, weight) for i, (t, cost, weight, at)
                 in enumerate(arg)]
        assert (await redis_fair.choose(items, 0)).id == (await memory.choose(items, 0)).id
    assert await redis_fair.counters() == await memory.counters()
    assert await redis_fair.virtual_time() == memory.virtual_time


async def test_rebasing_in_lua_matches_memory(client: aioredis.Redis) -> None:
    """Charges near MAX_CHARGE force several rebases; Lua shifts exactly like Python."""
    memory = MemoryFairness(rebase_at=2 * MAX_CHARGE)
    redis_fair = shared(client, rebase_at=2 * MAX_CHARGE)
    rebases, last_v = 0, 0.0
    for n in range(40):
        items = [req(f"{n}{t}", t, (10**9 - 997 * n) * int(w), n)
                 for t, w in (("A", 5), ("B", 3), ("C", 1))]
        assert (await redis_fair.choose(items, n)).id == (await memory.choose(items, n)).id
        rebases += memory.virtual_time < last_v
        last_v = memory.virtual_time
        assert await redis_fair.virtual_time() == last_v
    assert await redis_fair.counters() == await memory.counters()
    assert rebases >= 3


# --- keys, TTLs, failures -------------------------------------------------------------------


async def test_keys_share_one_hash_tag_per_pool_and_expire(client: aioredis.Redis) -> None:
    fair = shared(client, prefix="kv", pool="gpu-{a}", ttl_ms=5000)
    await fair.activate("t")
    await fair.choose([req("x", "t")], 0)
    keys = fair.keys()
    assert keys[0] == "kv:{kv:fair:gpu-%7Ba%7D}:c"
    assert len({key_slot(key.encode()) for key in keys}) == 1
    for key in keys:
        assert 0 < await client.pttl(key) <= 5000
    other = shared(client, prefix="kv", pool="cpu")
    assert await other.counters() == {} and await other.virtual_time() == 0


async def test_idle_tenants_are_forgotten_after_the_ttl(client: aioredis.Redis) -> None:
    fair = shared(client, ttl_ms=150)
    await fair.choose([req("x", "old", cost=5)], 0)
    await asyncio.sleep(0.2)
    assert await client.exists(*fair.keys()) == 0  # the whole pool expired
    await fair.choose([req("y", "old", cost=5)], 0)
    await asyncio.sleep(0.1)
    await fair.choose([req("z", "new", cost=5)], 0)
    await asyncio.sleep(0.1)
    await fair.activate("new")  # "old" last used 200 ms ago: pruned
    assert set(await fair.counters()) == {"new"}


async def test_redis_errors_become_store_unavailable() -> None:
    with RedisServer() as srv:
        fair: Fairness = RedisFairness(_client(srv.url))
        await fair.activate("a")
        srv.kill()
        for call in (fair.activate("a"), fair.choose([req("x", "a")], 0), fair.counters()):
            with pytest.raises(StoreUnavailable):
                await call
        await fair.close()
    assert isinstance(fair, Fairness)
