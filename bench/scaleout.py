"""kvgate processes on one Redis: admissions/s, CPU per admission, and the fleet one Redis
shard carries.

    .venv/bin/python -m bench.scaleout [--duration 8] [--concurrency 16] [--rounds 3]

Set-ups, each its own kvgate process(es) (`kvgate serve`, shipped defaults plus a `redis:`
section) on one redis-server started on a free port:

- ``1 process``: one replica, one worker;
- ``2 replicas``: two `kvgate serve` processes (own gRPC ports);
- ``2 workers``: one `kvgate serve --workers 2` (one port, SO_REUSEPORT).

No Envoy and no engine: ``bench.extproc_client`` speaks to kvgate as Envoy and its Lua meter
do (request headers, body, the usage report, the end of the stream), closed loop,
``--concurrency`` requests in flight per set-up, one tenant with real limits far above the
load (every dimension is checked and charged). Per set-up: admissions/s, kvgate CPU per
admission (all its processes, from `/proc`), Redis CPU per admission, and from `INFO
commandstats` the commands kvgate sent per admission (`EVALSHA` and the like: script calls,
several of which may share a write) and those Redis ran, the ones inside the scripts
included. The model: a Redis shard saturates at one core, so it carries ``1 / Redis CPU per
admission`` admissions/s; a kvgate process at one core does ``1 / kvgate CPU per
admission``; their ratio is the fleet of kvgate processes one shard carries (more shards:
`redis.cluster`, tenants spread by hash tag).

On this 2-core machine the load generator shares the cores with kvgate and Redis, so
admissions/s are a lower bound; CPU per admission is what the model uses. Prints a table and
writes ``bench/results/scaleout.json`` and ``scaleout.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.extproc_client import ExtProcClient
from bench.overhead import _runner, cpu_seconds
from bench.redis_server import RedisServer, command_calls
from extproc.config import hash_api_key, parse_config
from extproc.ports import free_port
from extproc.processes import KvgateProcess

RESULTS = Path(__file__).parent / "results"
KEY = "sk-bench-scaleout"
BODY = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}]}
USAGE = orjson.dumps({"usage": {"prompt_tokens": 4, "completion_tokens": 8}})
LIMITS = {"requests_per_second": 1_000_000, "request_burst": 1_000_000,
          "tokens_per_minute": 1_000_000_000, "max_concurrency": 10_000}
SETUPS = {"1 process": (1, 1), "2 replicas": (2, 1), "2 workers": (1, 2)}  # replicas, workers


def config(redis_url: str, replicas: int) -> Any:
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "redis": {"url": redis_url, "replicas": replicas},
        "tiers": {"t": {"limits": LIMITS}},
        "tenants": [{"name": "bench", "tier": "t", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:9"],
                   "kv_aware": False}],
    })


def family(pid: int) -> list[int]:
    """``pid`` and every process below it (``--workers`` forks its workers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


# what kvgate sends Redis itself (each a round trip, or part of one); INFO commandstats also
# counts every redis.call inside a script
CLIENT_COMMANDS = frozenset(("evalsha", "eval", "evalsha_ro", "script|load", "get", "hgetall"))


def _commands(client: redis.Redis) -> tuple[float, float]:
    """(commands kvgate sent, commands Redis ran including those inside scripts)."""
    calls = command_calls(client.info("commandstats"))
    return sum(v for k, v in calls.items() if k in CLIENT_COMMANDS), sum(calls.values())


async def hammer(targets: list[str], concurrency: int, seconds: float) -> int:
    """Closed loop over ``targets`` (round robin per worker); admitted requests counted."""
    clients = [ExtProcClient(t) for t in targets]
    deadline = time.monotonic() + seconds
    admitted = 0

    async def worker(client: ExtProcClient) -> None:
        nonlocal admitted
        while time.monotonic() < deadline:
            outcome = await client.chat(KEY, BODY, response=USAGE)
            if outcome.status != 200:
                raise RuntimeError(f"not admitted: {outcome}")
            admitted += 1

    await asyncio.gather(*(worker(clients[i % len(clients)]) for i in range(concurrency)))
    for client in clients:
        await client.close()
    return admitted


@contextlib.contextmanager
def setup(redis_url: str, replicas: int, workers: int, workdir: Path
          ) -> Iterator[tuple[list[str], list[int]]]:
    """The set-up's kvgate processes: their gRPC targets and every pid."""
    with contextlib.ExitStack() as stack:
        processes = [stack.enter_context(KvgateProcess(config(redis_url, replicas * workers),
                                                       workdir, f"r{i}", workers=workers))
                     for i in range(replicas)]
        time.sleep(0.5 * workers)  # the workers start after the parent answers
        pids = [p for process in processes for p in family(process.process.pid)]
        yield [process.target for process in processes], pids


def measure(name: str, replicas: int, workers: int, server: RedisServer,
            concurrency: int, duration_s: float, rounds: int, workdir: Path) -> dict[str, Any]:
    client = redis.Redis.from_url(server.url)
    with setup(server.url, replicas, workers, workdir) as (targets, pids), _runner() as runner:
        runner.run(hammer(targets, concurrency, 1.0))  # warm-up
        admitted = 0
        kvgate_cpu = redis_cpu = sent = ran = elapsed = 0.0
        for _ in range(rounds):
            k0, r0, c0 = _cpu(pids), cpu_seconds(server.pid), _commands(client)
            t0 = time.monotonic()
            admitted += runner.run(hammer(targets, concurrency, duration_s / rounds))
            elapsed += time.monotonic() - t0
            kvgate_cpu += _cpu(pids) - k0
            redis_cpu += cpu_seconds(server.pid) - r0
            c1 = _commands(client)
            sent, ran = sent + c1[0] - c0[0], ran + c1[1] - c0[1]
    client.close()
    per = max(admitted, 1)
    row = {"setup": name, "processes": replicas * workers, "admitted": admitted,
           "seconds": elapsed, "admissions_per_s": admitted / elapsed,
           "kvgate_cpu_us_per_admission": kvgate_cpu / per * 1e6,
           "redis_cpu_us_per_admission": redis_cpu / per * 1e6,
           "redis_commands_per_admission": sent / per,
           "redis_commands_run_per_admission": ran / per}
    row["redis_shard_admissions_per_s"] = 1e6 / max(row["redis_cpu_us_per_admission"], 1e-9)
    row["kvgate_process_admissions_per_s"] = 1e6 / max(row["kvgate_cpu_us_per_admission"], 1e-9)
    row["fleet_per_shard"] = (row["redis_shard_admissions_per_s"]
                              / row["kvgate_process_admissions_per_s"])
    return row


HEADER = (f"{'setup':11} {'procs':>5} {'adm/s':>7} {'kvgate µs/adm':>14} {'redis µs/adm':>13} "
          f"{'cmds/adm':>9} {'run/adm':>8} {'shard adm/s':>12} {'fleet/shard':>12}")


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['setup']:11} {r['processes']:>5} {r['admissions_per_s']:>7.0f} "
            f"{r['kvgate_cpu_us_per_admission']:>14.0f} {r['redis_cpu_us_per_admission']:>13.0f} "
            f"{r['redis_commands_per_admission']:>9.2f} "
            f"{r['redis_commands_run_per_admission']:>8.1f} "
            f"{r['redis_shard_admissions_per_s']:>12.0f} "
            f"{r['fleet_per_shard']:>12.1f}")


