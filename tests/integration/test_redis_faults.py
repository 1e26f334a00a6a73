"""The failover store through real Redis faults: a paused server (SIGSTOP), a killed one
(SIGKILL) and its restart on the same port, with and without load.

What must hold under every failure policy: nothing a timed-out call took stays in Redis, the
failover store's bookkeeping empties once every request has ended, and concurrency is exact
again within 1 s of Redis answering.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
async def raw_debug() -> AsyncIterator[tuple[RedisServer, aioredis.Redis]]:
    """A server that takes ``DEBUG SLEEP`` (busy, not stopped: what it was sent runs after)."""
    with RedisServer(extra_args=("--enable-debug-command", "yes")) as srv:
        client = aioredis.Redis.from_url(srv.url, socket_timeout=5)
        yield srv, client
        await client.aclose()


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
    """Every key in Redis but the tombstones of cancelled admissions and the retry-slot
    statistics (observed durations, no charge), with its contents."""
    found: dict[str, object] = {}
    for key in await raw.keys("*"):
        kind = (await raw.type(key)).decode()
        if key.endswith((b":cancelled", b":herd")):
            continue
        found[key.decode()] = (
            await raw.zrange(key, 0, -1) if kind == "zset" else await raw.hgetall(key)
        )
    return found


async def until_clean(raw: aioredis.Redis, store: FailoverStore, within_s: float = 1.0,
                      served: int = 0) -> None:
    """Redis holds no lease and no charge — but the daily quota's count of ``served``
    tokens, what requests the fallback served used — and the store remembers nothing,
    within a bound."""
    deadline = time.monotonic() + within_s
    expected = {} if not served else {quota_key(store, "acme"): served}
    while _quota_only(left := await leftovers(raw)) != expected or not store.idle():
        assert time.monotonic() < deadline, (left, store.debug())
        await asyncio.sleep(0.02)


def quota_key(store: FailoverStore, tenant: str) -> str:
    return next(k for k in store.primary.keys(tenant) if k.endswith(":q:day"))


def _quota_only(left: dict[str, object]) -> dict[str, int] | None:
    """``left`` as {quota key: tokens used} when it holds nothing else."""
    if not all(key.endswith(":q:day") for key in left):
        return None
    return {key: int(fields[b"u"]) for key, fields in left.items()}  # type: ignore[index]


async def quota_used(raw: aioredis.Redis, store: FailoverStore, tenant: str = "acme") -> int:
    return int(await raw.hget(quota_key(store, tenant), "u") or 0)


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
    # the admission that ran late was undone; what the fallback served counts to the quota
    await until_clean(raw, store, served=0 if policy == "fail_closed" else 5)
    await store.close()


@pytest.mark.parametrize("policy", ["fail_open", "local"])
async def test_tokens_served_while_redis_is_down_count_toward_the_quota_once(server, raw,
                                                                             policy):
    """Quotas are not enforced while Redis is unreachable, but what was served counts once
    it answers: released during the outage (owed, resent until confirmed) or after it
    (re-asserted, released there) — each request's tokens once."""
    store = failover(server, policy)
    warm = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, warm), Admit)
    assert await store.release("acme", SLOW, warm, 7)
    assert await quota_used(raw, store) == 7
    server.pause()
    try:
        during, after = lease(), lease()
        for lease_id in (during, after):
            assert isinstance(await store.admit("acme", SLOW, COST, lease_id), Admit)
        await store.release("acme", SLOW, during, 5)  # owed to Redis
        await asyncio.sleep(0.2)  # the repair loop keeps trying the paused server
    finally:
        server.resume()
    await asyncio.sleep(0.3)  # repaired: `after` re-asserted, `during`'s usage charged
    await store.release("acme", SLOW, after, 3)
    await settle(store)
    assert await quota_used(raw, store) == 7 + 5 + 3
    await store.close()


