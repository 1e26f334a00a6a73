"""The failover store on a real 3-shard Redis Cluster with one shard hung (SIGSTOP): each
node is its own failure domain. Tenants on the healthy shards keep their exact global
limits, and what is owed to Redis reaches the healthy shards while the hung one is retried.

Every pause on the ``cluster`` fixture stays under its node timeout (2 s), so the other
shards keep serving (past it, the cluster as a whole refuses commands: Redis's own full
coverage). The ``replicated`` fixture gives each primary a replica, promoted when its
primary is gone for its node timeout (1 s), and lets the other shards serve meanwhile
(``cluster-require-full-coverage no``, as the README recommends)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator

import pytest

from bench.redis_server import RedisCluster, RedisServer, role
from extproc.config import RedisSettings
from extproc.wiring import redis_client
from limiter import Admit, Cost, Rate, Reject, TenantPolicy
from limiter.breaker import CircuitBreaker
from limiter.outcome import Reason
from limiter.stores import FailoverStore, FailurePolicy, StoreUnavailable
from limiter.stores.redis_store import RedisStore

pytestmark = pytest.mark.redis

HOUR_MS = 3_600_000
POLICY = TenantPolicy(request_rate=Rate(1, HOUR_MS), request_burst=1000, max_concurrency=2)
COST = Cost(10, 20)
_ids = itertools.count()


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(3) as running:  # its own: these tests hang its nodes
        yield running


@pytest.fixture
def replicated() -> Iterator[RedisCluster]:
    with RedisCluster(3, replicas=1, node_timeout_ms=1000,
                      extra_args=("--cluster-require-full-coverage", "no")) as running:
        yield running


def failover(cluster: RedisCluster, policy: str, failures: int = 3,
             timeout_ms: int = 50) -> FailoverStore:
    settings = RedisSettings(url=cluster.url, cluster=True, timeout_ms=timeout_ms,
                             failure_policy=policy)
    return FailoverStore(RedisStore(redis_client(settings)), policy=FailurePolicy(policy),
                         timeout_s=timeout_ms / 1000, breaker=CircuitBreaker(failures, 200))


async def on_two_nodes(store: FailoverStore, cluster: RedisCluster
                       ) -> tuple[str, RedisServer, str, RedisServer]:
    """Two tenants whose keys live on different nodes, and those nodes; the store is warm
    (see ``warm``)."""
    await warm(store, "t0")  # the client reads the slot table
    by_node: dict[str, str] = {}
    for name in (f"t{i}" for i in range(100)):
        by_node.setdefault(store.primary.domain(name), name)
        if len(by_node) == 2:
            break
    (node_a, a), (node_b, b) = by_node.items()
    await warm(store, a, b)
    ports = {str(n.port): n for n in cluster.nodes}
    return a, ports[node_a.rsplit(":", 1)[1]], b, ports[node_b.rsplit(":", 1)[1]]


async def warm(store: FailoverStore, *tenants: str) -> None:
    """Open the connections to the tenants' nodes before a test starts counting. A first
    call reads the slot table and connects, which on a busy machine can run past the 50 ms
    call budget: that is a failure the test did not cause (a breaker count, a re-assert).
    So the primary is called directly until it answers, then once through the store (its
    success closes the breakers), and the repair a failure may have started is waited for."""
    deadline = time.monotonic() + 10
    for tenant in tenants:
        while True:
            try:
                await store.primary.in_flight(tenant)
                break
            except (StoreUnavailable, TimeoutError, OSError):
                assert time.monotonic() < deadline, "the cluster never answered"
                await asyncio.sleep(0.05)
    for tenant in tenants:
        await store.in_flight(tenant)

    async def repaired() -> bool:
        return not store.debug()["reassert"]
    await until(repaired, within_s=2.0)


async def close(store: FailoverStore) -> None:
    """A node just resumed answers what queued while it hung first: its connections may
    take longer than the call budget to close (nothing is owed by then)."""
    with contextlib.suppress(StoreUnavailable):
        await store.close()


def lease() -> str:
    return f"l-{next(_ids)}"


async def until(check, within_s: float = 1.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_a_hung_shard_sends_only_its_own_tenants_to_the_failure_policy(cluster):
    """One breaker for the whole cluster opened on the hung shard's failures: every
    tenant got 503 under fail_closed (and, under local, replicas admitted past limits)."""
    store = failover(cluster, "fail_closed")
    a, node_a, b, _ = await on_two_nodes(store, cluster)
    node_a.pause()
    try:
        for _ in range(4):
            with pytest.raises(StoreUnavailable):
                await store.admit(a, POLICY, COST, lease())
        # the healthy shard's tenant: exact, in Redis, from its first call on (it was
        # refused once: the scripts' first call there loaded them with SCRIPT LOAD, which
        # the cluster client sends to every primary, the hung one too)
        for _ in range(6):
            held = lease()
            assert isinstance(await store.admit(b, POLICY, COST, held), Admit)
            assert store.debug()["held"][held] == "primary"
            assert await store.release(b, POLICY, held, 30)
        assert store.breakers_open() == 1 and store._breaker(b).state == "closed"
    finally:
        node_a.resume()
    await close(store)


async def test_a_node_that_lacks_the_scripts_answers_while_another_hangs(cluster):
    """A node without the scripts (a new cluster here; a replica just promoted, a restarted
    node) answers NOSCRIPT to their first call: redis-py's script objects then sent SCRIPT
    LOAD, which the cluster client sends to every primary, so each script's first call
    there waited for the hung node and failed (one 503 each under fail_closed). EVAL, on
    the tenant's own node, loads it instead."""
    store = failover(cluster, "fail_closed", timeout_ms=250)
    a, node_a, b, _ = await on_two_nodes(store, cluster)
    node_a.pause()
    try:
        with pytest.raises(StoreUnavailable):
            await store.admit(a, POLICY, COST, lease())
        held = lease()
        assert await store.check_requests(b, POLICY) is None  # (no round trip)
        assert isinstance(await store.admit(b, POLICY, COST, held), Admit)
        assert store.debug()["held"][held] == "primary"
        await store.renew(b, [held])
        assert await store.in_flight(b) == 1
        assert (await store.usage(b, POLICY))["store"] == "redis"
        assert await store.release(b, POLICY, held, 30)
        assert store._breaker(b).state == "closed" and held not in store.debug()["owed"]
    finally:
        node_a.resume()
    await close(store)


