"""What kvgate costs per request, next to plain Envoy and a do-nothing Python ext_proc.

    .venv/bin/python -m bench.overhead [--duration 10] [--warmup 2] [--levels 1,16,64]
        [--modes direct,minimal,kvgate,kvgate_redis] [--layout split|shared|none]
        [--no-equal-rate]
    .venv/bin/python -m bench.overhead --profile   # py-spy over kvgate and the floor, c=16

One run; per mode, a simulated engine (``extproc.engine``, every step of its loop 0 s: it answers a
non-streaming chat completion at once) behind its own Envoy (``--concurrency 1``):

- ``direct``: Envoy → engine; no ext_proc filter, the upstream cluster STATIC to the engine.
- ``minimal``: Envoy + ``bench.minimal_extproc`` (CONTINUE to everything) — the Python floor.
  kvgate's rendered bootstrap with one change: the upstream cluster is STATIC to the engine
  (the floor routes nothing). The ext_proc filter and every other setting are kvgate's; the
  floor's headers reply turns on the processing modes kvgate's does for an inference request
  (request body BUFFERED, response body STREAMED; headers SEND, response headers SKIP).
- ``kvgate``: ``kvgate serve -c FILE`` (in-memory limits) and its rendered bootstrap, as is:
  API key, body parse, admission against every limit, KV-aware placement on the engine's
  scraped metrics, body mutation, response accounting.
- ``kvgate_redis``: the same with a ``redis:`` section (a redis-server on a free port).
- ``kvgate_headers``: in-memory with ``envoy.request_attributes: false``: the headers phase
  first, two ext_proc messages per request where the shipped default sends one.

All modes run side by side for the whole run. Each concurrency level gives every mode
``--duration`` seconds of a closed loop of N aiohttp clients, cut into ``--rounds`` windows
taken in turn (mode after mode, round after round, each after a warm-up), so that whatever
else this shared machine runs meanwhile falls on every mode alike. Per mode and level:
requests/s, p50/p99 latency, the CPU of every process (utime + stime of ``/proc/PID/stat``,
all threads, read before and after each window) divided by the requests completed, and the
ext_proc messages per request (kvgate's ``kvgate_extproc_messages_total``; the floor counts
its own). By default (``--layout split``) the ext_proc servers run alone on core 1; Envoy, the
load generator, the engines and Redis on core 0 (``LAYOUTS`` below).

Prints a table and writes ``bench/results/overhead.json`` and ``overhead.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

import kvgate_native
from bench.redis_server import RedisServer, command_calls
from extproc.config import hash_api_key, parse_config
from extproc.engine.server import EngineProcess
from extproc.envoy_config import (
    EXT_PROC_CLUSTER,
    METER_FILTER,
    REPORT_CLUSTER,
    UPSTREAM_CLUSTER,
    render_bootstrap,
)
from extproc.envoy_proc import EnvoyProcess, find_envoy
from extproc.ports import free_port
from extproc.processes import stop_process
from extproc.server import new_event_loop

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
MODES = ("direct", "minimal", "kvgate", "kvgate_redis", "kvgate_headers")
LEVELS = (1, 16, 64)
PROCESS_ROLES = ("envoy", "ext_proc", "engine", "redis", "loadgen")
# Who runs on which core. ``split`` (the default) gives the ext_proc server a core of its
# own, as a separate container with its own CPU would have in production: its CPU per
# request is then its own. ``shared`` puts Envoy on the ext_proc's core: each then preempts
# the other on every message, and both processes' CPU per request grows with the ext_proc's
# latency (kept to show that effect; see the README).
LAYOUTS: dict[str, dict[str, set[int]]] = {
    "split": {"ext_proc": {1}, "envoy": {0}, "engine": {0}, "redis": {0}, "loadgen": {0}},
    "shared": {"ext_proc": {1}, "envoy": {1}, "engine": {0}, "redis": {0}, "loadgen": {0}},
}
LAYOUT_TEXT = {
    "split": "ext_proc servers alone on core 1; Envoys, load generator, engines and Redis "
             "on core 0",
    "shared": "Envoys + ext_proc servers on core 1; load generator, engines and Redis on "
              "core 0",
    "none": "none (all processes float on both cores)",
}
# The equal-rate rows: every mode paced at this share of the slowest mode's closed-loop rate
# at c=CPU_RATIO_LEVEL, measured in the same run (slower than any of them can go).
EQUAL_RATE_SHARE = 0.75
ROUND_WARMUP_S = 0.5  # before each window after a level's first
IDLE_S = 3.0  # each gateway's CPU with no load, measured once: its background cost per second

API_KEY = "sk-bench-overhead"
MODEL = "tiny-llama"
MAX_TOKENS = 4
BODY = json.dumps({
    "model": MODEL, "max_tokens": MAX_TOKENS, "stream": False,
    "messages": [{"role": "user", "content": "Say hello to the overhead benchmark, please."}],
}).encode()
HEADERS = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
# Streamed rows (--streams): one request of N output tokens per turn, at c=STREAM_LEVEL, on
# an engine that spends STREAM_MS_PER_TOKEN per decode step, so tokens come as separate
# chunks as from a real engine; only the floor and kvgate (Envoy direct for reference).
STREAMS = (64, 512)
STREAM_LEVEL = 16
STREAM_MS_PER_TOKEN = 2
STREAM_MODES = ("direct", "minimal", "kvgate", "kvgate_headers")


def request_body(stream_tokens: int) -> bytes:
    """The benchmark's request: non-streamed ``MAX_TOKENS`` (0), or a stream of N tokens."""
    if not stream_tokens:
        return BODY
    return json.dumps({
        "model": MODEL, "max_tokens": stream_tokens, "stream": True,
        "messages": [{"role": "user", "content": "Stream to the overhead benchmark, please."}],
    }).encode()
# Real limits on every dimension the example config uses, set far above what the run sends:
# every admission checks and charges them all, none rejects.
LIMITS = {
    "requests_per_second": 1_000_000, "request_burst": 1_000_000,
    "tokens_per_minute": 1_000_000_000, "max_concurrency": 10_000,
    "max_context_tokens": 100_000,
}
# Every step of the engine's loop takes no time: it answers as fast as its HTTP layer can.
# (Any step time > 0 sleeps; the asyncio loop rounds such sleeps up to its 1 ms clock.)
ENGINE_OPTIONS = {"model": MODEL, "scheduling_policy": "priority", "ms_per_token": 0,
                  "prefill_us_per_token": 0, "decode_us_per_seq": 0}

# Targets from the issues.
CPU_RATIO_TARGET = 1.25  # kvgate ext_proc CPU/request ÷ the floor's, at the reference level
STREAM_CPU_TARGET = 2.0  # kvgate CPU/request streamed (longest) ÷ its own non-streamed
STREAM_LATENCY_TARGET = 1.05  # kvgate's TTFT and total time ÷ the floor's, same streams
CPU_RATIO_LEVEL = 16  # the floor's level of reference: c=16
P50_DELTA_TARGET_MS = 1.5  # kvgate p50 − Envoy-direct p50 at c=1


