"""Limits shared through a real redis-server: several kvgate processes, Redis failures, and
the leases of a crashed replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis
import yaml
from redis.crc import key_slot

from bench.extproc_client import ExtProcClient
from bench.redis_server import RedisServer
from extproc.cli import main
from extproc.config import Config, hash_api_key, parse_config
from extproc.processes import KvgateProcess
from extproc.server import KvgateServer
from limiter.stores import FailoverStore
from tests.conftest import free_port

pytestmark = pytest.mark.redis

KEY = "sk-shared"
USAGE = orjson.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 1}})
BODY = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    if not redis_server.running:
        redis_server.start()
    redis_server.flushall()
    return redis_server.url


def config(redis_url, limits, **redis):
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "redis": {"url": redis_url, "timeout_ms": 50, "breaker_open_ms": 300, **redis},
        "tiers": {"t": {"limits": limits}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:9"], "kv_aware": False}],
    })


@contextlib.asynccontextmanager
async def serving(cfg: Config) -> AsyncIterator[tuple[KvgateServer, ExtProcClient]]:
    """kvgate in this process on ``cfg``, and an ext_proc client to it."""
    server = KvgateServer(cfg)
    await server.start()
    client = ExtProcClient(f"127.0.0.1:{server.grpc_port}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(0)


async def hammer(target: str, seconds: float, tasks: int = 4) -> list[tuple[float, bool]]:
    """Offer far more load than the limit; every admitted request completes at once."""
    client = ExtProcClient(target)
    deadline = time.monotonic() + seconds
    results: list[tuple[float, bool]] = []

    async def worker() -> None:
        while time.monotonic() < deadline:
            outcome = await client.chat(KEY, BODY, response=USAGE)
            assert outcome.status in (200, 429), outcome
            results.append((time.monotonic(), outcome.admitted))

    await asyncio.gather(*(worker() for _ in range(tasks)))
    await client.close()
    return results


HAMMER = """
import asyncio, json, sys, time
from tests.integration.test_shared_limits import hammer
async def both(a, b):
    start = time.monotonic()
    runs = await asyncio.gather(hammer(a, 3.0, tasks=8), hammer(b, 3.0, tasks=8))
    return {"start": start, "runs": runs}
print(json.dumps(asyncio.run(both(sys.argv[1], sys.argv[2]))))
"""


def hammer_both(a: str, b: str) -> tuple[float, list[list[tuple[float, bool]]]]:
    """Both replicas hammered from a fresh process: a long pytest process (grpc pollers and
    loops left by earlier tests) offers far less load than it can alone, which showed as
    admissions well under the limit in the full suite only. ``time.monotonic`` is the
    system's monotonic clock, shared with this process."""
    done = subprocess.run([sys.executable, "-c", HAMMER, a, b], capture_output=True,
                          text=True, timeout=60, check=True)
    out = json.loads(done.stdout)
    return out["start"], out["runs"]


