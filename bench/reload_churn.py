"""Reload churn: what a removed tenant leaves behind in a running kvgate.

    .venv/bin/python -m bench.reload_churn [--reloads 200] [--tenants 20] [--mode memory]
        [--outage-every 0] [--distinct-limits] [--daily-quota 0] [--out FILE.json]

A platform that rotates tenant names (per-customer keys added and removed every day, a
config generator) reloads kvgate with new tenants and without old ones. This runs one
in-process kvgate (``KvgateServer``, no ports) and, ``--reloads`` times: writes a config
whose ``--tenants`` tenants all have fresh names (the previous round's are removed),
reloads it as SIGHUP does, and sends each new tenant two requests through the director —
one placed at once and one that waits in the fair queue and is then dispatched — each
counted in the metrics as a stream counts it and released with its usage. So every
per-tenant map a request touches is touched: the tenants' policies, the schedulers'
weights, the limits store, the fair-queue counters, the metrics' label sets.

``--mode redis`` starts a real redis-server (``redis:`` with ``failure_policy: local``);
``--outage-every N`` pauses it (SIGSTOP) during every Nth round, so that round's tenants
are served by the local fallback and some of their Redis calls are owed until it answers.
``--distinct-limits`` gives every tenant its own request rate (a policy of its own);
``--daily-quota`` every tenant a daily token quota (whose count outlives the tenant until
the day ends).

Prints, every tenth of the run, the sizes of those maps and the process's RSS, and writes
them as JSON with ``--out``. Nothing here asserts: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client import generate_latest

import kvgate_native
from extproc.config import hash_api_key, parse_config
from extproc.datalayer.endpoints import ScrapeResult
from extproc.datalayer.metrics import EngineMetrics
from extproc.director import Admission
from extproc.openai import parse_body
from extproc.server import KvgateServer

ENDPOINT = "127.0.0.1:1"


def config_data(round_: int, tenants: int, distinct: bool, redis_url: str | None,
                daily_quota: int = 0) -> dict[str, Any]:
    limits: dict[str, Any] = {"requests_per_second": 50, "tokens_per_minute": 600_000,
                              "max_concurrency": 8}
    if daily_quota:
        limits["daily_token_quota"] = daily_quota
    data: dict[str, Any] = {
        "tiers": {"std": {"weight": 1, "limits": limits}},
        "queue": {"aging_s": None},
        "tenants": [],
        "pools": [{"name": "p", "models": ["m"], "endpoints": [ENDPOINT]}],
        "server": {"grpc_port": 0, "admin_port": 0, "report_port": 0, "reload_poll_s": 0},
    }
    for i in range(tenants):
        name = f"t{round_}-{i}"
        tenant: dict[str, Any] = {"name": name, "tier": "std",
                                  "api_keys": [hash_api_key(f"sk-{name}")]}
        if distinct:
            tenant["limits"] = {"requests_per_second": 50 + round_ * tenants + i}
        data["tenants"].append(tenant)
    if redis_url is not None:
        data["redis"] = {"url": redis_url, "failure_policy": "local", "timeout_ms": 50,
                         "breaker_failures": 1, "breaker_open_ms": 200}
    return data


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def sizes(server: KvgateServer) -> dict[str, int]:
    """The per-tenant maps, by where they live (0 where this build has no such map)."""
    director = server.director
    store: Any = director.store
    memory = getattr(store, "local", store)  # FailoverStore's fallback, or the store itself
    fair: Any = director.flows["p"].fairness
    core = getattr(fair, "local", fair).core
    metrics = server.metrics
    tallies = [metrics.requests, metrics.tokens_reserved, metrics.tokens_used,
               metrics.tokens_refunded, metrics.in_flight]
    gc.collect()
    out = {
        "tenants_policies": len(director.tenants._policies),
        "scheduler_weights": len(director.schedulers["p"].weights),
        "store_limiters": len(memory._tenants),
        "store_fading": len(getattr(memory, "_fading", ())),
        "store_quota_residue": len(getattr(memory, "_quotas_left", ())),
        "fair_counters": len(core._counters) + len(core._firsts),
        "metrics_tenant_names": len(metrics.tenants),
        "metrics_tenant_series": sum(len(t.values) for t in tallies),
        "metrics_bytes": len(generate_latest(metrics.registry)),
        "rss_kib": rss_kib(),
    }
    if store is not memory:  # the Redis mode's FailoverStore
        out |= {"failover_blocked": len(store._blocked),
                "failover_local_policies": len(store._local_policies),
                "failover_owed": len(store._owed),
                "redis_key_cache": len(store.primary._keys),
                "redis_packed_keys": len(store.primary._scripts._packed_keys)}
    return out


async def set_usage(server: KvgateServer, usage: float) -> None:
    metrics = EngineMetrics(kv_cache_usage=usage, kv_capacity_tokens=1000)
    await server.endpoints.apply([ScrapeResult(ENDPOINT, time.monotonic(), metrics)])
    server.director.kick()


async def one_round(server: KvgateServer, names: list[str]) -> None:
    """Two requests per tenant: one placed at once, one queued then dispatched."""
    director, metrics = server.director, server.metrics
    body = orjson.dumps({"model": "m", "max_tokens": 100,
                         "messages": [{"role": "user", "content": "x" * 40}]})

    async def request(name: str) -> Admission | None:
        tenant = director.authenticate(f"Bearer sk-{name}")
        outcome = await director.admit(tenant, parse_body("/v1/chat/completions", body))
        if not isinstance(outcome, Admission):
            metrics.decided(name, "m", None, "rejected", str(getattr(outcome, "reason", "")))
            return None
        metrics.admitted(name, "m", outcome.request_class, outcome.cost.tokens)
        return outcome

    async def finish(admission: Admission | None) -> None:
        if admission is not None:
            metrics.finished(admission.tenant.name, "m", admission.cost.tokens, 150, 40,
                             "usage")
            await director.release(admission, 150, 40)

    await set_usage(server, 0.1)
    for name in names:
        await finish(await request(name))
    await set_usage(server, 0.99)  # saturated: these wait in the fair queue
    tasks = [asyncio.create_task(request(name)) for name in names]
    await asyncio.sleep(0.01)
    await set_usage(server, 0.1)
    for task in asyncio.as_completed(tasks):  # each release makes room for the next
        await finish(await task)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    redis = None
    if args.mode == "redis":
        from bench.redis_server import RedisServer

        redis = RedisServer()
        redis.start()
    url = None if redis is None else f"redis://127.0.0.1:{redis.port}"
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kvgate.yaml"

        def write(round_: int) -> None:
            data = config_data(round_, args.tenants, args.distinct_limits, url,
                               args.daily_quota)
            path.write_text(yaml.safe_dump(data))

        write(0)
        server = KvgateServer(parse_config(yaml.safe_load(path.read_text())),
                              config_path=path)
        await server.endpoints.set_endpoints("p", [ENDPOINT])
        for flow in server.director.flows.values():
            flow.start()
        every = max(1, args.reloads // 10)
        started = time.monotonic()
        try:
            for round_ in range(args.reloads + 1):
                if round_:
                    write(round_)
                    assert server.reload("churn"), "the reload was rejected"
                outage = bool(redis and args.outage_every and round_
                              and round_ % args.outage_every == 0)
                if outage:
                    redis.pause()
                try:
                    await one_round(server, [f"t{round_}-{i}" for i in range(args.tenants)])
                finally:
                    if outage:
                        redis.resume()
                        await asyncio.sleep(0.3)  # the repair loop tells Redis what it owes
                if round_ % every == 0 or round_ == args.reloads:
                    sample = {"round": round_, "tenants_ever": (round_ + 1) * args.tenants,
                              "s": round(time.monotonic() - started, 1), **sizes(server)}
                    samples.append(sample)
                    print(json.dumps(sample), flush=True)
        finally:
            for flow in server.director.flows.values():
                await flow.stop()
            with contextlib.suppress(Exception):
                await server.director.store.close()
            if redis is not None:
                redis.stop()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reloads", type=int, default=200)
    parser.add_argument("--tenants", type=int, default=20, help="fresh tenants per reload")
    parser.add_argument("--mode", choices=["memory", "redis"], default="memory")
    parser.add_argument("--outage-every", type=int, default=0,
                        help="redis mode: pause Redis during every Nth round (0: never)")
    parser.add_argument("--distinct-limits", action="store_true",
                        help="every tenant its own request rate (a policy of its own)")
    parser.add_argument("--daily-quota", type=int, default=0,
                        help="a daily token quota for every tenant (0: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    samples = asyncio.run(run(args))
    if args.out:
        command = " ".join([".venv/bin/python -m bench.reload_churn", *sys.argv[1:]])
        args.out.write_text(json.dumps({"command": command, "kvgate": kvgate_native.status(),
                                        "args": vars(args) | {"out": str(args.out)},
                                        "samples": samples}, indent=1) + "\n")


if __name__ == "__main__":
    main()