async def test_leases_reasserted_on_a_healthy_shard_count_there_while_another_hangs(cluster):
    """A repair round that failed on one shard adopted no tenant's leases: those the other
    shards had taken back stayed counted in memory, were released only there, and Redis
    held them (a concurrency slot each) until the lease TTL."""
    store = failover(cluster, "local", failures=1)
    a, node_a, b, node_b = await on_two_nodes(store, cluster)
    node_a.pause()
    node_b.pause()
    try:
        held_a, timed_out, held_b = lease(), lease(), lease()
        assert isinstance(await store.admit(a, POLICY, COST, held_a), Admit)  # from memory
        assert isinstance(await store.admit(b, POLICY, COST, timed_out), Admit)  # (opens b's)
        assert isinstance(await store.admit(b, POLICY, COST, held_b), Admit)  # never asked
        node_b.resume()

        async def adopted() -> bool:
            return store.debug()["held"][held_b] == "primary"

        await until(adopted)  # while a's shard still hangs: b's leases count in Redis
        for held in (timed_out, held_b):
            await store.release(b, POLICY, held, 30)

        async def released() -> bool:
            return await store.primary.in_flight(b) == 0

        await until(released)  # in Redis, not in memory only
    finally:
        node_a.resume()
    await store.release(a, POLICY, held_a, 30)
    await close(store)