# -- processes and their CPU ---------------------------------------------------------------


def cpu_seconds(pid: int, *, main_thread: bool = False) -> float:
    """utime + stime of a process, all its threads (``main_thread``: its first thread
    alone: the event loop, where Python runs), in seconds."""
    path = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_busy_seconds() -> list[float]:
    """Busy time of each core since boot (``/proc/stat``: all but idle and iowait)."""
    busy = []
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name != "cpu":
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, ticks[:8])
                busy.append((user + nice + system + irq + softirq + steal)
                            / os.sysconf("SC_CLK_TCK"))
    return busy


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid``; threads started later inherit it from their creator."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return response.status == 200
    except OSError:
        return False


class Child:
    """A Python subprocess of the benchmark; its output is kept for error messages."""

    def __init__(self, name: str, args: Sequence[str], prefix: Sequence[str] = ()):
        self.name = name
        self.command = [*prefix, sys.executable, *args]  # prefix: a wrapper (valgrind)
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready: Callable[[], bool], timeout: float = 30) -> Child:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(self.command, cwd=ROOT, env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{self.log()}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_process(self.process)


# -- configs and bootstraps ----------------------------------------------------------------


def kvgate_config(engine: str, grpc_port: int, admin_port: int,
                  redis_url: str | None = None, cpu_policy: str = "batch",
                  attributes: bool | None = None) -> dict[str, Any]:
    """One tenant, one pool of one engine; the same file for every mode's bootstrap."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "grpc_port": grpc_port, "admin_port": admin_port,
                   "cpu_policy": cpu_policy},
        "envoy": {"listen_port": free_port(), "admin_port": 0},
        "tiers": {"bench": {"limits": LIMITS}},
        "tenants": [{"name": "bench", "tier": "bench", "api_keys": [hash_api_key(API_KEY)]}],
        "pools": [{"name": "bench", "models": [{"name": MODEL, "default_max_tokens": 16}],
                   "endpoints": [engine], "priority_scheduling": True}],
    }
    if redis_url is not None:
        config["redis"] = {"url": redis_url}
    if attributes is not None:  # else the default
        config["envoy"]["request_attributes"] = attributes
    return config


def _http_filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    listener = bootstrap["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]


def static_upstream(bootstrap: dict[str, Any], host: str, port: int) -> dict[str, Any]:
    """The bootstrap with its upstream cluster STATIC to one engine (nothing to route)."""
    bootstrap = copy.deepcopy(bootstrap)
    clusters = bootstrap["static_resources"]["clusters"]
    for i, cluster in enumerate(clusters):
        if cluster["name"] == UPSTREAM_CLUSTER:
            address = {"socket_address": {"address": host, "port_value": port}}
            clusters[i] = {
                "name": UPSTREAM_CLUSTER,
                "type": "STATIC",
                "connect_timeout": cluster["connect_timeout"],
                "circuit_breakers": cluster["circuit_breakers"],
                "load_assignment": {
                    "cluster_name": UPSTREAM_CLUSTER,
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
                },
            }
    return bootstrap


def without(bootstrap: dict[str, Any], filter_name: str, cluster_name: str) -> dict[str, Any]:
    """The bootstrap with one HTTP filter (and the cluster it calls) taken out."""
    bootstrap = copy.deepcopy(bootstrap)
    filters = _http_filters(bootstrap)
    filters[:] = [f for f in filters if f["name"] != filter_name]
    clusters = bootstrap["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] != cluster_name]
    return bootstrap


def without_meter(bootstrap: dict[str, Any]) -> dict[str, Any]:
    return without(bootstrap, METER_FILTER, REPORT_CLUSTER)


def without_ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    return without(bootstrap, "envoy.filters.http.ext_proc", EXT_PROC_CLUSTER)


def bootstrap_for(mode: str, config: dict[str, Any], engine: EngineProcess) -> dict[str, Any]:
    """kvgate's rendered bootstrap; the floor's is the same (headers phase on) with a STATIC
    upstream and no Lua meter (it meters over ext_proc itself), Envoy direct's without
    ext_proc too."""
    if mode.startswith("kvgate"):
        return render_bootstrap(parse_config(config))
    # the floor meters over ext_proc from the headers phase on (its reply sets the modes)
    config = {**config, "envoy": {**config["envoy"], "request_attributes": False}}
    rendered = render_bootstrap(parse_config(config))
    static = without_meter(static_upstream(rendered, engine.host, engine.port))
    return without_ext_proc(static) if mode == "direct" else static


# -- one mode's running gateway ------------------------------------------------------------

Counters = Callable[[], Awaitable[dict[str, float]]]
_SERIES = re.compile(r"^(kvgate_\w+_total)(\{[^}]*\})? (\S+)$", re.MULTILINE)
_KIND = re.compile(r'kind="([^"]+)"')


_BY_KIND = {"kvgate_extproc_messages_total": "messages", "kvgate_meter_reports_total": "reports"}


def parse_counters(text: str) -> dict[str, float]:
    """kvgate's ``/metrics`` counters; ext_proc messages as ``messages:<kind>``, the Lua
    meter's reports as ``reports:<kind>``."""
    counters = {}
    for name, labels, value in _SERIES.findall(text):
        kind = _KIND.search(labels) if name in _BY_KIND else None
        counters[f"{_BY_KIND[name]}:{kind.group(1)}" if kind else name + labels] = float(value)
    return counters


def kvgate_counters(admin_port: int) -> Counters:
    async def read() -> dict[str, float]:
        url = f"http://127.0.0.1:{admin_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return parse_counters(await response.text())

    return read


def minimal_counters(stats_port: int) -> Counters:
    async def read() -> dict[str, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", stats_port)
        stats = json.loads(await reader.read())
        writer.close()
        return {f"messages:{kind}": float(n) for kind, n in stats["messages"].items()}

    return read


def redis_counters(url: str, also: Counters) -> Counters:
    """``also``'s counters and Redis's ``INFO commandstats`` calls as ``redis:<command>``."""
    import redis.asyncio as aioredis

    async def read() -> dict[str, float]:
        client = aioredis.Redis.from_url(url)
        try:
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
        counted = {f"redis:{name}": float(n) for name, n in command_calls(stats).items()}
        return await also() | counted

    return read


async def _no_counters() -> dict[str, float]:
    return {}


@dataclass
class Gateway:
    mode: str
    url: str
    pids: dict[str, int]  # role → pid
    counters: Counters = _no_counters
    commands: dict[str, str] = field(default_factory=dict)


def _start_kvgate(config: dict[str, Any], workdir: Path, prefix: Sequence[str] = ()) -> Child:
    path = workdir / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    health = f"http://127.0.0.1:{config['server']['admin_port']}/healthz"
    args = ["-m", "extproc.cli", "--log-level", "warning", "serve", "-c", str(path)]
    return Child("kvgate", args, prefix).start(lambda: _http_ok(health), _start_s(prefix))


def _start_minimal(grpc_port: int, stats_port: int, cpu_policy: str,
                   prefix: Sequence[str] = ()) -> Child:
    args = ["-m", "bench.minimal_extproc", "--port", str(grpc_port),
            "--stats-port", str(stats_port), "--cpu-policy", cpu_policy]
    return Child("minimal ext_proc", args, prefix).start(lambda: _port_accepts(stats_port),
                                                         _start_s(prefix))


def _start_s(prefix: Sequence[str]) -> float:
    """How long a start may take: a wrapper such as valgrind slows it ~50×."""
    return 600 if prefix else 30


def _start_ext_proc(mode: str, config: dict[str, Any], workdir: Path, prefix: Sequence[str] = ()
                    ) -> tuple[Child, Counters] | None:
    """kvgate or the floor, listening where the config's bootstrap sends ext_proc."""
    if mode.startswith("kvgate"):
        return (_start_kvgate(config, workdir, prefix),
                kvgate_counters(config["server"]["admin_port"]))
    if mode == "minimal":
        stats_port = free_port()
        child = _start_minimal(config["server"]["grpc_port"], stats_port,
                               config["server"]["cpu_policy"], prefix)
        return child, minimal_counters(stats_port)
    return None


@contextlib.contextmanager
def gateway(mode: str, *, layout: str = "split", cpu_policy: str = "batch",
            ms_per_token: float = 0, ext_proc_prefix: Sequence[str] = ()) -> Iterator[Gateway]:
    """Start what ``mode`` needs, its own engine included; stop it all on exit.
    ``ext_proc_prefix``: a command the ext_proc process runs under (``bench.instructions``:
    valgrind)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-bench-")))
        engine = stack.enter_context(
            EngineProcess(**{**ENGINE_OPTIONS, "ms_per_token": ms_per_token}))
        assert engine.proc is not None
        gw = Gateway(mode, "", {"engine": engine.proc.pid})
        redis_url = None
        if mode == "kvgate_redis":
            redis_server = stack.enter_context(RedisServer())
            redis_url = redis_server.url
            gw.pids["redis"] = redis_server.pid
        config = kvgate_config(f"{engine.host}:{engine.port}", free_port(), free_port(),
                               redis_url, cpu_policy,
                               attributes=False if mode == "kvgate_headers" else None)
        started = _start_ext_proc(mode, config, workdir, ext_proc_prefix)
        if started is not None:
            child, gw.counters = started
            if redis_url is not None:
                gw.counters = redis_counters(redis_url, gw.counters)
            stack.callback(child.stop)
            gw.pids["ext_proc"] = child.pid
            gw.commands["ext_proc"] = " ".join(child.command)
        envoy = stack.enter_context(
            EnvoyProcess(bootstrap=bootstrap_for(mode, config, engine), concurrency=1))
        assert envoy.process is not None
        gw.pids["envoy"] = envoy.process.pid
        gw.url = envoy.url + "/v1/chat/completions"
        for role, pid in gw.pids.items():
            if layout in LAYOUTS:
                pin(pid, LAYOUTS[layout][role])
        check(gw)
        yield gw


def check(gw: Gateway) -> None:
    """One request through the gateway must come back 200 from the engine."""
    response = httpx.post(gw.url, content=BODY, headers=HEADERS, timeout=30)
    if response.status_code != 200 or "x-bench-engine" not in response.headers:
        raise RuntimeError(f"{gw.mode}: {response.status_code} {response.text[:500]}")


# -- the load and one measurement window ---------------------------------------------------


class Load:
    """Closed loop: each worker sends its next request as soon as the last one answers —
    or, paced at ``rate`` req/s, at the next free slot of one schedule they share (never
    faster: a gateway behind its pace only loses slots)."""

    def __init__(self, url: str, body: bytes = BODY, rate: float | None = None):
        self.url = url
        self.body = body
        self.gap_s = 1 / rate if rate else 0.0
        self.next_slot = 0.0
        self.running = True
        self.recording = False
        self.latencies: list[float] = []  # send → whole response read
        self.first_bytes: list[float] = []  # send → first body chunk (a stream's TTFT)
        self.statuses: Counter[int] = Counter()  # in the window; 0 = connection error

    async def _pace(self) -> None:
        now = time.perf_counter()
        slot = self.next_slot = max(self.next_slot + self.gap_s, now)
        if slot > now:
            await asyncio.sleep(slot - now)

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while self.running:
            if self.gap_s:
                await self._pace()
            started = time.perf_counter()
            first = None
            try:
                async with session.post(self.url, data=self.body, headers=HEADERS) as response:
                    async for _chunk in response.content.iter_any():
                        first = first or time.perf_counter()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError):
                status = 0
            if self.recording:
                self.statuses[status] += 1
                if status == 200:
                    self.latencies.append(time.perf_counter() - started)
                    self.first_bytes.append((first or time.perf_counter()) - started)
            if status == 0:
                await asyncio.sleep(0.01)


@dataclass
class Snapshot:
    at: float
    cpu: dict[str, float]
    main: dict[str, float]  # each process's main thread's
    cores: list[float]
    counters: dict[str, float]


def _cpu_snapshot(pids: Mapping[str, int]
                  ) -> tuple[float, dict[str, float], dict[str, float], list[float]]:
    return (time.perf_counter(), {r: cpu_seconds(p) for r, p in pids.items()},
            {r: cpu_seconds(p, main_thread=True) for r, p in pids.items()},
            core_busy_seconds())


@dataclass
class Window:
    load: Load
    start: Snapshot
    end: Snapshot


async def measure(gw: Gateway, concurrency: int, warmup_s: float, duration_s: float,
                  window: Callable[[float], Awaitable[object]] = asyncio.sleep,
                  stream_tokens: int = 0, rate: float | None = None) -> Window:
    """Warm up, then measure for ``duration_s`` (``window`` runs meanwhile)."""
    pids = {**gw.pids, "loadgen": os.getpid()}
    load = Load(gw.url, request_body(stream_tokens), rate)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        workers = [asyncio.create_task(load.worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        counters = await gw.counters()
        start = Snapshot(*_cpu_snapshot(pids), counters)
        load.recording = True
        await window(duration_s)
        load.recording = False
        end = Snapshot(*_cpu_snapshot(pids), await gw.counters())
        load.running = False
        await asyncio.gather(*workers)
    return Window(load, start, end)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _delta(windows: Sequence[Window], part: Callable[[Snapshot], Mapping[Any, float]]
           ) -> dict[Any, float]:
    """Summed over the windows: how much each entry of a snapshot's part grew."""
    total: Counter[Any] = Counter()
    for w in windows:
        before, after = part(w.start), part(w.end)
        for key, value in after.items():
            total[key] += value - before.get(key, 0)
    return dict(total)


def summarize(mode: str, concurrency: int, windows: Sequence[Window],
              stream_tokens: int = 0, idle: Mapping[str, float] | None = None
              ) -> dict[str, Any]:
    """One row: the windows of one mode at one level, taken together. ``idle``: each
    process's CPU seconds per second without load, for the CPU per request above it."""
    elapsed = sum(w.end.at - w.start.at for w in windows)
    statuses: Counter[int] = sum((w.load.statuses for w in windows), Counter())
    requests = sum(statuses.values())
    per = max(requests, 1)
    cpu = _delta(windows, lambda s: s.cpu)
    main = _delta(windows, lambda s: s.main)
    cores = _delta(windows, lambda s: dict(enumerate(s.cores)))
    counted = _delta(windows, lambda s: s.counters)
    messages = {k.partition(":")[2]: v / per for k, v in counted.items()
                if k.startswith("messages:") and v}
    reports = {k.partition(":")[2]: v / per for k, v in counted.items()
               if k.startswith("reports:") and v}
    commands = {k.partition(":")[2]: v / per for k, v in counted.items()
                if k.startswith("redis:") and v}
    ordered = sorted(t for w in windows for t in w.load.latencies)
    firsts = sorted(t for w in windows for t in w.load.first_bytes)
    other = sum(cores.values()) - sum(cpu.values())
    return {
        "mode": mode,
        "concurrency": concurrency,
        "stream_tokens": stream_tokens,
        "seconds": elapsed,
        "windows": len(windows),
        "requests": requests,
        "errors": requests - statuses[200],
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "rps": requests / elapsed,
        "p50_ms": _quantile(ordered, 0.50) * 1000,
        "p99_ms": _quantile(ordered, 0.99) * 1000,
        "mean_ms": sum(ordered) / len(ordered) * 1000 if ordered else float("nan"),
        "ttft_p50_ms": _quantile(firsts, 0.50) * 1000,
        "ttft_p99_ms": _quantile(firsts, 0.99) * 1000,
        # each window's own (windows of all modes go round by round, so the same index is
        # the same stretch of the machine's time for every mode: the pairs show the noise)
        "ttft_p50_ms_by_window": [_quantile(sorted(w.load.first_bytes), 0.50) * 1000
                                  for w in windows],
        "cpu_us_per_request": {role: s / per * 1e6 for role, s in cpu.items()},
        # the main thread's part (Python, the event loop): the rest is gRPC's and others'
        "main_thread_cpu_us_per_request": {role: s / per * 1e6 for role, s in main.items()},
        "idle_cpu_per_s": dict(idle or {}),
        "net_cpu_us_per_request": {
            role: max(0.0, s - (idle or {}).get(role, 0.0) * elapsed) / per * 1e6
            for role, s in cpu.items()},
        "cpu_cores_used": {role: s / elapsed for role, s in cpu.items()},
        "core_busy": [cores[i] / elapsed for i in sorted(cores)],
        "other_cpu_us_per_request": other / per * 1e6,
        "messages_per_request": sum(messages.values()),
        "messages_by_kind": messages,
        "reports_per_request": sum(reports.values()),
        "reports_by_kind": reports,
        "redis_commands_per_request": sum(commands.values()),
        "redis_commands_by_kind": commands,
        "ext_proc_counters": {k: v for k, v in counted.items()
                              if v and not k.startswith(("messages:", "reports:", "redis:"))},
    }


# -- the run -------------------------------------------------------------------------------


def _runner() -> asyncio.Runner:
    return asyncio.Runner(loop_factory=new_event_loop)  # kvgate serve's loop: uvloop


@contextlib.contextmanager
def _own_affinity(cpus: set[int] | None) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run(modes: Sequence[str] = MODES, levels: Sequence[int] = LEVELS, *,
        warmup_s: float = 2.0, duration_s: float = 10.0, rounds: int = 5,
        layout: str = "split", cpu_policy: str = "batch", streams: Sequence[int] = (),
        equal_rate: bool = True, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every mode × level, one row each (see ``summarize``).

    Every mode's stack runs for the whole run, idle but for its turn; each level's
    ``duration_s`` is cut into ``rounds`` windows that go round the modes, so that whatever
    else the machine is doing meanwhile falls on every mode alike.
    """
    rows = []
    with (_own_affinity(LAYOUTS[layout]["loadgen"] if layout in LAYOUTS else None),
          contextlib.ExitStack() as stack,
          _runner() as runner):
        gateways = [stack.enter_context(gateway(mode, layout=layout, cpu_policy=cpu_policy))
                    for mode in modes]
        idle = idle_cpu(gateways)
        for level in levels:
            rows += _level(runner, gateways, level, 0, warmup_s, duration_s, rounds, log, idle)
        pace = equal_pace(rows) if equal_rate else None
        if pace is not None:
            rows += _level(runner, gateways, CPU_RATIO_LEVEL, 0, warmup_s, duration_s, rounds,
                           log, idle, rate=pace)
        paced = [stack.enter_context(gateway(mode, layout=layout, cpu_policy=cpu_policy,
                                             ms_per_token=STREAM_MS_PER_TOKEN))
                 for mode in modes if mode in STREAM_MODES] if streams else []
        idle = idle_cpu(paced)
        for tokens in streams:
            rows += _level(runner, paced, STREAM_LEVEL, tokens, warmup_s, duration_s, rounds,
                           log, idle)
    return rows


def equal_pace(rows: Sequence[dict[str, Any]]) -> float | None:
    """The request rate every mode is paced at for the equal-rate rows (None: no floor and
    kvgate rows at c=CPU_RATIO_LEVEL to compare). A process's CPU per request falls as its
    request rate rises (more work per wake-up, per syscall): in the closed loop the faster
    gateway looks cheaper per request for that alone."""
    if not (_row(rows, "kvgate", CPU_RATIO_LEVEL) and _row(rows, "minimal", CPU_RATIO_LEVEL)):
        return None
    closed = [r["rps"] for r in rows if r["concurrency"] == CPU_RATIO_LEVEL
              and not r.get("stream_tokens") and r["mode"] != "direct"]
    return round(EQUAL_RATE_SHARE * min(closed))


def idle_cpu(gateways: Sequence[Gateway]) -> dict[str, dict[str, float]]:
    """Each gateway's CPU seconds per second with no load (kvgate scrapes its engines, gRPC
    polls): at a few requests per second it is most of the CPU per request, so rows also
    give the CPU per request above it."""
    if not gateways:
        return {}
    before = {gw.mode: _cpu_snapshot(gw.pids) for gw in gateways}
    time.sleep(IDLE_S)
    idle = {}
    for gw in gateways:
        (start, cpu0, *_), (end, cpu1, *_) = before[gw.mode], _cpu_snapshot(gw.pids)
        idle[gw.mode] = {role: (cpu1[role] - cpu0[role]) / (end - start) for role in cpu0}
    return idle


def _level(runner: asyncio.Runner, gateways: Sequence[Gateway], level: int, stream_tokens: int,
           warmup_s: float, duration_s: float, rounds: int, log: Callable[[str], None],
           idle: Mapping[str, Mapping[str, float]] | None = None, rate: float | None = None,
           ) -> list[dict[str, Any]]:
    """One row per gateway at one concurrency level (and output length; paced at ``rate``
    req/s when given), measured in ``rounds`` windows that go round the gateways."""
    windows: dict[str, list[Window]] = {gw.mode: [] for gw in gateways}
    for turn in range(rounds):
        warmup = warmup_s if turn == 0 else min(warmup_s, ROUND_WARMUP_S)
        for gw in gateways:
            windows[gw.mode].append(runner.run(measure(
                gw, level, warmup, duration_s / rounds, stream_tokens=stream_tokens,
                rate=rate)))
    rows = []
    for gw in gateways:
        rows.append(summarize(gw.mode, level, windows[gw.mode], stream_tokens,
                              (idle or {}).get(gw.mode)) | {"commands": gw.commands}
                    | ({"paced_rps": rate} if rate else {}))
        log(format_row(rows[-1]))
    return rows


def _row(rows: Sequence[dict[str, Any]], mode: str, level: int, stream_tokens: int = 0,
         *, paced: bool = False) -> dict[str, Any] | None:
    return next((r for r in rows if r["mode"] == mode and r["concurrency"] == level
                 and r.get("stream_tokens", 0) == stream_tokens
                 and bool(r.get("paced_rps")) == paced), None)


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The two acceptance numbers (and the CPU ratio at every level)."""
    by_level = {}
    for level in sorted({r["concurrency"] for r in rows}):
        kvgate, floor = _row(rows, "kvgate", level), _row(rows, "minimal", level)
        if kvgate and floor:
            k, f = kvgate["cpu_us_per_request"], floor["cpu_us_per_request"]
            km, fm = (r.get("main_thread_cpu_us_per_request", {}).get("ext_proc", float("nan"))
                      for r in (kvgate, floor))
            by_level[str(level)] = {
                "ext_proc": k["ext_proc"] / f["ext_proc"],
                "envoy_plus_ext_proc": (k["ext_proc"] + k["envoy"]) / (f["ext_proc"] + f["envoy"]),
                "main_thread_us": {"kvgate": km, "minimal": fm},
                "other_threads_us": {"kvgate": k["ext_proc"] - km,
                                     "minimal": f["ext_proc"] - fm},
            }
    out: dict[str, Any] = {"cpu_ratio_by_level": by_level}
    headline = by_level.get(str(CPU_RATIO_LEVEL))
    if headline:
        out["cpu_ratio"] = {"level": CPU_RATIO_LEVEL, "value": headline["ext_proc"],
                            "target": CPU_RATIO_TARGET,
                            "met": headline["ext_proc"] <= CPU_RATIO_TARGET}
    kvgate = _row(rows, "kvgate", CPU_RATIO_LEVEL, paced=True)
    floor = _row(rows, "minimal", CPU_RATIO_LEVEL, paced=True)
    if kvgate and floor:
        value = kvgate["cpu_us_per_request"]["ext_proc"] / floor["cpu_us_per_request"]["ext_proc"]
        out["cpu_ratio_equal_rate"] = {
            "level": CPU_RATIO_LEVEL, "paced_rps": kvgate["paced_rps"], "value": value,
            "rps": {"kvgate": kvgate["rps"], "minimal": floor["rps"]},
            "target": CPU_RATIO_TARGET, "met": value <= CPU_RATIO_TARGET}
    kvgate, direct = _row(rows, "kvgate", 1), _row(rows, "direct", 1)
    if kvgate and direct:
        delta = kvgate["p50_ms"] - direct["p50_ms"]
        out["p50_delta_ms"] = {"level": 1, "value": delta, "target": P50_DELTA_TARGET_MS,
                               "met": delta <= P50_DELTA_TARGET_MS}
    streams = stream_ratios(rows)
    if streams:
        out["streams"] = streams
    redis = redis_ratios(rows)
    if redis:
        out["redis"] = redis
    return out


def redis_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """kvgate with Redis against kvgate in memory, per level: ext_proc CPU per request, the
    script calls it sent (``EVALSHA``) and the commands Redis ran, and the share of admissions
    the failure policy served instead (a disturbed run: those cost no Redis call)."""
    out: dict[str, Any] = {}
    for level in sorted({r["concurrency"] for r in rows}):
        memory, redis = _row(rows, "kvgate", level), _row(rows, "kvgate_redis", level)
        if not (memory and redis):
            continue
        counters = redis.get("ext_proc_counters", {})
        admitted = sum(v for k, v in counters.items()
                       if k.startswith("kvgate_requests_total") and 'decision="admitted"' in k)
        fallbacks = sum(v for k, v in counters.items()
                        if k.startswith("kvgate_store_fallback_admissions_total"))
        commands = redis.get("redis_commands_by_kind", {})
        out[str(level)] = {
            "ext_proc": redis["cpu_us_per_request"]["ext_proc"]
            / memory["cpu_us_per_request"]["ext_proc"],
            "sent_per_request": sum(v for k, v in commands.items()
                                    if k in ("evalsha", "eval")),
            "run_per_request": redis.get("redis_commands_per_request", 0.0),
            "fallback_share": fallbacks / admitted if admitted else 0.0,
        }
    return out


def stream_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Streamed rows against kvgate's own non-streamed CPU (c=STREAM_LEVEL) and the floor's
    latency on the same streams."""
    plain = _row(rows, "kvgate", STREAM_LEVEL)
    out: dict[str, Any] = {}
    for tokens in sorted({r.get("stream_tokens", 0) for r in rows} - {0}):
        kvgate, floor = (_row(rows, m, STREAM_LEVEL, tokens) for m in ("kvgate", "minimal"))
        if kvgate is None:
            continue
        entry: dict[str, Any] = {"messages_per_request": kvgate["messages_per_request"],
                                 "reports_per_request": kvgate["reports_per_request"]}
        # above each process's idle CPU: streams come a few per second, and a second of
        # kvgate's background work (scrapes) would otherwise be spread over them
        net = kvgate.get("net_cpu_us_per_request", kvgate["cpu_us_per_request"])["ext_proc"]
        entry["cpu_us_per_request"] = kvgate["cpu_us_per_request"]["ext_proc"]
        entry["net_cpu_us_per_request"] = net
        if plain:
            value = net / plain.get("net_cpu_us_per_request", plain["cpu_us_per_request"])[
                "ext_proc"]
            entry["cpu_vs_non_streamed"] = {"value": value, "target": STREAM_CPU_TARGET,
                                            "met": value <= STREAM_CPU_TARGET}
        if floor:
            entry["floor_messages_per_request"] = floor["messages_per_request"]
            entry["cpu_vs_floor"] = net / floor.get(
                "net_cpu_us_per_request", floor["cpu_us_per_request"])["ext_proc"]
            for key, name in (("ttft_p50_ms", "ttft_vs_floor"), ("p50_ms", "total_vs_floor")):
                value = kvgate[key] / floor[key]
                entry[name] = {"value": value, "target": STREAM_LATENCY_TARGET,
                               "met": value <= STREAM_LATENCY_TARGET}
            pairs = zip(kvgate.get("ttft_p50_ms_by_window", []),
                        floor.get("ttft_p50_ms_by_window", []), strict=False)
            entry["ttft_vs_floor"]["by_round"] = [ours / theirs for ours, theirs in pairs
                                                  if ours > 0 and theirs > 0]  # (NaN: no)
        out[str(tokens)] = entry
    return out


# -- reporting -----------------------------------------------------------------------------

COLUMNS = (f"{'mode':19} {'conc':>4} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
           f"{'envoy':>6} {'extproc':>7} {'engine':>6} {'redis':>6} {'loadgen':>7} "
           f"{'msg/req':>7} {'errors':>6} {'other':>5}")


def format_row(r: dict[str, Any]) -> str:
    cpu = r["cpu_us_per_request"]

    def us(role: str) -> str:
        return f"{cpu[role]:.0f}" if role in cpu else "-"

    msgs = f"{r['messages_per_request']:.2f}" if r["mode"] != "direct" else "0"
    return (f"{label(r):19} {r['concurrency']:>4} {r['rps']:>7.0f} {r['p50_ms']:>7.2f} "
            f"{r['p99_ms']:>7.2f} {us('envoy'):>6} {us('ext_proc'):>7} {us('engine'):>6} "
            f"{us('redis'):>6} {us('loadgen'):>7} {msgs:>7} {r['errors']:>6} "
            f"{_other_cores(r):>5.2f}")


def label(r: dict[str, Any]) -> str:
    """The mode, with ``sN`` for a stream of N tokens, ``@R`` when paced at R req/s."""
    tokens, paced = r.get("stream_tokens", 0), r.get("paced_rps")
    return r["mode"] + (f" s{tokens}" if tokens else "") + (f" @{paced:.0f}" if paced else "")


def _other_cores(r: dict[str, Any]) -> float:
    """Cores' worth of CPU used by processes outside the benchmark during the window."""
    return r["other_cpu_us_per_request"] * r["rps"] / 1e6


def format_ratios(result: dict[str, Any]) -> list[str]:
    lines = []
    if "cpu_ratio" in result:
        c = result["cpu_ratio"]
        lines.append(f"kvgate ext_proc CPU/request ÷ minimal ext_proc CPU/request at "
                     f"c={c['level']}: {c['value']:.2f} (target ≤ {c['target']}: "
                     f"{'met' if c['met'] else 'MISSED'})")
    for level, r in result["cpu_ratio_by_level"].items():
        lines.append(f"  - c={level}: ext_proc {r['ext_proc']:.2f}, "
                     f"envoy+ext_proc {r['envoy_plus_ext_proc']:.2f}")
        if "main_thread_us" in r:
            main, other = r["main_thread_us"], r["other_threads_us"]
            lines.append(f"    ext_proc µs/request on its main thread (Python, event loop): "
                         f"kvgate {main['kvgate']:.0f}, floor {main['minimal']:.0f}; on its "
                         f"other threads (gRPC's): kvgate {other['kvgate']:.0f}, floor "
                         f"{other['minimal']:.0f}")
    if "cpu_ratio_equal_rate" in result:
        e = result["cpu_ratio_equal_rate"]
        lines.append(f"the same at an equal request rate (every mode paced at "
                     f"{e['paced_rps']:.0f} req/s, c={e['level']}; served: kvgate "
                     f"{e['rps']['kvgate']:.0f}, floor {e['rps']['minimal']:.0f}): "
                     f"{e['value']:.2f} (target ≤ {e['target']}: "
                     f"{'met' if e['met'] else 'MISSED'})")
    if "p50_delta_ms" in result:
        d = result["p50_delta_ms"]
        lines.append(f"kvgate p50 − Envoy-direct p50 at c=1: {d['value']:.2f} ms "
                     f"(target ≤ {d['target']} ms: {'met' if d['met'] else 'MISSED'})")
    for tokens, e in result.get("streams", {}).items():
        line = (f"streamed {tokens} tokens, c={STREAM_LEVEL}: kvgate "
                f"{e['messages_per_request']:.2f} ext_proc messages + "
                f"{e['reports_per_request']:.2f} meter reports per request")
        if "floor_messages_per_request" in e:
            line += (f" (floor: {e['floor_messages_per_request']:.1f} messages); ext_proc CPU "
                     f"{e['cpu_vs_floor']:.2f}x the floor's")
        lines.append(line)
        lines.append(f"  - ext_proc CPU/request {e['cpu_us_per_request']:.0f} µs, "
                     f"{e['net_cpu_us_per_request']:.0f} µs above its idle CPU")
        for key, text in (("cpu_vs_non_streamed", "CPU/request above idle ÷ its own "
                                                  "non-streamed"),
                          ("ttft_vs_floor", "TTFT p50 ÷ the floor's"),
                          ("total_vs_floor", "total time p50 ÷ the floor's")):
            if key in e:
                v = e[key]
                rounds = v.get("by_round")
                spread = (f"; round by round {min(rounds):.2f}–{max(rounds):.2f}, "
                          f"median {statistics.median(rounds):.2f}" if rounds else "")
                lines.append(f"  - {text}: {v['value']:.2f} (target ≤ {v['target']}: "
                             f"{'met' if v['met'] else 'MISSED'}{spread})")
    return lines


def _first_line(command: list[str]) -> str:
    """The first line a command prints ("" if none, or if it cannot run)."""
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return next(iter((out.stdout or out.stderr).strip().splitlines()), "")


def machine_info(layout: str) -> dict[str, Any]:
    from importlib.metadata import version

    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.startswith("model name")), platform.processor())
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "envoy": _first_line([find_envoy(), "--version"]).partition("/")[2],
        "grpcio": version("grpcio"),
        "aiohttp": version("aiohttp"),
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "commit": _first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "uncommitted_changes": bool(_first_line(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])),
        "kvgate_hot_path": kvgate_native.status(),
        "layout": layout,
        "pinning": ({role: sorted(cores) for role, cores in LAYOUTS[layout].items()}
                    if layout in LAYOUTS else "none"),
    }