async def test_a_release_sent_again_after_a_late_reassert_charges_the_quota_once(server, raw):
    """A release that ran (its answer lost, so it is owed and sent again), then a re-assert
    of the lease that landed after it (another pooled connection of a cluster: no order
    between them) puts the lease back without its record. The release sent again frees it
    and charges nothing more: it once charged what was used a second time, as for a lease
    the fallback served (whose usage is owed to the quotas apart, by its own id)."""
    store = failover(server, "local")
    held = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, held), Admit)
    assert await store.primary.release("acme", SLOW, held, 7)
    await store.primary.renew("acme", [held], reassert=True)  # late: puts it back bare
    assert await store.primary.release("acme", SLOW, held, 7)  # the owed one, sent again
    assert await quota_used(raw, store) == 7
    assert not await raw.zcard(store.primary.keys("acme")[4])  # no lease left
    await store.close()


async def test_a_usage_charge_resent_is_counted_once(server, raw):
    store = failover(server, "local")
    usage_id = lease() + ":usage"
    for _ in range(3):  # a lost answer makes the repair loop send it again
        await store.primary.charge_usage("acme", SLOW, usage_id, 11)
    assert await quota_used(raw, store) == 11
    await store.close()


async def test_a_usage_charge_resent_after_the_lease_ttl_is_counted_once(server, raw):
    """The answer to an applied charge is lost, and Redis is unreachable again for longer
    than the lease TTL: the repair loop's resend still counts once (the id is remembered
    an hour), and a charge under a new id still counts."""
    now = [1_000_000_000]
    store = failover(server, "local")
    store.primary._clock = lambda: now[0]
    usage_id = lease() + ":usage"
    await store.primary.charge_usage("acme", SLOW, usage_id, 11)
    now[0] += 10 * 60_000  # ten lease TTLs later
    await store.primary.charge_usage("acme", SLOW, usage_id, 11)
    await store.primary.charge_usage("acme", SLOW, lease() + ":usage", 2)
    assert await quota_used(raw, store) == 13
    await store.close()


@pytest.mark.parametrize("soon", [False, True], ids=["awaited", "release_soon"])
async def test_release_timed_out_on_a_paused_redis_is_sent_again(server, raw, soon):
    """Awaited, or as the request path releases (``release_soon``: nothing awaited, the
    pipe's timer fails it): owed, sent again once Redis answers, charged once."""
    store = failover(server, "local")
    held = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, held), Admit)
    server.pause()
    try:
        if soon:
            assert store.release_soon("acme", SLOW, held, 7) is None
            deadline = time.monotonic() + 1
            while store.idle():
                assert time.monotonic() < deadline, "the unanswered release was not owed"
                await asyncio.sleep(0.01)
        else:
            await store.release("acme", SLOW, held, 7)
    finally:
        server.resume()
    await until_released(raw, store)
    await settle(store)
    assert await quota_used(raw, store) == 7
    await store.close()


async def test_release_soon_returns_at_once_and_redis_applies_it(server, raw):
    """The request path's release: nothing awaited, and Redis frees the lease and charges
    what was used as an awaited release does, the breaker told of the answer."""
    store = failover(server, "local")
    held = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, held), Admit)
    assert store.release_soon("acme", SLOW, held, 7) is None
    await until_released(raw, store)
    deadline = time.monotonic() + 1
    while await quota_used(raw, store) != 7 or not store.idle():
        assert time.monotonic() < deadline, "the release's charge did not reach Redis"
        await asyncio.sleep(0.02)
    assert store.breaker.state == "closed"
    await store.close()


async def test_closing_right_after_release_soon_leaves_no_lease(server, raw):
    """A shutdown: the store closes while the request path's releases are on their way;
    they reach Redis first (its lease would otherwise hold a concurrency slot for
    ``lease_ttl_s``)."""
    store = failover(server, "local")
    held = [lease() for _ in range(2)]
    for lease_id in held:
        assert isinstance(await store.admit("acme", SLOW, COST, lease_id), Admit)
    for lease_id in held:
        store.release_soon("acme", SLOW, lease_id, 7)
    await store.close()
    assert not await raw.zcard(store.primary.keys("acme")[4])
    assert await quota_used(raw, store) == 14


