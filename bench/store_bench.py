"""Admission decisions per second and their latency, in-memory vs Redis, in one run.

    .venv/bin/python -m bench.store_bench [--decisions 5000] [--concurrency 16]

Each decision is one ``admit`` (every dimension checked and consumed atomically) followed by
its ``release`` (tokens reconciled, lease freed), as the request path does. Starts its own
redis-server on a free port. Prints a table and writes ``bench/results/store.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.redis_server import RedisServer
from limiter import Cost, Rate, TenantPolicy
from limiter.stores import LimiterStore, MemoryStore

RESULTS = Path(__file__).parent / "results"
POLICY = TenantPolicy(
    request_rate=Rate.per_second(1e6), request_burst=1_000_000,
    token_rate=Rate.per_minute(1e9), token_burst=1_000_000_000,
    max_concurrency=10_000, max_context_tokens=100_000,
    window_limit=1_000_000, window_ms=1000,
)
COST = Cost(prompt_tokens=500, max_output_tokens=200)


async def _one(store: LimiterStore, tenant: str, n: int) -> tuple[int, int]:
    lease = f"{tenant}-{n}"
    started = time.perf_counter_ns()
    await store.admit(tenant, POLICY, COST, lease)
    admitted = time.perf_counter_ns()
    await store.release(tenant, POLICY, lease, 650)
    return admitted - started, time.perf_counter_ns() - admitted


async def measure(store: LimiterStore, decisions: int, concurrency: int) -> dict[str, float]:
    latencies: list[int] = []
    releases: list[int] = []
    counter = iter(range(decisions))

    async def worker(w: int) -> None:
        for n in counter:
            admit_ns, release_ns = await _one(store, f"tenant{w % 8}", n)
            latencies.append(admit_ns)
            releases.append(release_ns)

    for n in range(200):  # warm-up: scripts loaded, connections open
        await _one(store, "warmup", n)
    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    q = statistics.quantiles(latencies, n=100)
    return {
        "decisions_per_s": decisions / elapsed,
        "admit_p50_us": q[49] / 1000,
        "admit_p99_us": q[98] / 1000,
        "release_p50_us": statistics.median(releases) / 1000,
    }


async def run(decisions: int, concurrency: int) -> list[dict[str, object]]:
    import redis.asyncio as aioredis

    from limiter.stores.redis_store import RedisStore

    rows: list[dict[str, object]] = []
    with RedisServer() as server:
        client = aioredis.from_url(server.url)
        stores: dict[str, Callable[[], Awaitable[LimiterStore] | LimiterStore]] = {
            "memory": MemoryStore,
            "redis": lambda: RedisStore(client, prefix="bench"),
        }
        for name, make in stores.items():
            for level in sorted({1, concurrency}):
                store = make()
                result = await measure(store, decisions, level)  # type: ignore[arg-type]
                rows.append({"store": name, "concurrency": level, **result})
        await client.aclose()
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print(f"{'store':8} {'conc':>4} {'decisions/s':>12} {'admit p50 µs':>13} "
          f"{'admit p99 µs':>13} {'release p50 µs':>15}")
    for r in rows:
        print(f"{r['store']:8} {r['concurrency']:>4} {r['decisions_per_s']:>12,.0f} "
              f"{r['admit_p50_us']:>13.1f} {r['admit_p99_us']:>13.1f} "
              f"{r['release_p50_us']:>15.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "store.json")
    args = parser.parse_args()
    rows = asyncio.run(run(args.decisions, args.concurrency))
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python -m bench.store_bench " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