METHOD = """\
- Upstream: `extproc.engine` (the simulated vLLM engine), one process per mode,
  `--ms-per-token 0 --prefill-us-per-token 0 --decode-us-per-seq 0 --scheduling-policy
  priority` (every step of its loop takes no time); every request is
  a non-streaming `/v1/chat/completions` with `max_tokens: {max_tokens}` (~{body} bytes in,
  ~480 bytes out). The engine (not a trivial aiohttp app) because kvgate's KV-aware routing
  scrapes its vLLM `/metrics` every 100 ms; its own CPU is reported apart.
- Envoy 1.40 `--concurrency 1`, one per mode. `minimal` and `kvgate*` use the
  bootstrap rendered by `render_bootstrap(config)`; `minimal` only swaps the ORIGINAL_DST
  upstream cluster for a STATIC one to the engine (the floor sets no destination), `direct`
  also drops the ext_proc filter and cluster. Same listener, HCM, timeouts, buffer limit.
- kvgate runs as `python -m extproc.cli --log-level warning serve -c FILE` (the `kvgate`
  entry point), one process, uvloop; one tenant with real (non-binding) limits on requests/s,
  tokens/min, concurrency and context; one pool of one engine, priority scheduling on (the body
  is mutated with `priority`). `kvgate_redis` adds `redis: {{url}}` to a redis-server started
  on a free port (default timeout 20 ms, failure policy `local`; fallbacks would show in the
  JSON's `ext_proc_counters`).
- Load: closed loop, N aiohttp workers on one uvloop, keep-alive. The rows marked `@R` are
  the same N workers paced at R req/s in total (one schedule they share), the same R for
  every mode: {equal_share:.0%} of the slowest mode's closed-loop rate at c=16 in this run. A
  process's CPU per request falls as its request rate rises (more work per wake-up and per
  syscall), so in the closed loop a gateway whose Envoy costs more per request (kvgate's
  runs the Lua response meter, on the core it shares with the engine and the load
  generator) serves fewer requests per second and pays more per request for that alone;
  at an equal rate only the per-request work differs. All modes' processes run
  for the whole run; each level gives every mode {duration:g} s of measurement in {rounds}
  windows taken in turn (mode after mode, round after round; {warmup:g} s warm-up before a
  level's first window, {round_warmup:g} s before the others), so that load from outside the
  benchmark falls on all modes alike. Latency = send → whole response read, 200s only.
  CPU = Δ(utime+stime) of `/proc/PID/stat` (all threads, 10 ms ticks) over the window ÷
  requests completed in it. `other` in the JSON is whatever else the machine ran (busy time
  of all cores minus the processes above): other engineers' tests share this machine.
- Messages/request: kvgate's `kvgate_extproc_messages_total` (admin `/metrics`) and the
  floor's own counter, read around the window, ÷ requests. Both servers get the same Envoy
  processing modes; kvgate ends the RPC once it has seen the whole response body (here the
  one chunk of JSON), so Envoy does not send it the empty end-of-stream message the floor,
  which only answers CONTINUE, waits for.
- Pinning: {pinning}.
- Scheduling: both ext_proc servers (kvgate and the floor) run under the `{cpu_policy}` CPU
  policy (kvgate's `server.cpu_policy`; `batch` = Linux SCHED_BATCH, its default).
"""


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# kvgate overhead: Envoy direct vs Python floor vs kvgate",
        "",
        f"`{result['command']}` — {result['when']}, {result['machine']['cpu']}, "
        f"{result['machine']['cores']} cores, Envoy {result['machine']['envoy']}. "
        f"kvgate's hot path: {result['machine'].get('kvgate_hot_path', 'not recorded')}.",
        "",
        "CPU columns are µs of CPU per request for each process. `other` is the cores' worth "
        "of CPU that processes outside the benchmark used during the window (this machine is "
        "shared): where it is high, latency and req/s are disturbed; CPU per request much "
        "less so.",
        "",
        "| mode | conc | req/s | p50 ms | p99 ms | TTFT p50 ms | Envoy µs | ext_proc µs | "
        "engine µs | Redis µs | loadgen µs | msgs/req | reports/req | errors | other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cpu = r["cpu_us_per_request"]
        cell = [f"{cpu[k]:.0f}" if k in cpu else "–" for k in PROCESS_ROLES]
        ttft = f"{r['ttft_p50_ms']:.2f}" if r.get("stream_tokens") else "–"
        lines.append(f"| {label(r)} | {r['concurrency']} | {r['rps']:.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {ttft} | {' | '.join(cell)} | "
                     f"{r['messages_per_request']:.2f} | {r.get('reports_per_request', 0):.2f} | "
                     f"{r['errors']} | {_other_cores(r):.2f} |")
    lines += ["", "## Acceptance ratios", ""]
    lines += [line if line.startswith(" ") else f"- {line}"
              for line in format_ratios(result["ratios"])]
    lines += ["", "## Messages per request", ""]
    for r in rows:
        first = r["concurrency"] == rows[0]["concurrency"] or r.get("stream_tokens")
        if first and r["messages_by_kind"]:
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["messages_by_kind"].items())
            reports = ", ".join(f"{k} {v:.2f}" for k, v in r.get("reports_by_kind", {}).items())
            lines.append(f"- {label(r)}: {r['messages_per_request']:.2f} ({kinds})"
                         + (f"; meter reports {reports}" if reports else ""))
    redis_rows = [r for r in rows if r.get("redis_commands_by_kind")]
    if redis_rows:
        lines += ["", "## Redis commands per request (`INFO commandstats`)", "",
                  "`evalsha` is what kvgate sends (a script call each; the calls of one event-loop "
                  "tick, and the releases riding with them, share a write); the rest are the "
                  "`redis.call`s inside its scripts, which commandstats counts too.", ""]
        for r in redis_rows:
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["redis_commands_by_kind"].items())
            lines.append(f"- {label(r)} c={r['concurrency']}: "
                         f"{r['redis_commands_per_request']:.2f} ({kinds})")
        lines += ["", "## Redis ÷ in-memory", "",
                  "| conc | ext_proc CPU/request, Redis ÷ in-memory | script calls sent/request "
                  "| commands run/request | admissions the failure policy served |",
                  "|---:|---:|---:|---:|---:|"]
        for level, entry in result["ratios"].get("redis", {}).items():
            lines.append(f"| {level} | {entry['ext_proc']:.2f} | {entry['sent_per_request']:.2f}"
                         f" | {entry['run_per_request']:.1f} | {entry['fallback_share']:.1%} |")
    pin_text = LAYOUT_TEXT[result["machine"].get("layout", "shared")]
    lines += ["", "## Method", "", METHOD.format(
        max_tokens=MAX_TOKENS, body=len(BODY), warmup=result["warmup_s"],
        duration=result["duration_s"], rounds=result.get("rounds", 1),
        round_warmup=ROUND_WARMUP_S, pinning=pin_text, equal_share=EQUAL_RATE_SHARE,
        cpu_policy=result.get("cpu_policy", "normal"))]
    return "\n".join(lines)