async def test_what_is_owed_to_a_healthy_shard_is_sent_while_another_hangs(cluster):
    """The repair loop sent the first 64 things owed, in order: a hung shard's cancels
    came first, failed every round, and a healthy shard's release waited behind them."""
    store = failover(cluster, "local", failures=1000)
    a, node_a, b, node_b = await on_two_nodes(store, cluster)
    node_a.pause()
    node_b.pause()
    try:
        # 70 admissions of a at once: two served from memory, the rest refused there,
        # each owing Redis a cancel (its call timed out: it may still run there)
        await asyncio.gather(*(store.admit(a, POLICY, COST, lease()) for _ in range(70)))
        held_b = lease()
        assert isinstance(await store.admit(b, POLICY, COST, held_b), Admit)
        await store.release(b, POLICY, held_b, 30)  # owed: its admission may have run
        assert held_b in store.debug()["owed"]
        node_b.resume()

        async def sent() -> bool:
            return held_b not in store.debug()["owed"]

        await until(sent)  # while a's shard still hangs
    finally:
        node_a.resume()
    await close(store)


async def test_a_reassert_cut_short_still_releases_what_it_put_back(cluster, monkeypatch):
    """A re-assert round cut short by its budget (a repair round's, or an admission's after
    LeasesLost: a shard slow to answer, as one just resumed is) had its renewals in Redis
    but marked none of their leases: one the fallback admitted and released meanwhile was
    released in memory only, and Redis held it (a concurrency slot) until the lease TTL.
    Seen under load: 2-14 slots per tenant after a shard paused 0.5 s under fail_open."""
    from limiter.stores import failover as module

    monkeypatch.setattr(module, "REPAIR_TIMEOUT_S", 0.1)
    store = failover(cluster, "fail_open", failures=1, timeout_ms=300)
    a, node_a, _b, _ = await on_two_nodes(store, cluster)
    renew = store.primary.renew

    async def slow_renew(tenant: str, lease_ids: list[str], *, reassert: bool = False) -> None:
        await renew(tenant, lease_ids, reassert=reassert)  # it runs in Redis...
        await asyncio.sleep(1)  # ... and its answer is late: past the round's budget

    node_a.pause()
    try:
        timed_out, passed = lease(), lease()
        assert isinstance(await store.admit(a, POLICY, COST, timed_out), Admit)  # opens it
        assert isinstance(await store.admit(a, POLICY, COST, passed), Admit)  # never asked
        assert store.debug()["held"][passed] == "open"
        monkeypatch.setattr(store.primary, "renew", slow_renew)
    finally:
        node_a.resume()
    await asyncio.sleep(0.3)  # repair rounds put both back in Redis, each cut short
    assert await store.primary.in_flight(a) == 2
    for held in (timed_out, passed):
        assert await store.release(a, POLICY, held, 1)
    monkeypatch.setattr(store.primary, "renew", renew)
    await until(lambda: _idle(store), within_s=3.0)
    assert await store.primary.in_flight(a) == 0
    await close(store)


async def test_a_release_owed_keeps_its_tokens_when_a_reassert_answers_after_it(
        cluster, monkeypatch):
    """A release owed to Redis (its shard's breaker open) carries the tokens the request
    used; a re-assert answered after that release owes it again, knowing no tokens, and
    replaced it: Redis then settled the reservation as if all of it was used (tokens and
    quota overcharged by reservation minus usage; seen under load after a shard paused
    0.5 s, 8-26 tokens a tenant)."""
    from limiter.stores import failover as module

    monkeypatch.setattr(module, "REPAIR_TIMEOUT_S", 5.0)  # (the late answer is not cut)
    settings = RedisSettings(url=cluster.url, cluster=True, timeout_ms=300)
    store = FailoverStore(RedisStore(redis_client(settings)), policy=FailurePolicy.LOCAL,
                          timeout_s=0.3, breaker=CircuitBreaker(1, 10_000))
    a, node_a, _b, _ = await on_two_nodes(store, cluster)
    quota = dataclasses.replace(POLICY, daily_token_quota=1_000_000)
    held = lease()
    assert isinstance(await store.admit(a, quota, COST, held), Admit)  # reserves 30
    renew, waiting, answer = store.primary.renew, asyncio.Event(), asyncio.Event()

    async def late_renew(tenant: str, lease_ids: list[str], *, reassert: bool = False) -> None:
        await renew(tenant, lease_ids, reassert=reassert)  # it runs in Redis...
        waiting.set()
        await answer.wait()  # ... and its answer comes after the release below

    monkeypatch.setattr(store.primary, "renew", late_renew)
    node_a.pause()
    try:
        timed_out = lease()  # opens a's breaker; a re-assert of every lease is due
        assert isinstance(await store.admit(a, quota, COST, timed_out), Admit)
    finally:
        node_a.resume()
    await asyncio.wait_for(waiting.wait(), 3)
    assert await store.release(a, quota, held, 5)  # breaker open: owed, with its 5 tokens
    assert store.debug()["owed"][held] == "release"
    answer.set()
    monkeypatch.setattr(store.primary, "renew", renew)
    await store.release(a, quota, timed_out, 5)  # cancelled there; its 5 tokens charged
    await until(lambda: _idle(store), within_s=3.0)
    usage = await store.primary.usage(a, quota)
    assert usage["quotas"]["daily"]["used"] == 10 and usage["in_flight"] == 0
    await close(store)