QUOTA_ONLY = TenantPolicy(daily_token_quota=10**9)


async def test_closing_during_a_redis_blip_still_sends_everything_owed(server, raw, caplog):
    """A SIGTERM while Redis is paused: closing keeps sending what is owed (more than one
    repair batch of it) until Redis answers, so no release, cancel or usage charge is
    dropped; what could not be sent at all is logged."""
    store = failover(server, "local")
    held = [lease() for _ in range(3)]
    for lease_id in held:
        assert isinstance(await store.admit("acme", QUOTA_ONLY, COST, lease_id), Admit)
    server.pause()
    try:
        for lease_id in held:
            store.release_soon("acme", QUOTA_ONLY, lease_id, 10)
        for _ in range(100):  # served by the fallback: 100 usage charges owed
            lease_id = lease()
            assert isinstance(await store.admit("acme", QUOTA_ONLY, COST, lease_id), Admit)
            store.release_soon("acme", QUOTA_ONLY, lease_id, 10)
        assert len(store._owed) > 64
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, server.resume)
        await store.close()
    finally:
        if server.running:
            server.resume()
    assert not store._owed
    assert not await raw.zcard(store.primary.keys("acme")[4])
    assert await quota_used(raw, store) == 30 + 100 * 10


async def test_closing_with_redis_down_logs_what_it_could_not_send(server, raw, caplog,
                                                                   monkeypatch):
    monkeypatch.setattr("limiter.stores.failover.CLOSE_REPAIR_S", 0.2)
    store = failover(server, "local")
    held = lease()
    assert isinstance(await store.admit("acme", QUOTA_ONLY, COST, held), Admit)
    server.kill()
    store.release_soon("acme", QUOTA_ONLY, held, 10)
    await store.close()
    assert "1 release(s) not confirmed by Redis" in caplog.text


async def until_released(raw: aioredis.Redis, store: FailoverStore, within_s: float = 1.0
                         ) -> None:
    """Redis holds no lease of acme's, within a bound."""
    deadline = time.monotonic() + within_s
    while await raw.zcard(store.primary.keys("acme")[4]):
        assert time.monotonic() < deadline, "the lease stayed in Redis"
        await asyncio.sleep(0.02)


async def test_an_unexpected_error_in_a_repair_round_does_not_end_the_repair(server, raw,
                                                                              caplog):
    """The repair loop is what sends owed releases: an error that is no Redis failure (a
    client library's surprise) is logged and retried, not left to end the loop — the
    lease then stayed held in Redis until its TTL."""
    store = failover(server, "local")
    held = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, held), Admit)
    server.pause()
    try:
        await store.release("acme", SLOW, held, COST.tokens)  # owed: Redis did not answer
    finally:
        server.resume()
    release, surprises = store.primary.release, [RuntimeError("surprise")]

    async def surprising_release(*args, **kwargs):  # type: ignore[no-untyped-def]
        if surprises:
            raise surprises.pop()
        return await release(*args, **kwargs)

    store.primary.release = surprising_release  # type: ignore[method-assign]
    await until_released(raw, store, within_s=2)
    assert not surprises
    assert "shared store repair failed, will retry" in caplog.text
    await settle(store)
    await store.close()


@pytest.mark.parametrize("policy", POLICIES)
async def test_restart_with_leases_held_keeps_concurrency_exact(server, raw, policy):
    # the first call after a restart also reloads the scripts (NOSCRIPT): room on a busy box
    store = failover(server, policy, timeout_ms=100)
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