def write_results(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM (a CI timeout, ``kill``): unwind, so every process the run started (Envoy,
    kvgate, the engine, redis-server) is stopped as on a normal end, not left running."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminated)
    args = _parser().parse_args(argv)
    if args.profile:
        profile_main(args.duration, args.out.with_name("overhead-profile.md"))
        return
    layout = args.layout if len(os.sched_getaffinity(0)) >= 2 else "none"
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = machine_info(layout)
    print(COLUMNS)
    rows = run(args.modes, args.levels, warmup_s=args.warmup, duration_s=args.duration,
               rounds=args.rounds, layout=layout, cpu_policy=args.cpu_policy,
               streams=args.streams, equal_rate=args.equal_rate)
    result = {
        "command": " ".join(["python", "-m", "bench.overhead",
                             *(sys.argv[1:] if argv is None else argv)]),
        "when": when, "machine": machine, "warmup_s": args.warmup,
        "duration_s": args.duration, "rounds": args.rounds, "cpu_policy": args.cpu_policy,
        "rows": rows,
        "ratios": ratios(rows),
    }
    print("\n".join(format_ratios(result["ratios"])))
    write_results(result, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


# -- profiling (--profile) -----------------------------------------------------------------

PROFILE_MODES = ("minimal", "kvgate")
PROFILE_RATE_HZ = 250
_LINE = re.compile(r":\d+\)$")
_LOOP_FRAME = "run (asyncio/runners.py:"
_NO_FRAME = "(in the event loop, no Python frame: uvloop, gRPC core, kernel)"


def find_py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which(
        "py-spy")
    if not found:
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    return found


def py_spy_window(pid: int, out: Path) -> Callable[[float], Awaitable[object]]:
    """A measurement window that samples ``pid`` with py-spy (raw collapsed stacks)."""
    async def window(seconds: float) -> None:
        process = await asyncio.create_subprocess_exec(
            find_py_spy(), "record", "--pid", str(pid), "--duration", str(round(seconds)),
            "--rate", str(PROFILE_RATE_HZ), "--format", "raw", "--nonblocking",
            "--output", str(out),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        await process.wait()

    return window


def _loop_frames(stack: str) -> list[str] | None:
    """The frames above the event loop (the entry point cut off); None: another thread."""
    frames = stack.split(";")
    loop = [i for i, f in enumerate(frames) if f.startswith(_LOOP_FRAME)]
    return frames[loop[-1] + 1:] if loop else None


def hot_spots(raw: str, us_per_sample: float, top: int = 25) -> dict[str, list[list[Any]]]:
    """Python frames run by the event loop: inclusive time per function and self time per
    line, in µs per request (other threads' samples left out: their CPU is measured)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = _loop_frames(stack)
        if frames is None:
            continue
        if not frames:
            own[_NO_FRAME] += int(count)
            continue
        own[frames[-1]] += int(count)
        for function in {_LINE.sub(")", f) for f in frames}:
            inclusive[function] += int(count)

    def rows(counter: Counter[str]) -> list[list[Any]]:
        return [[name, round(n * us_per_sample, 1)] for name, n in counter.most_common(top)]

    return {"inclusive": rows(inclusive), "self": rows(own)}


def _loop_samples(raw: str) -> int:
    """The samples of the event loop's thread (the main one)."""
    return sum(int(count) for stack, _, count in (line.rpartition(" ")
                                                   for line in raw.splitlines() if line.strip())
               if _loop_frames(stack) is not None)


def profile(duration_s: float, workdir: Path) -> list[dict[str, Any]]:
    """Each of PROFILE_MODES at c=CPU_RATIO_LEVEL with py-spy on its ext_proc process."""
    found = []
    with _own_affinity(LAYOUTS["split"]["loadgen"]), _runner() as runner:
        for mode in PROFILE_MODES:
            with gateway(mode) as gw:
                out = workdir / f"{mode}.raw"
                window = runner.run(measure(gw, CPU_RATIO_LEVEL, 2.0, duration_s,
                                            py_spy_window(gw.pids["ext_proc"], out)))
                row = summarize(mode, CPU_RATIO_LEVEL, [window])
                raw = out.read_text()
                # scaled so that the event loop's samples add up to its thread's measured
                # CPU per request (py-spy counted other threads' waits as busy: 160 µs a
                # request where /proc measured their CPU at ~40)
                us = (row["main_thread_cpu_us_per_request"]["ext_proc"]
                      / max(_loop_samples(raw), 1))
                found.append({"row": row, **hot_spots(raw, us)})
    return found


def profile_markdown(found: Sequence[dict[str, Any]]) -> str:
    lines = ["# Where the ext_proc CPU goes (py-spy)", "",
             f"`python -m bench.overhead --profile`: c={CPU_RATIO_LEVEL}, py-spy "
             f"{PROFILE_RATE_HZ} Hz `--nonblocking` on the ext_proc process, Python frames "
             "of the event loop's thread only. µs/request = the frame's share of that thread's "
             "samples × the thread's measured CPU per request (`/proc/PID/task/PID/stat`, in "
             "each heading): an estimate. The other threads' CPU (gRPC's) is measured, not "
             "sampled: py-spy counted them busy while they waited (~160 µs a request where "
             "`/proc` measured ~40). "
             "Entry-point frames (up to the event loop's "
             "`run`) are cut off. kvgate's compiled modules (`make native`) have no Python "
             f"frames: their time lands on the line that called them. kvgate's hot path: "
             f"{kvgate_native.status()}.", ""]
    for item in found:
        row = item["row"]
        total = row["cpu_us_per_request"]["ext_proc"]
        main = row["main_thread_cpu_us_per_request"]["ext_proc"]
        lines += [f"## {row['mode']}: {total:.0f} µs CPU per request ({main:.0f} on the event "
                  f"loop's thread, {total - main:.0f} on the others), {row['rps']:.0f} req/s",
                  "",
                  "| inclusive, per function | µs/req |", "|---|---:|"]
        lines += [f"| `{name}` | {us} |" for name, us in item["inclusive"]]
        lines += ["", "| self, per line | µs/req |", "|---|---:|"]
        lines += [f"| `{name}` | {us} |" for name, us in item["self"]]
        lines.append("")
    return "\n".join(lines)


def profile_main(duration_s: float, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-profile-") as tmp:
        found = profile(duration_s, Path(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_markdown(found))
    for item in found:
        print(format_row(item["row"]))
    print(f"wrote {out}")


def _csv(kind: type) -> Callable[[str], list[Any]]:
    return lambda text: [kind(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--modes", type=_csv(str), default=list(MODES))
    parser.add_argument("--levels", type=_csv(int), default=list(LEVELS))
    parser.add_argument("--streams", type=_csv(int), default=list(STREAMS),
                        help=f"streamed output lengths, at c={STREAM_LEVEL} ('' for none)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds per level")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="measured seconds per mode and level")
    parser.add_argument("--rounds", type=int, default=5,
                        help="windows each level's duration is cut into, taken in turn")
    parser.add_argument("--layout", choices=[*LAYOUTS, "none"], default="split",
                        help="which processes share a core (none: leave affinity alone)")
    parser.add_argument("--cpu-policy", choices=("batch", "normal"), default="batch",
                        help="server.cpu_policy of kvgate, and the same for the floor")
    parser.add_argument("--equal-rate", action=argparse.BooleanOptionalAction, default=True,
                        help=f"also every mode paced at one rate at c={CPU_RATIO_LEVEL} (the "
                             "@R rows)")
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead.json")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy over the floor and kvgate instead (overhead-profile.md)")
    return parser


if __name__ == "__main__":
    main()