async def test_a_node_no_tenant_maps_to_any_more_is_forgotten(cluster, monkeypatch):
    """After a failover a node's slots are served elsewhere: its breaker, open when it went,
    had nothing left to probe it and kept kvgate_store_breaker_open at 1 for good (a false
    KvgateRedisBypassed alert)."""
    from limiter.stores import failover as module

    monkeypatch.setattr(module, "BREAKER_IDLE_MS", 300)
    store = failover(cluster, "local")
    a, node_a, _b, _ = await on_two_nodes(store, cluster)
    node_a.pause()
    try:
        for _ in range(3):
            await store.admit(a, POLICY, COST, lease())
        assert store.breakers_open() == 1
    finally:
        node_a.resume()
    await asyncio.sleep(0.4)  # no call asked for that node since
    assert store.breakers_open() == 0
    await close(store)


async def test_a_cluster_no_node_answers_is_served_by_the_failure_policy(cluster):
    """redis-py's cluster client raises RedisClusterUnreachableError when no node answers
    (the node the url names is down as the process starts, or every node is gone): it is
    no RedisError, so it went through every store — each admission was answered 503
    internal_error (with a traceback logged) whatever failure_policy said, no breaker
    opened, and the fair queue's and the RLS's calls failed the same way."""
    from limiter.ratelimit import Hit, Limit
    from limiter.stores.fairness import RedisFairness
    from limiter.stores.ratelimit import RedisRateCounters

    cluster.nodes[0].kill()  # the node the url names
    store = failover(cluster, "local", failures=2)
    for _ in range(3):
        held = lease()
        assert isinstance(await store.admit("t0", POLICY, COST, held), Admit)
        assert store.debug()["held"][held] == "local"
        await store.release("t0", POLICY, held, 1)
    assert store.breakers_open() == 1
    settings = RedisSettings(url=cluster.url, cluster=True, timeout_ms=50)
    fairness = RedisFairness(redis_client(settings))
    with pytest.raises(StoreUnavailable):
        await fairness.activate("t0")
    with pytest.raises(StoreUnavailable):
        await fairness.counters()
    counters = RedisRateCounters(redis_client(settings))
    with pytest.raises(StoreUnavailable):
        await counters.hit("d", [Hit("k", Limit(10, "minute"), 1)], "call-1")
    for closing in (store.close(), fairness.close(), counters.close()):
        with contextlib.suppress(StoreUnavailable):
            await closing


async def test_every_node_gone_is_served_by_the_failure_policy(cluster):
    """Once a slot-table refresh reached no node, the cluster client raises
    RedisClusterUnreachableError for every call (no RedisError): it went through the
    failover store (503 internal_error each) instead of opening the breakers and serving by
    the policy."""
    store = failover(cluster, "local", failures=2)
    a, _node_a, _b, _ = await on_two_nodes(store, cluster)
    assert store.debug() == {"held": {}, "owed": {}, "reassert": False}
    for node in cluster.nodes:
        node.kill()
    for _ in range(6):  # connection errors first, then the client's own outage error
        held = lease()
        assert isinstance(await store.admit(a, POLICY, COST, held), Admit)
        assert store.debug()["held"][held] == "local"
        await store.release(a, POLICY, held, 1)
        await asyncio.sleep(0.3)  # (the client refreshes its slot table at most 1/s)
    assert store.breakers_open() >= 1
    await close(store)