@pytest.mark.parametrize("fault", ["restart", "quick restart"])
async def test_a_restart_puts_back_the_leases_of_a_store_that_made_no_call(server, raw, fault):
    """Redis restarted empty while this store held leases and sent nothing (a replica whose
    streams are long and that admits nothing new; or one that did, and whose next call
    found Redis back already): the end of its connection says Redis may have lost them,
    and they are back within moments of Redis answering. They used to come back only at
    the next renewal (``lease_ttl_s / 3``, 20 s by default), while any other replica could
    admit on top of them."""
    store = failover(server, "local", timeout_ms=100)
    held = [lease(), lease()]
    for lease_id in held:
        assert isinstance(await store.admit("acme", SLOW, COST, lease_id), Admit)
    server.kill()
    if fault == "restart":
        await asyncio.sleep(0.2)  # Redis down a while: the repair finds it down, retries
    server.start()
    key = store.primary.keys("acme")[4]
    deadline = time.monotonic() + 1.0
    while await raw.zcard(key) != 2:
        assert time.monotonic() < deadline, "the leases Redis lost were not put back"
        await asyncio.sleep(0.02)
    for lease_id in held:
        assert await store.release("acme", SLOW, lease_id, 1)
    await settle(store)
    assert not await raw.zcard(key)
    await store.close()


async def test_renewal_puts_back_leases_redis_lost(server, raw):
    store = failover(server, "fail_closed")
    held = [lease(), lease()]
    for lease_id in held:
        assert isinstance(await store.admit("acme", SLOW, COST, lease_id), Admit)
    await raw.flushall()  # lost with no failed call here, as a replica may see a restart
    await store.renew("acme", held)
    assert await raw.zcard(store.primary.keys("acme")[4]) == 2
    for lease_id in held:
        assert await store.release("acme", SLOW, lease_id, 1)
    await settle(store)
    assert not await raw.zcard(store.primary.keys("acme")[4])
    await store.close()


async def test_a_reassert_answered_late_leaves_no_lease_released_meanwhile(raw_debug):
    """A re-assert that got no answer in time still runs once Redis answers (a busy Redis
    runs what it was sent): a lease released meanwhile, here one the fallback admitted while
    the breaker was open, must not be left in Redis (under ``DEBUG SLEEP`` and load, two
    leases were once left there, holding their slots until the lease TTL)."""
    server, raw = raw_debug
    store = failover(server, "local")
    first = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, first), Admit)
    leases_key = store.primary.keys("acme")[4]
    await store.renew("acme", [first])  # the renewal script loaded (else: NOSCRIPT, late)
    busy = asyncio.create_task(raw.execute_command("DEBUG", "SLEEP", "1"))
    await asyncio.sleep(0.05)
    for _ in range(3):  # renewals that fail: the breaker opens, nothing is owed
        await store.renew("acme", [first])
    local = lease()
    assert isinstance(await store.admit("acme", SLOW, COST, local), Admit)
    assert store.debug()["held"][local] == "local"
    await asyncio.sleep(0.3)  # the repair loop's re-asserts time out, and run after the sleep
    assert await store.release("acme", SLOW, local, 1)
    await busy
    for _ in range(100):  # the repairs: what is owed sent, the held lease re-asserted
        debug = store.debug()
        if not debug["owed"] and not debug["reassert"]:
            break
        await asyncio.sleep(0.02)
    assert await raw.zrange(leases_key, 0, -1) == [first.encode()]
    assert await store.release("acme", SLOW, first, 1)
    await settle(store)
    assert not await raw.zcard(leases_key)
    await store.close()


# --- faults under load ---------------------------------------------------------------------

LOAD = TenantPolicy(max_concurrency=2, token_rate=Rate(10**6, 1000), token_burst=10**6)


class Load:
    """Workers that admit, hold the lease a moment, and release, as requests would; they
    record what each admission got and how many requests ran at once (in either store)."""

    def __init__(self, store: FailoverStore, workers: int = 6, hold_s: float = 0.01) -> None:
        self.store, self.workers, self.hold_s = store, workers, hold_s
        self.running = 0
        self.events: list[tuple[float, str, int]] = []  # (time, outcome, running after)
        self.stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.workers)))

    async def _worker(self) -> None:
        while not self.stop.is_set():
            lease_id = lease()
            try:
                decision = await self.store.admit("acme", LOAD, COST, lease_id)
            except StoreUnavailable:
                self.events.append((time.monotonic(), "503", self.running))
                await asyncio.sleep(0.01)
                continue
            if isinstance(decision, Reject):
                self.events.append((time.monotonic(), "429", self.running))
                await asyncio.sleep(0.005)
                continue
            self.running += 1
            self.events.append((time.monotonic(), "200", self.running))
            await asyncio.sleep(self.hold_s)
            self.running -= 1
            await self.store.release("acme", LOAD, lease_id, 5)

    def between(self, start: float, end: float) -> list[tuple[float, str, int]]:
        return [e for e in self.events if start <= e[0] < end]