def markdown(result: dict[str, Any]) -> str:
    lines = ["# kvgate on one Redis: scale-out", "", f"`{result['command']}` — {result['when']}",
             "", "| set-up | processes | admissions/s | kvgate CPU µs/admission | Redis CPU "
             "µs/admission | Redis commands sent/admission | commands run (in scripts too) | "
             "one shard: admissions/s | kvgate processes one shard carries |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['setup']} | {r['processes']} | {r['admissions_per_s']:.0f} | "
                     f"{r['kvgate_cpu_us_per_admission']:.0f} | "
                     f"{r['redis_cpu_us_per_admission']:.0f} | "
                     f"{r['redis_commands_per_admission']:.2f} | "
                     f"{r['redis_commands_run_per_admission']:.1f} | "
                     f"{r['redis_shard_admissions_per_s']:.0f} | {r['fleet_per_shard']:.1f} |")
    lines += ["", "## Method", "", __doc__.split("\n\n", 2)[2].strip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scaleout",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="measured s per set-up")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "scaleout.json")
    args = parser.parse_args(argv)
    print(HEADER)
    rows = []
    with RedisServer() as server, tempfile.TemporaryDirectory() as workdir:
        for name, (replicas, workers) in SETUPS.items():
            server.flushall()
            rows.append(measure(name, replicas, workers, server, args.concurrency,
                                args.duration, args.rounds, Path(workdir)))
            print(format_row(rows[-1]), flush=True)
    result = {"command": " ".join(["python", "-m", "bench.scaleout",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