async def test_two_replicas_enforce_one_global_limit(redis_url, tmp_path):
    rate, burst = 40, 20
    # a generous Redis budget: on a loaded machine a 50 ms call times out, and its admission
    # (refused, then cancelled) costs the test its count; this test is about the global limit
    shared = config(redis_url, {"requests_per_second": rate, "request_burst": burst},
                    timeout_ms=250, replicas=3)
    other = shared.model_copy(update={"server": shared.server.model_copy(
        update={"grpc_port": free_port(), "admin_port": free_port()})})
    # replica b runs two worker processes on one port (SO_REUSEPORT): three processes in all
    with KvgateProcess(shared, tmp_path, "a") as a, \
            KvgateProcess(other, tmp_path, "b", workers=2) as b:
        # each admitted request also reports its usage and ends its stream, as through
        # Envoy: enough tasks that the offered load stays far above the limit
        start, runs = await asyncio.to_thread(hammer_both, a.target, b.target)
    results = runs[0] + runs[1]
    admitted = sum(ok for _, ok in results)
    elapsed = max(t for t, _ in results) - start
    ceiling = rate * elapsed + burst
    assert sum(1 for _, ok in runs[0] if ok) and sum(1 for _, ok in runs[1] if ok)
    print(f"admitted {admitted} of {len(results)} offered; ceiling {ceiling:.1f}")
    assert admitted <= ceiling, (admitted, ceiling)
    # not far under it either (alone: 138 of a 142 ceiling)
    assert admitted >= 0.75 * ceiling, (admitted, ceiling)


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed", "local"])
async def test_redis_down_follows_the_policy_and_recovers(redis_server, redis_url, policy):
    # a slow refill (1 request/s for this replica alone): none comes back during the six
    cfg = config(redis_url, {"requests_per_second": 2, "request_burst": 4},
                 failure_policy=policy, replicas=2)
    async with serving(cfg) as (server, client):
        assert (await client.chat(KEY, BODY, response=USAGE)).admitted
        redis_server.kill()
        outcomes = []
        for _ in range(6):
            started = time.monotonic()
            outcomes.append(await asyncio.wait_for(client.chat(KEY, BODY, response=USAGE), 2))
            assert time.monotonic() - started < 0.5  # never stuck on a dead Redis
        statuses = [o.status for o in outcomes]
        if policy == "fail_open":
            assert statuses == [200] * 6
        elif policy == "fail_closed":
            assert statuses == [503] * 6
            assert outcomes[0].headers["retry-after"] == "1"
            assert outcomes[0].headers["x-kvgate-reject"] == "gateway_unavailable"
        else:  # this replica's half of a 4-request burst
            assert statuses == [200, 200, 429, 429, 429, 429]
        assert server.metrics.store_fallbacks.labels(policy)._value.get() >= 1
        # the fallback state: one node bypassed (the gauge is read at each scrape)
        assert server.metrics.store_state.collect()[0].samples[0].value == 1
        assert server.metrics.store_errors.labels("connection")._value.get() >= 1

        redis_server.start()
        recovered = time.monotonic()
        while (await client.chat(KEY, BODY, response=USAGE)).status == 503 or (
            server.director.store.breaker.state != "closed"
        ):
            assert time.monotonic() - recovered < 1.0, "limits did not resume within 1 s"
            await asyncio.sleep(0.02)
        store = server.director.store
        assert isinstance(store, FailoverStore)
        while not store.idle():  # nothing held, nothing owed to Redis
            assert time.monotonic() - recovered < 2.0, store.debug()
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed", "local"])
async def test_a_paused_redis_leaves_no_lease_behind(redis_server, redis_url, policy):
    cfg = config(redis_url, {"max_concurrency": 2}, failure_policy=policy)
    async with serving(cfg) as (server, client):
        raw = aioredis.from_url(redis_url)
        store = server.director.store
        assert isinstance(store, FailoverStore)
        try:
            assert (await client.chat(KEY, BODY, response=USAGE)).admitted  # a pooled connection
            redis_server.pause()
            try:  # each admission times out; the commands wait in Redis and run on SIGCONT
                outcomes = [await asyncio.wait_for(client.chat(KEY, BODY, response=USAGE), 2)
                            for _ in range(4)]
            finally:
                redis_server.resume()
            assert {o.status for o in outcomes} == {503 if policy == "fail_closed" else 200}
            resumed = time.monotonic()
            while store.breaker.state != "closed":  # the next probe finds Redis back
                await client.chat(KEY, BODY, response=USAGE)
                await asyncio.sleep(0.02)
            while await raw.keys("*:leases") or not store.idle():
                assert time.monotonic() - resumed < 1.0, (await raw.keys("*"), store.debug())
                await asyncio.sleep(0.02)
            streams = [await client.open(KEY, BODY) for _ in range(2)]  # both slots are usable
            assert all(outcome.admitted for outcome, _call, _reply in streams)
            assert (await client.chat(KEY, BODY, response=USAGE)).status == 429
            for _outcome, call, _reply in streams:
                call.cancel()
        finally:
            await raw.aclose()