async def pause(server: RedisServer) -> None:
    server.pause()
    try:
        await asyncio.sleep(0.5)
    finally:
        server.resume()


async def crash(server: RedisServer) -> None:
    server.kill()
    server.start()  # at once, on the same port, empty


async def outage(server: RedisServer) -> None:
    server.kill()
    await asyncio.sleep(0.5)
    server.start()


FAULTS = {"paused": pause, "crashed": crash, "down": outage}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_fault_under_load(server, raw, fault, policy):
    # a loaded CI box stalls for tens of ms, once past 100 (three such stalls opened the
    # breaker before the fault: fail_open then let 6 run); the pause below lasts 500
    store = failover(server, policy, timeout_ms=250)
    load = Load(store)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(0.3)
    fault_at = time.monotonic()
    await FAULTS[fault](server)
    back = time.monotonic()
    await asyncio.sleep(1.5)
    load.stop.set()
    await task
    end = time.monotonic()

    before, during = load.between(0, fault_at), load.between(fault_at, back)
    after = load.between(back + 1.0, end)  # limits exact within 1 s of Redis answering
    assert max(r for _, _, r in before) == 2
    assert max(r for _, _, r in after) == 2, [(round(t - back, 3), o, r) for t, o, r in after]
    assert {o for _, o, _ in after} <= {"200", "429"}, "503s more than 1 s after Redis is back"
    if fault != "crashed":  # (a restart at once may fall between two requests)
        assert any(o == ("503" if policy == "fail_closed" else "200") for _, o, _ in during)
    if policy == "local":  # this replica's share counts the leases it holds in Redis too
        assert max((r for _, _, r in during), default=0) <= 2

    await settle(store)  # every request has ended: nothing held or owed ...
    assert not await raw.zcard(store.primary.keys("acme")[4])  # ... and no lease in Redis
    await store.close()


async def test_a_blocked_tenants_herd_gets_slots_from_redis(server, raw):
    """While a tenant is blocked, the headers-phase check asks Redis, so concurrent refused
    clients get successive retry slots (limiter.herd), not the one cached refusal."""
    store = failover(server, "local", timeout_ms=500)
    policy = TenantPolicy(request_rate=Rate(1, 1000), request_burst=1)
    assert isinstance(await store.admit("acme", policy, Cost(1, 1), lease()), Admit)
    refused = await store.admit("acme", policy, Cost(1, 1), lease())
    assert isinstance(refused, Reject) and refused.reason is Reason.REQUESTS
    checks = await asyncio.gather(*(store.check_requests("acme", policy) for _ in range(4)))
    waits = [check.retry_after_ms for check in checks if check is not None]
    assert len(waits) == 4 and len(set(waits)) == 4  # a refill (1 s) apart, each its own
    assert max(waits) - min(waits) >= 2900
    await store.close()


async def test_a_removed_tenant_is_forgotten_once_nothing_is_owed_to_redis(server, raw):
    """A tenant a reload removed is forgotten only once Redis has been told all it is
    owed for it (releases, cancels, the quota usage of what the fallback served): the
    release of a lease still held, then the usage owed, each keep it; after that, what this
    process kept for it (the key names, the fallback's limits) goes, and its state in Redis
    is what a tenant configured again starts from."""
    store = failover(server, "local")
    warm = lease()
    assert isinstance(await store.admit("gone", SLOW, COST, warm), Admit)
    assert await store.release("gone", SLOW, warm, 7)
    server.pause()
    try:
        served = lease()
        assert isinstance(await store.admit("gone", SLOW, COST, served), Admit)
        assert store.forget(["gone"]) == []  # a lease held
        await store.release("gone", SLOW, served, 5)  # its usage is owed to Redis
        assert store.forget(["gone"]) == []
        assert "gone" in store.local._tenants
    finally:
        server.resume()
    await settle(store)
    assert store.forget(["gone"]) == ["gone"]
    assert "gone" not in store.primary._keys and "gone" in store.local._fading
    assert tuple(store.primary.keys("gone")) not in store.primary._scripts._packed_keys
    assert await quota_used(raw, store, "gone") == 7 + 5  # Redis keeps it for a re-add
    await store.close()


