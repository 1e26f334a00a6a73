"""Two kvgate processes sharing one Redis serve tenants in one global weighted order.

Each replica has its own saturated pool (one endpoint, one request in flight) and
its own, very different, tenant mix. The fair queue's virtual counters live in Redis, so
overall the tenants' dispatched tokens follow their weights 5:3:1.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.extproc_client import ExtProcClient
from bench.redis_server import RedisServer
from extproc.config import hash_api_key, parse_config
from extproc.processes import KvgateProcess
from tests.conftest import free_port

pytestmark = pytest.mark.redis

WEIGHTS = {"gold": 5, "silver": 3, "bronze": 1}
MIXES = [{"gold": 0.8, "silver": 0.15, "bronze": 0.05},  # replica 1: mostly gold
         {"gold": 0.2, "silver": 0.3, "bronze": 0.5}]  # replica 2: mostly bronze
SERVICE_S = 0.01  # how long a dispatched request "runs" before its response completes it


def replica_config(redis_url: str):
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "redis": {"url": redis_url, "timeout_ms": 100},
        "queue": {"aging_s": None, "max_size": 100_000},
        "classes": {"interactive": {"priority": 0, "deadline_s": 120}},
        "classification": {"path_classes": {}, "long_prompt_tokens": None},
        "tiers": {name: {"weight": w} for name, w in WEIGHTS.items()},
        "tenants": [{"name": name, "tier": name, "api_keys": [hash_api_key(name)]}
                    for name in WEIGHTS],
        "pools": [{"name": "p", "models": ["m"], "kv_aware": False, "max_in_flight": 1,
                   "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })


async def drive(target: str, mix: dict[str, float], seconds: float, seed: int) -> None:
    """Open-loop arrivals well above the replica's capacity, tenants drawn from ``mix``."""
    rng = random.Random(seed)
    client = ExtProcClient(target)
    tenants, weights = list(mix), list(mix.values())

    async def one(tenant: str, tokens: int) -> None:
        body = {"model": "m", "max_tokens": tokens,
                "messages": [{"role": "user", "content": "x"}]}
        outcome, call, reply = await client.open(tenant, body)
        if outcome.admitted:
            await asyncio.sleep(SERVICE_S)
            usage = {"usage": {"prompt_tokens": 4, "completion_tokens": tokens}}
            await client.finish(call, reply, orjson.dumps(usage))

    tasks = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tenant = rng.choices(tenants, weights)[0]
        tasks.append(asyncio.create_task(one(tenant, rng.randint(20, 400))))
        await asyncio.sleep(0.004)  # ~250 arrivals/s against < 100/s of capacity
    for task in tasks:
        task.cancel()  # whatever is still queued: the clients give up
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()


def dispatched_tokens(process: KvgateProcess) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{process.config.server.admin_port}/metrics").text
    tokens: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_tokens_reserved_total":
                tokens[sample.labels["tenant"]] = tokens.get(sample.labels["tenant"], 0) + (
                    sample.value)
    return tokens


async def test_two_replicas_share_one_weighted_order(tmp_path):
    with RedisServer() as redis:
        configs = [replica_config(redis.url) for _ in MIXES]
        with KvgateProcess(configs[0], tmp_path, "r1") as r1, \
                KvgateProcess(configs[1], tmp_path, "r2") as r2:
            await asyncio.gather(*(drive(r.target, mix, 6.0, seed)
                                   for seed, (r, mix) in enumerate(zip((r1, r2), MIXES,
                                                                       strict=True))))
            totals: dict[str, float] = {}
            for replica in (r1, r2):
                for tenant, value in dispatched_tokens(replica).items():
                    totals[tenant] = totals.get(tenant, 0) + value
    everything = sum(totals.values())
    shares = {t: totals.get(t, 0) / everything for t in WEIGHTS}
    target = {t: w / sum(WEIGHTS.values()) for t, w in WEIGHTS.items()}
    print("dispatched token shares", {t: round(s, 3) for t, s in shares.items()},
          "target", {t: round(s, 3) for t, s in target.items()}, "tokens", everything)
    for tenant in WEIGHTS:
        assert shares[tenant] == pytest.approx(target[tenant], rel=0.10), (shares, target)