@pytest.mark.parametrize("policy", ["fail_closed", "local"])
async def test_a_client_gone_during_the_breakers_probe_does_not_keep_redis_bypassed(
        redis_server, redis_url, policy):
    """Redis paused: a client that leaves while its admission is the breaker's probe cancels
    the probe, which then reports nothing. The breaker stayed half-open for good (every
    later request on the failure policy — fail_closed: 503s — with Redis back); now the
    next request after ``breaker_open_ms`` probes again, and nothing is left in Redis."""
    # a long call budget holds the probe on the paused Redis while its client leaves
    cfg = config(redis_url, {"max_concurrency": 2}, failure_policy=policy, timeout_ms=1000,
                 breaker_failures=1)
    async with serving(cfg) as (server, client):
        store = server.director.store
        assert isinstance(store, FailoverStore)
        raw = aioredis.from_url(redis_url)
        try:
            assert (await client.chat(KEY, BODY, response=USAGE)).admitted
            redis_server.pause()
            try:
                await client.chat(KEY, BODY, response=USAGE)  # times out: the breaker opens
                assert store.breaker.state == "open"
                await asyncio.sleep(0.3)  # breaker_open_ms: the next admission probes
                probe = asyncio.create_task(client.chat(KEY, BODY, response=USAGE))
                deadline = time.monotonic() + 1
                while store.breaker.state != "half_open":
                    assert time.monotonic() < deadline, "no probe went to Redis"
                    await asyncio.sleep(0.005)
                probe.cancel()  # the client goes away while its admission waits on Redis
                with contextlib.suppress(asyncio.CancelledError):
                    await probe
                await asyncio.sleep(0.1)  # (kvgate's handler sees the cancellation)
            finally:
                redis_server.resume()
            resumed = time.monotonic()
            while store.breaker.state != "closed":  # within breaker_open_ms, plus a call
                assert time.monotonic() - resumed < 1.5, "Redis is back but never probed"
                await client.chat(KEY, BODY, response=USAGE)
                await asyncio.sleep(0.02)
            assert server.metrics.store_state.collect()[0].samples[0].value == 0
            outcome, call, _reply = await client.open(KEY, BODY)  # admitted by Redis again
            assert outcome.admitted and await raw.zcard(store.primary.keys("acme")[4]) == 1
            call.cancel()
            while await raw.keys("*:leases") or not store.idle():  # nothing left behind
                assert time.monotonic() - resumed < 3.0, (await raw.keys("*"), store.debug())
                await asyncio.sleep(0.02)
        finally:
            await raw.aclose()


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed", "local"])
async def test_a_restarted_redis_keeps_concurrency_exact(redis_server, redis_url, policy):
    cfg = config(redis_url, {"max_concurrency": 2}, failure_policy=policy)
    async with serving(cfg) as (_server, client):
        streams = [await client.open(KEY, BODY) for _ in range(2)]
        assert all(outcome.admitted for outcome, _call, _reply in streams)
        redis_server.kill()
        redis_server.start()  # at once, empty: it forgot both leases
        for _ in range(4):  # dead pooled connections first: retried, not a fallback
            outcome = await client.chat(KEY, BODY, response=USAGE)
            assert outcome.status == 429 and b"concurrency" in outcome.body, outcome
        streams[0][1].cancel()
        deadline = time.monotonic() + 2
        while not (await client.chat(KEY, BODY, response=USAGE)).admitted:
            assert time.monotonic() < deadline, "the released slot never came back"
            await asyncio.sleep(0.02)
        streams[1][1].cancel()