@pytest.mark.parametrize("released", ["during the outage", "after it"])
async def test_an_outage_longer_than_the_lease_ttl_still_charges_the_usage_once(
        server, raw, released):
    """Redis unreachable longer than ``lease_ttl``: the lease of a request still running
    expires there (nobody could renew it). Its release — owed during the outage, or made
    after the lease was re-asserted — settles its reservation against what it used: the
    quota counts its usage once, not the reservation, nor the reservation plus the usage."""
    settings = RedisSettings(url=server.url, timeout_ms=50, failure_policy="local")
    store = FailoverStore(RedisStore(redis_client(settings), lease_ttl_ms=1000),
                          policy=FailurePolicy.LOCAL, timeout_s=0.05,
                          breaker=CircuitBreaker(3, 200))
    policy = TenantPolicy(daily_token_quota=10**9, token_rate=Rate(1, HOUR_MS),
                          token_burst=10**6)
    held = lease()
    assert isinstance(await store.admit("acme", policy, Cost(500, 500), held), Admit)
    assert await quota_used(raw, store) == 1000  # the reservation
    server.pause()
    try:
        await store.renew("acme", [held])  # fails: re-asserted once Redis answers
        if released == "during the outage":
            store.release_soon("acme", policy, held, 100)
        await asyncio.sleep(1.5)  # past the lease TTL
    finally:
        server.resume()
    await asyncio.sleep(0.3)
    if released == "after it":
        store.release_soon("acme", policy, held, 100)
    await store.primary.settle_releases()
    await settle(store)
    assert await quota_used(raw, store) == 100
    assert not await raw.zcard(store.primary.keys("acme")[4])
    await store.close()


def short_lived(server: RedisServer) -> FailoverStore:
    """A store whose leases expire 1 s after their last renewal."""
    settings = RedisSettings(url=server.url, timeout_ms=50, failure_policy="local")
    return FailoverStore(RedisStore(redis_client(settings), lease_ttl_ms=1000),
                         policy=FailurePolicy.LOCAL, timeout_s=0.05,
                         breaker=CircuitBreaker(3, 200))


QUOTA_ONLY = TenantPolicy(daily_token_quota=10**9, token_rate=Rate(1, HOUR_MS),
                          token_burst=10**6)


async def test_a_queued_admission_whose_holder_died_gives_its_quota_back(server, raw):
    """A kvgate process killed with requests waiting in its queue: they were admitted (their
    reservation charged to the daily quota) and never sent upstream, and nobody releases
    them. Once their leases expire, their quota charge comes back; a request that was sent
    (dispatched, or never queued) keeps its reservation charged, as one cut mid-answer."""
    dead = short_lived(server)
    queued, dispatched, direct = lease(), lease(), lease()
    for lease_id, unsent in ((queued, True), (dispatched, True), (direct, False)):
        assert isinstance(await dead.admit("acme", QUOTA_ONLY, Cost(500, 500), lease_id,
                                           unsent=unsent), Admit)
    dead.mark_sent("acme", dispatched)
    await dead.primary.settle_releases()  # (the mark rides the pipe: it has been sent)
    assert await quota_used(raw, dead) == 3000
    await dead.close()  # dies: nothing released, nothing renewed
    survivor = short_lived(server)
    await asyncio.sleep(1.2)  # past the lease TTL
    assert await survivor.in_flight("acme") == 0  # (the expiry runs in a tenant's call)
    assert await quota_used(raw, survivor) == 2000
    assert await survivor.in_flight("acme") == 0
    assert await quota_used(raw, survivor) == 2000  # given back once
    await survivor.close()