def on_node(store: FailoverStore, node: RedisServer, not_on: RedisServer | None = None) -> str:
    """A tenant whose keys live on ``node`` (or, with ``not_on``, anywhere else)."""
    for name in (f"t{i}" for i in range(1000)):
        port = int(store.primary.domain(name).rsplit(":", 1)[1])
        if (port != not_on.port) if not_on is not None else (port == node.port):
            return name
    raise AssertionError("no tenant maps there")


async def lease_keys(cluster: RedisCluster) -> list[bytes]:
    """Every lease set left in the cluster (an empty one is deleted)."""
    client = redis_client(RedisSettings(url=cluster.nodes[1].url, cluster=True,
                                        timeout_ms=1000))
    try:
        keys = await client.keys("*:leases", target_nodes=client.PRIMARIES)
    finally:
        await client.aclose()
    return [key for found in (keys.values() if isinstance(keys, dict) else [keys])
            for key in (found if isinstance(found, list) else [found])]


async def test_a_primary_killed_fails_over_to_its_replica(replicated, monkeypatch):
    """SIGKILL a primary with a replica: its tenants go to the failure policy until the
    replica is promoted and the client reads the new slot table (no restart), the other
    shards' tenants never do; leases the dead primary took but never replicated are
    re-asserted by the replica holding them, so nobody is admitted on top of them; the
    dead node's breaker is forgotten, and nothing is left once every lease is released."""
    from limiter.stores import failover as module

    monkeypatch.setattr(module, "BREAKER_IDLE_MS", 300)
    cluster = replicated
    primary, replica = cluster.nodes[0], cluster.replicas[0][0]
    a_store, b_store = (failover(cluster, "fail_closed", timeout_ms=250) for _ in range(2))
    await warm(a_store, "t0")
    await warm(b_store, "t0")
    a, b = on_node(a_store, primary), on_node(a_store, primary, not_on=primary)
    held = [lease()]
    assert isinstance(await a_store.admit(a, POLICY, COST, held[0]), Admit)
    await until_true(lambda: cluster.synced(0))
    replica.pause()  # the primary drops its replica: what it admits now is never replicated
    assert primary.command("CLIENT", "KILL", "TYPE", "replica").startswith(b":1")
    held.append(lease())
    assert isinstance(await a_store.admit(a, POLICY, COST, held[1]), Admit)  # a's limit: 2
    primary.kill()
    killed = time.monotonic()
    replica.resume()
    answered = None
    while answered is None:
        assert time.monotonic() - killed < 10, "the replica's slots never came back"
        for store in (a_store, b_store):  # the healthy shard's tenant: exact, in Redis
            healthy = lease()
            assert isinstance(await store.admit(b, POLICY, COST, healthy), Admit)
            assert store.debug()["held"][healthy] == "primary"
            assert await store.release(b, POLICY, healthy, 1)
        with contextlib.suppress(StoreUnavailable):  # fail_closed, until a's slot answers
            answered = await a_store.admit(a, POLICY, COST, lease())
        await asyncio.sleep(0.05)
    # the promoted replica lacked held[1]: Redis said so (LeasesLost), a_store put it back
    assert a_store.primary.domain(a) == f"127.0.0.1:{replica.port}"
    assert isinstance(answered, Reject) and answered.reason == Reason.CONCURRENCY
    # b_store reads the new slot table on its own (within its 1 s watch, or at its first
    # refused connection): until then a's tenant meets b_store's failure policy, never a pass
    deadline, answered = time.monotonic() + 5, None
    while answered is None:
        assert time.monotonic() < deadline, "b_store never read the new slot table"
        with contextlib.suppress(StoreUnavailable):
            answered = await b_store.admit(a, POLICY, COST, lease())
        await asyncio.sleep(0.05)
    assert isinstance(answered, Reject) and answered.reason == Reason.CONCURRENCY
    assert await a_store.in_flight(a) == 2
    await asyncio.sleep(0.4)
    assert a_store.breakers_open() == b_store.breakers_open() == 0  # the dead node's: gone
    for held_id in held:
        assert await a_store.release(a, POLICY, held_id, 5)
    for store in (a_store, b_store):
        await until(lambda store=store: _idle(store))
    assert await b_store.in_flight(a) == 0 and await b_store.in_flight(b) == 0
    assert await lease_keys(cluster) == []
    for store in (a_store, b_store):
        await close(store)