async def test_leases_of_a_killed_replica_expire(redis_url, tmp_path):
    cfg = config(redis_url, {"max_concurrency": 1}, lease_ttl_s=1)
    other = cfg.model_copy(update={"server": cfg.server.model_copy(
        update={"grpc_port": free_port(), "admin_port": free_port()})})
    with KvgateProcess(cfg, tmp_path, "doomed") as doomed, KvgateProcess(other, tmp_path, "b") as b:
        client_a, client_b = ExtProcClient(doomed.target), ExtProcClient(b.target)
        outcome, _call, _reply = await client_a.open(KEY, BODY)
        assert outcome.admitted
        busy = await client_b.chat(KEY, BODY, response=USAGE)
        assert busy.status == 429 and b"concurrency" in busy.body
        doomed.kill()
        killed = time.monotonic()
        while not (await client_b.chat(KEY, BODY, response=USAGE)).admitted:
            assert time.monotonic() - killed < 3.0, "the dead replica's lease never expired"
            await asyncio.sleep(0.05)
        assert time.monotonic() - killed >= 0.5  # held until its TTL, not freed early
        await client_a.close()
        await client_b.close()


async def test_long_streams_keep_their_lease(redis_url, tmp_path):
    cfg = config(redis_url, {"max_concurrency": 1}, lease_ttl_s=0.6)
    with KvgateProcess(cfg, tmp_path, "a") as a:
        client = ExtProcClient(a.target)
        outcome, call, _reply = await client.open(KEY, BODY)
        assert outcome.admitted
        await asyncio.sleep(1.5)  # > 2 TTLs: renewal keeps the slot
        assert (await client.chat(KEY, BODY, response=USAGE)).status == 429
        call.cancel()  # the stream ends: the slot comes back
        deadline = time.monotonic() + 2
        while not (await client.chat(KEY, BODY, response=USAGE)).admitted:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await client.close()


def test_workers_need_redis(tmp_path, capsys):
    cfg = config("redis://127.0.0.1:1", {}).model_copy(update={"redis": None})
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    assert main(["serve", "-c", str(path), "--workers", "2"]) == 2
    assert "needs `redis:`" in capsys.readouterr().err


async def test_two_replicas_on_a_redis_cluster_enforce_one_limit_per_tenant(redis_cluster,
                                                                            tmp_path):
    """`redis.cluster: true`: tenants' keys land on different shards of a real 3-shard
    cluster, and two replicas still enforce each tenant's one global limit."""
    rate, burst = 20, 10
    keys = {name: f"sk-{name}" for name in ("acme", "globex", "initech")}
    data = {
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "redis": {"url": redis_cluster.url, "cluster": True, "timeout_ms": 200},
        "tiers": {"t": {"limits": {"requests_per_second": rate, "request_burst": burst}}},
        "tenants": [{"name": name, "tier": "t", "api_keys": [hash_api_key(key)]}
                    for name, key in keys.items()],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:9"], "kv_aware": False}],
    }
    one = parse_config(data)
    other = parse_config({**data, "server": {"grpc_port": free_port(), "admin_port": free_port()}})
    store_keys = [f"kvgate:{{kvgate:{name}}}:tb:req" for name in keys]
    assert len({key_slot(k.encode()) * 3 // 16384 for k in store_keys}) > 1  # several shards
    with KvgateProcess(one, tmp_path, "a") as a, KvgateProcess(other, tmp_path, "b") as b:
        clients = [ExtProcClient(a.target), ExtProcClient(b.target)]
        start = time.monotonic()

        async def offer(client: ExtProcClient, key: str) -> int:
            admitted = 0
            while time.monotonic() - start < 2.0:
                outcome = await client.chat(key, BODY, response=USAGE)
                assert outcome.status in (200, 429), outcome
                admitted += outcome.admitted
            return admitted

        counts = await asyncio.gather(*(offer(c, key) for key in keys.values() for c in clients))
        elapsed = time.monotonic() - start
        for client in clients:
            await client.close()
    for i, name in enumerate(keys):
        admitted = counts[2 * i] + counts[2 * i + 1]
        ceiling = rate * elapsed + burst
        assert 0.8 * ceiling <= admitted <= ceiling, (name, admitted, ceiling)
