"""The failover store through real Redis faults: a paused server (SIGSTOP), a killed one
(SIGKILL) and its restart on the same port, with and without load.

What must hold under every failure policy: nothing a timed-out call took stays in Redis, the
failover store's bookkeeping empties once every request has ended, and concurrency is exact
again within 1 s of Redis answering.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from bench.redis_server import RedisServer
from extproc.config import RedisSettings
from extproc.wiring import redis_client
from limiter import Admit, Cost, Rate, Reason, Reject, TenantPolicy
from limiter.breaker import CircuitBreaker
from limiter.stores import FailoverStore, FailurePolicy, StoreUnavailable
from limiter.stores.redis_store import RedisStore

pytestmark = pytest.mark.redis

POLICIES = ["fail_open", "fail_closed", "local"]
HOUR_MS = 3_600_000
# slow refills: a charge left behind is still visible a second later
SLOW = TenantPolicy(
    request_rate=Rate(1, HOUR_MS), request_burst=100,
    token_rate=Rate(1, HOUR_MS), token_burst=100_000,
    window_limit=1000, window_ms=HOUR_MS, daily_token_quota=10**9, max_concurrency=2,
)
COST = Cost(10, 20)
_ids = itertools.count()


def lease() -> str:
    return f"t-{next(_ids)}"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
async def raw(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.url, socket_timeout=5)
    yield client
    await client.aclose()


def failover(server: RedisServer, policy: str, timeout_ms: int = 50) -> FailoverStore:
    """The store kvgate builds: its Redis client, a short budget and a quick breaker."""
    settings = RedisSettings(url=server.url, timeout_ms=timeout_ms, failure_policy=policy)
    return FailoverStore(
        RedisStore(redis_client(settings), lease_ttl_ms=60_000),
        policy=FailurePolicy(policy), timeout_s=timeout_ms / 1000,
        breaker=CircuitBreaker(3, 200),
    )


async def leftovers(raw: aioredis.Redis) -> dict[str, object]:
    """Every key in Redis but the tombstones of cancelled admissions, with its contents."""
    found: dict[str, object] = {}
    for key in await raw.keys("*"):
        kind = (await raw.type(key)).decode()
        if key.endswith(b":cancelled"):
            continue
        found[key.decode()] = (
            await raw.zrange(key, 0, -1) if kind == "zset" else await raw.hgetall(key)
        )
    return found


async def until_clean(raw: aioredis.Redis, store: FailoverStore, within_s: float = 1.0) -> None:
    """Redis holds no lease and no charge, and the store remembers nothing, within a bound."""
    deadline = time.monotonic() + within_s
    while (left := await leftovers(raw)) or not store.idle():
        assert time.monotonic() < deadline, (left, store.debug())
        await asyncio.sleep(0.02)


async def settle(store: FailoverStore, within_s: float = 2.0) -> None:
    """Wait for the store's repairs (it talks to Redis in the background) to finish."""
    deadline = time.monotonic() + within_s
    while not store.idle():
        assert time.monotonic() < deadline, store.debug()
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("policy", POLICIES)
async def test_admission_timed_out_on_a_paused_redis_leaves_nothing(server, raw, policy):
    store = failover(server, policy)
    warm = lease()  # a pooled connection, so the paused call is sent, not stuck connecting
    assert isinstance(await store.admit("acme", SLOW, COST, warm), Admit)
    assert await store.release("acme", SLOW, warm, COST.tokens)
    await raw.flushall()
    server.pause()
    try:
        doomed = lease()
        try:
            decision = await store.admit("acme", SLOW, COST, doomed)
        except StoreUnavailable:
            assert policy == "fail_closed"
        else:
            assert isinstance(decision, Admit) and policy != "fail_closed"
            await store.release("acme", SLOW, doomed, 5)  # served while Redis hung
    finally:
        server.resume()
    await until_clean(raw, store)  # the admission that ran late was undone
    await store.close()


async def test_release_timed_out_on_a_paused_redis_is_sent_again(server, raw):
    store = failover(server, "local")
    held = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, held), Admit)
    server.pause()
    try:
        await store.release("acme", SLOW, held, COST.tokens)
    finally:
        server.resume()
    deadline = time.monotonic() + 1
    while await raw.zcard(store.primary.keys("acme")[4]):
        assert time.monotonic() < deadline, "the lease stayed in Redis"
        await asyncio.sleep(0.02)
    await settle(store)
    await store.close()


@pytest.mark.parametrize("policy", POLICIES)
async def test_restart_with_leases_held_keeps_concurrency_exact(server, raw, policy):
    store = failover(server, policy)
    held = [lease(), lease()]
    for lease_id in held:
        assert isinstance(await store.admit("acme", SLOW, COST, lease_id), Admit)
    server.kill()
    server.start()  # empty: the two leases are gone from Redis
    for _ in range(4):  # each would find a dead pooled connection first
        decision = await store.admit("acme", SLOW, COST, lease())
        assert isinstance(decision, Reject) and decision.reason is Reason.CONCURRENCY
    assert await raw.zcard(store.primary.keys("acme")[4]) == 2  # re-asserted
    assert await store.release("acme", SLOW, held[0], 1)
    again = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, again), Admit)
    for lease_id in (held[1], again):
        assert await store.release("acme", SLOW, lease_id, 1)
    await settle(store)
    assert not await raw.zcard(store.primary.keys("acme")[4])
    await store.close()