async def test_a_primary_hung_past_the_node_timeout_is_failed_over_and_rejoins(replicated):
    """SIGSTOP a primary for longer than the node timeout: its replica is promoted while it
    is frozen, and it rejoins as a replica when it resumes, running first what was queued
    on it meanwhile. Two replicas of kvgate admitting the same tenant all along never hold
    more than its limit between them, before, during or after the split, and nothing is
    left once every lease is released."""
    cluster = replicated
    primary, replica = cluster.nodes[0], cluster.replicas[0][0]
    stores = [failover(cluster, "fail_closed", timeout_ms=250) for _ in range(2)]
    for store in stores:
        await warm(store, "t0")
    a = on_node(stores[0], primary)
    first = lease()
    assert isinstance(await stores[0].admit(a, POLICY, COST, first), Admit)
    held: dict[str, FailoverStore] = {first: stores[0]}
    await until_true(lambda: cluster.synced(0))
    peak = 0

    async def admit_all() -> None:
        nonlocal peak
        for store in stores:
            lease_id = lease()
            with contextlib.suppress(StoreUnavailable):
                if isinstance(await store.admit(a, POLICY, COST, lease_id), Admit):
                    held[lease_id] = store
        peak = max(peak, len(held))
        assert peak <= POLICY.max_concurrency

    primary.pause()
    paused = time.monotonic()
    try:
        while role(replica.port) != b"master" or time.monotonic() - paused < 4:
            assert time.monotonic() - paused < 10, "the replica was never promoted"
            await admit_all()
            await asyncio.sleep(0.05)
    finally:
        primary.resume()
    while role(primary.port) != b"slave" or not cluster.synced(0):  # it rejoined
        await admit_all()
        await asyncio.sleep(0.05)
    for _ in range(10):
        await admit_all()
    assert peak == len(held) == POLICY.max_concurrency  # admitted up to the limit, exactly
    assert await stores[1].in_flight(a) == len(held)
    for lease_id, store in held.items():
        await store.release(a, POLICY, lease_id, 5)
    for store in stores:
        await until(lambda store=store: _idle(store))
    assert await stores[1].in_flight(a) == 0
    assert await lease_keys(cluster) == []
    for store in stores:
        await close(store)


async def _idle(store: FailoverStore) -> bool:
    return store.idle()


async def until_true(check, within_s: float = 5.0) -> None:
    """``until`` for a plain (blocking, quick) check."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def cut_replica_link(cluster: RedisCluster, shard: int = 0) -> None:
    """From now on what the shard's primary writes never reaches its replica (paused, its
    link dropped), as when a primary dies with writes it has not replicated yet; the
    replica resumes once the primary is killed, and is promoted in its place."""
    await until_true(lambda: cluster.synced(shard))
    cluster.replicas[shard][0].pause()
    assert cluster.nodes[shard].command("CLIENT", "KILL", "TYPE", "replica").startswith(b":1")


def kill_primary(cluster: RedisCluster, shard: int = 0) -> None:
    cluster.nodes[shard].kill()
    cluster.replicas[shard][0].resume()


async def promoted(cluster: RedisCluster, shard: int = 0) -> float:
    """Wait for the replica's promotion; when it was seen."""
    replica = cluster.replicas[shard][0]
    await until_true(lambda: role(replica.port) == b"master", within_s=10)
    return time.monotonic()