async def evalsha_calls(raw: aioredis.Redis) -> int:
    return (await raw.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)


async def test_a_dispatch_is_marked_in_the_release_that_freed_its_room(server, raw):
    """A request leaves the queue as another's release frees its room: its mark goes to
    Redis in that release's script call (one call for both), and still counts: once its
    holder dies, the dispatched request keeps its reservation charged."""
    dead = short_lived(server)
    warm, ran, dispatched = lease(), lease(), lease()
    for lease_id, unsent in ((warm, False), (ran, False), (dispatched, True)):
        assert isinstance(await dead.admit("acme", QUOTA_ONLY, Cost(500, 500), lease_id,
                                           unsent=unsent), Admit)
    dead.release_soon("acme", QUOTA_ONLY, warm, 0)  # (Redis has the release script now)
    await dead.primary.settle_releases()
    calls = await evalsha_calls(raw)
    dead.release_soon("acme", QUOTA_ONLY, ran, 600)
    dead.mark_sent("acme", dispatched)
    await dead.primary.settle_releases()
    assert await evalsha_calls(raw) == calls + 1
    meta = await raw.hget(dead.primary.keys("acme")[5], dispatched)
    assert meta is not None and not meta.endswith(b":u")
    await dead.close()  # dies holding the dispatched request
    survivor = short_lived(server)
    await asyncio.sleep(1.2)  # past the lease TTL
    assert await survivor.in_flight("acme") == 0
    assert await quota_used(raw, survivor) == 1600  # 600 used, 1000 reserved and sent
    await survivor.close()


async def test_a_queued_admission_outliving_an_outage_is_charged_its_usage_once(server, raw):
    """The holder is alive but Redis was unreachable past the lease TTL while the request
    queued: the expiry gave its quota charge back. Re-asserted, dispatched and released,
    it is charged what it used: once, not nothing and not its reservation."""
    store = short_lived(server)
    held = lease()
    assert isinstance(await store.admit("acme", QUOTA_ONLY, Cost(500, 500), held,
                                        unsent=True), Admit)
    server.pause()
    try:
        await store.renew("acme", [held])  # fails: re-asserted once Redis answers
        await asyncio.sleep(1.5)  # past the lease TTL
    finally:
        server.resume()
    deadline = time.monotonic() + 2  # the lease put back by the re-assert (it expired)
    while store.debug()["reassert"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert await raw.zcard(store.primary.keys("acme")[4]) == 1
    assert await quota_used(raw, store) == 0
    store.mark_sent("acme", held)
    store.release_soon("acme", QUOTA_ONLY, held, 100)
    await store.primary.settle_releases()
    await settle(store)
    assert await quota_used(raw, store) == 100
    await store.close()


async def test_a_request_its_shaper_held_gives_its_quota_back_if_its_holder_died(server, raw):
    """The same for a shaped tenant's request held for its departure slot when kvgate died
    (kvgate admits every paced request as unsent, and marks it sent as it routes it): the
    one that had left stays charged, the one still held does not."""
    dead = short_lived(server)
    paced = dataclasses.replace(QUOTA_ONLY, shaping_rate=Rate(1, 60_000), shaping_backlog=5)
    gone, held = lease(), lease()
    first = await dead.admit("acme", paced, Cost(500, 500), gone, unsent=True)
    second = await dead.admit("acme", paced, Cost(500, 500), held, unsent=True)
    assert isinstance(first, Admit) and not first.hold_ms
    assert isinstance(second, Admit) and second.hold_ms
    dead.mark_sent("acme", gone)
    await dead.primary.settle_releases()  # (the mark rides the pipe: it has been sent)
    assert await quota_used(raw, dead) == 2000
    await dead.close()  # dies: nothing released, nothing renewed
    survivor = short_lived(server)
    await asyncio.sleep(1.2)  # past the lease TTL
    assert await survivor.in_flight("acme") == 0
    assert await quota_used(raw, survivor) == 1000
    await survivor.close()
