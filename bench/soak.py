"""A soak: minutes of mixed traffic through Envoy + kvgate, then nothing may be left held.

    .venv/bin/python -m bench.soak [--duration 600] [--rate 8] [--modes memory,redis]
        [--seed 1] [--out bench/results/soak.json]

Per mode, one stack runs for the whole duration, the modes side by side: two simulated vLLM
engines (small KV caches, so the pool saturates and requests queue), a ``kvgate serve``
subprocess on its shipped defaults plus the workload's tenants (``redis`` mode adds a
``redis:`` section and a real redis-server), and Envoy on the rendered bootstrap. An open-loop
seeded Poisson client sends a mix: interactive and batch requests, streamed and not, from three
tenants — one within its limits, one limited by concurrency, one by request rate (so 429s are
part of the traffic) — and cancels a share of them mid-stream or while queued.

It checks, and prints as PASS/FAIL:
- only expected statuses: 200, 429 (tenant limits, share), 503 (pool saturated), and the
  client's own cancellations; anything else (a 5xx but 503, a connection error) is an error;
- once traffic stops and streams drain: every tenant's ``in_flight`` is 0 (admin API), no
  request queued (``/debug/queues``), and in Redis no lease left in any tenant's lease set;
- kvgate's RSS grew less than 10% from the first sample after the warm-up to the end.

Writes ``--out`` (JSON: every sample and count) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.loadgen import poisson_times, prompt_text
from bench.redis_server import RedisServer
from extproc.config import Config, hash_api_key, parse_config
from extproc.ports import free_port
from extproc.processes import KvgateProcess

ENGINE = {"ms_per_token": 10, "kv_blocks": 48, "block_size": 16, "max_num_seqs": 16}
TENANTS = {  # name: (key, share of arrivals, limits)
    "acme": ("sk-soak-acme", 0.5, {}),
    "globex": ("sk-soak-globex", 0.3, {"max_concurrency": 2}),
    "hobby": ("sk-soak-hobby", 0.2, {"requests_per_second": 1, "request_burst": 3}),
}
EXPECTED = frozenset({200, 429, 503})
WARMUP_S = 60.0
RSS_GROWTH_LIMIT = 0.10
DRAIN_TIMEOUT_S = 30.0


def soak_config(endpoints: list[str], redis_url: str | None) -> Config:
    """The workload (tenants, one pool of two small engines); every admission, queueing and
    scheduling knob is the shipped default."""
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {name: {"limits": limits} for name, (_, _, limits) in TENANTS.items()},
        "tenants": [{"name": name, "tier": name, "default_class": "interactive",
                     "api_keys": [hash_api_key(key)]} for name, (key, _, _) in TENANTS.items()],
        "pools": [{"name": "soak", "models": ["tiny-llama"], "endpoints": endpoints,
                   "priority_scheduling": True}],
        **({"redis": {"url": redis_url}} if redis_url else {}),
    })


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)

    def unexpected(self) -> int:
        return sum(n for s, n in self.statuses.items() if not s.isdigit()
                   or int(s) not in EXPECTED)


def _body(rng: random.Random) -> tuple[dict[str, Any], str]:
    interactive = rng.random() < 0.7
    prompt = rng.randint(20, 80) if interactive else rng.randint(150, 350)
    output = rng.randint(8, 48) if interactive else rng.randint(48, 128)
    body = {"model": "tiny-llama", "max_tokens": output, "stream": rng.random() < 0.7,
            "messages": [{"role": "user", "content": prompt_text(prompt, rng)}]}
    return body, "interactive" if interactive else "batch"


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random,
               tally: Tally) -> None:
    name = rng.choices(list(TENANTS), [share for _, share, _ in TENANTS.values()])[0]
    body, klass = _body(rng)
    headers = {"authorization": f"Bearer {TENANTS[name][0]}", "x-request-class": klass}
    cancel_after = rng.uniform(0.02, 1.5) if rng.random() < 0.1 else None
    try:
        async with asyncio.timeout(cancel_after):
            async with session.post(f"{url}/v1/chat/completions", json=body,
                                    headers=headers) as resp:
                await resp.read()
                tally.statuses[str(resp.status)] += 1
    except TimeoutError:
        tally.cancelled += 1  # the client went away: kvgate must release what it held
    except aiohttp.ClientError as error:
        tally.statuses["connection_error"] += 1
        if len(tally.errors) < 20:
            tally.errors.append(repr(error))


async def drive(url: str, duration_s: float, rate: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = []
        for at in poisson_times(rate, duration_s, rng):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(_one(session, url, random.Random(rng.random()),
                                                  tally)))
        await asyncio.gather(*tasks)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def sample_rss(pid: int, stop: asyncio.Event, samples: list[tuple[float, int]]) -> None:
    start = time.monotonic()
    while not stop.is_set():
        samples.append((round(time.monotonic() - start, 1), rss_kib(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 10)
    samples.append((round(time.monotonic() - start, 1), rss_kib(pid)))


def held(config: Config) -> dict[str, Any]:
    """What kvgate still holds: per-tenant in-flight and queued requests (admin API)."""
    admin = f"http://127.0.0.1:{config.server.admin_port}"
    in_flight = {name: httpx.get(f"{admin}/admin/tenants/{name}/usage").json()["in_flight"]
                 for name in TENANTS}
    queued = sum(p["queued"] for p in httpx.get(f"{admin}/debug/queues").json()["pools"])
    return {"in_flight": in_flight, "queued": queued}


def queue_events(config: Config) -> dict[str, float]:
    """``kvgate_queue_events_total`` by event: shows the run really queued, dispatched and
    cancelled queued requests."""
    text = httpx.get(f"http://127.0.0.1:{config.server.admin_port}/metrics").text
    events: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("kvgate_queue_events_total{"):
            labels, value = line.rsplit(" ", 1)
            event = labels.split('event="', 1)[1].split('"', 1)[0]
            events[event] += float(value)
    return dict(events)


def redis_leases(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    total = 0
    for key in client.scan_iter(match="*:leases"):
        kind = client.type(key)
        total += client.zcard(key) if kind == b"zset" else client.hlen(key)
    return total


@contextlib.contextmanager
def stack(mode: str, workdir: Path) -> Iterator[tuple[Config, KvgateProcess, str | None]]:
    from extproc.engine.server import EngineProcess
    from extproc.envoy_proc import EnvoyProcess

    with contextlib.ExitStack() as exits:
        redis_url = None
        if mode == "redis":
            redis_url = exits.enter_context(RedisServer()).url
        endpoints = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        for endpoint in endpoints:
            exits.enter_context(EngineProcess(port=int(endpoint.split(":")[1]),
                                              scheduling_policy="priority", **ENGINE))
        config = soak_config(endpoints, redis_url)
        kvgate = exits.enter_context(KvgateProcess(config, workdir, name=f"kvgate-{mode}"))
        exits.enter_context(EnvoyProcess(config))
        yield config, kvgate, redis_url


async def soak_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with stack(mode, workdir) as (config, kvgate, redis_url):
        await asyncio.sleep(1.0)  # a few scrape rounds: the engines are seen fresh
        assert kvgate.process is not None
        pid, tally, samples, stop = kvgate.process.pid, Tally(), [], asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, stop, samples))
        url = f"http://127.0.0.1:{config.envoy.listen_port}"
        await drive(url, args.duration, args.rate, args.seed, tally)
        left = await _drained(config)
        left["queue_events"] = await asyncio.to_thread(queue_events, config)
        stop.set()
        await sampler
        leases = redis_leases(redis_url) if redis_url else None
    return _verdict(mode, tally, samples, left, leases)


async def _drained(config: Config) -> dict[str, Any]:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        left = await asyncio.to_thread(held, config)
        if (not any(left["in_flight"].values()) and not left["queued"]) or \
                time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.5)


def _verdict(mode: str, tally: Tally, samples: list[tuple[float, int]],
             left: dict[str, Any], leases: int | None) -> dict[str, Any]:
    after_warmup = [kib for at, kib in samples if at >= WARMUP_S] or [samples[-1][1]]
    growth = (samples[-1][1] - after_warmup[0]) / after_warmup[0]
    checks = {
        "only_expected_statuses": tally.unexpected() == 0,
        "nothing_held": not any(left["in_flight"].values()) and not left["queued"],
        "no_redis_leases": leases in (None, 0),
        "rss_growth_below_10pct": growth < RSS_GROWTH_LIMIT,
    }
    return {"mode": mode, "statuses": dict(tally.statuses), "cancelled": tally.cancelled,
            "errors": tally.errors, "held_after": left, "redis_leases_after": leases,
            "rss_kib": samples, "rss_growth": round(growth, 4), "checks": checks,
            "pass": all(checks.values())}


def table(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"# Soak\n\nCommand: `{command}`\n",
             "| mode | requests | 200 | 429 | 503 | cancelled | other | queued → dispatched | "
             "held after | Redis leases after | RSS start → end (MiB) | growth | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["statuses"]
        other = sum(n for k, n in s.items() if k not in ("200", "429", "503"))
        total = sum(s.values()) + r["cancelled"]
        rss = [kib for _, kib in r["rss_kib"]]
        start = next((kib for at, kib in r["rss_kib"] if at >= WARMUP_S), rss[-1])
        held_after = sum(r["held_after"]["in_flight"].values()) + r["held_after"]["queued"]
        lines.append(
            f"| {r['mode']} | {total} | {s.get('200', 0)} | {s.get('429', 0)} | "
            f"{s.get('503', 0)} | {r['cancelled']} | {other} | "
            f"{_queued(r['held_after']['queue_events'])} | {held_after} | "
            f"{'—' if r['redis_leases_after'] is None else r['redis_leases_after']} | "
            f"{start / 1024:.1f} → {rss[-1] / 1024:.1f} | {100 * r['rss_growth']:+.1f}% | "
            f"{'PASS' if r['pass'] else 'FAIL ' + str(r['checks'])} |")
    return "\n".join(lines) + "\n"


def _queued(events: dict[str, float]) -> str:
    return f"{sum(events.values()):.0f} → {events.get('dispatched', 0):.0f}"


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return list(await asyncio.gather(*(soak_mode(mode, args, Path(tmp))
                                           for mode in args.modes.split(","))))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second, per mode")
    p.add_argument("--modes", default="memory,redis")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="bench/results/soak.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    results = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command.strip(), "results": results}, indent=1))
    report = table(results, command.strip())
    out.with_suffix(".md").write_text(report)
    print(report)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