async def test_leases_the_new_primary_lacks_are_put_back_though_no_call_failed(replicated):
    """A primary dies with two leases it never replicated, and the kvgate process holding
    them makes no call to that shard: nothing told it, so nothing put them back until its
    next renewal (lease_ttl_s / 3, 20 s by default) and another process was admitted on
    top of them (4 held against a limit of 2). The topology watch sees the slots' new
    primary and puts them back within a few seconds of the promotion."""
    cluster = replicated
    a_store, b_store = (failover(cluster, "fail_closed", timeout_ms=250) for _ in range(2))
    await warm(a_store, "t0")
    await warm(b_store, "t0")
    a = on_node(a_store, cluster.nodes[0])
    await asyncio.sleep(0.1)  # (a's watch has read the slot map)
    await cut_replica_link(cluster)
    held = [lease(), lease()]
    for lease_id in held:
        assert isinstance(await a_store.admit(a, POLICY, COST, lease_id), Admit)
    kill_primary(cluster)
    since = await promoted(cluster)
    refused = None
    while refused is None:  # b asks for a's tenant; what it gets it gives back at once
        assert time.monotonic() - since < 3, "the lost leases were never put back"
        with contextlib.suppress(StoreUnavailable):  # (until b reads the new slot table)
            got = await b_store.admit(a, POLICY, COST, lease())
            if isinstance(got, Admit):
                assert await b_store.release(a, POLICY, got.lease_id, 1)
            else:
                refused = got
        await asyncio.sleep(0.05)
    assert refused.reason == Reason.CONCURRENCY
    assert await b_store.in_flight(a) == 2
    assert isinstance(await b_store.admit(a, POLICY, COST, lease()), Reject)
    for lease_id in held:
        assert await a_store.release(a, POLICY, lease_id, 5)
    for store in (a_store, b_store):
        await until(lambda store=store: _idle(store))
    assert await b_store.in_flight(a) == 0
    assert await lease_keys(cluster) == []
    for store in (a_store, b_store):
        await close(store)


async def test_releases_and_cancels_the_new_primary_lacks_are_sent_again(replicated):
    """A primary dies with a release and a cancel it acknowledged but never replicated:
    their leases held a concurrency slot each on the promoted replica until lease_ttl_s
    (60 s by default). The store sends its recent releases and cancels of the tenants
    whose primary changed again: the slots are free within a few seconds of the
    promotion, and what the resent ones settle counts once (a release Redis already had
    is not refunded twice)."""
    cluster = replicated
    policy = dataclasses.replace(POLICY, daily_token_quota=100_000)
    a_store, b_store = (failover(cluster, "fail_closed", timeout_ms=250) for _ in range(2))
    await warm(a_store, "t0")
    await warm(b_store, "t0")
    a = on_node(a_store, cluster.nodes[0])
    early, released, cancelled = lease(), lease(), lease()
    assert isinstance(await a_store.admit(a, policy, COST, early), Admit)
    assert await a_store.release(a, policy, early, 5)  # replicated: its resend does nothing
    for lease_id in (released, cancelled):
        assert isinstance(await a_store.admit(a, policy, COST, lease_id), Admit)
    await asyncio.sleep(0.1)  # (a's watch has read the slot map)
    await cut_replica_link(cluster)
    assert await a_store.release(a, policy, released, 7)
    await a_store.cancel(a, policy, cancelled)
    await until(lambda: _idle(a_store))  # the cancel reached the primary
    kill_primary(cluster)
    await promoted(cluster)

    async def free() -> bool:
        with contextlib.suppress(StoreUnavailable):  # (until b reads the new slot table)
            return await b_store.primary.in_flight(a) == 0  # (the store's says 0 on failure)
        return False

    await until(free, within_s=3)
    usage = await b_store.primary.usage(a, policy)
    assert usage["quotas"]["daily"]["used"] == 5 + 7  # the cancelled one: refunded
    for store in (a_store, b_store):
        await until(lambda store=store: _idle(store))
    assert await lease_keys(cluster) == []
    for store in (a_store, b_store):
        await close(store)
