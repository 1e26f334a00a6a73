"""Slowloris against the admin port: many connections that send their request headers one
byte a second, and whether Prometheus and the probes still get their answers meanwhile.

    .venv/bin/python -m bench.admin_slowloris [--connections 2000] [--seconds 30] [--nofile N]
                                              [--probes-from 127.0.0.2]

Starts ``kvgate serve`` (one process, in-memory limits, one pool whose engine is never
there: the admin port is all this needs). A second process runs the attack:
``--connections`` clients each open a connection to the admin port, send ``GET /metrics
HTTP/1.1`` and then a header one byte a second, never finishing it; a client whose
connection the server closes opens another at once (the attack keeps its count up). Once
every attacking client has started, once a second for ``--seconds``: kvgate's open file
descriptors and RSS (``/proc``), and one ``GET /metrics`` and one ``GET /healthz``, each on a
new connection as the kubelet's probes come (5 s timeout) and from another address than the
attack's (``--probes-from``: Prometheus and the kubelet are not the attacker; ``127.0.0.1``
probes from the attacker's own), and the gRPC port's health check on a new channel (the
port Envoy connects to). ``--nofile`` lowers kvgate's soft limit of open files
(``RLIMIT_NOFILE``) after start, to the 1024 many hosts default to.

Prints one JSON line: the peak and last fds and RSS, kvgate's CPU use (cores), the probes'
answers and latencies, and how often the server closed an attacking connection.
Results: ``bench/results/admin-slowloris.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import hash_api_key, parse_config
from extproc.ports import free_port
from extproc.processes import KvgateProcess

TRICKLE = b"X-Slow: " + b"a" * 64  # one byte a second: never a whole header line


def config(admin_port: int) -> Any:
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": admin_port,
                   "report_port": free_port(), "reload_poll_s": 0},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key("sk-x")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })


def cpu_s(pid: int) -> float:
    """CPU seconds the process has used (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_stats(pid: int) -> tuple[int, float]:
    """Open file descriptors, and resident memory in MiB."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
                   .splitlines() if line.startswith("VmRSS:"))
    return fds, rss_kib / 1024


class Attack:
    def __init__(self, port: int) -> None:
        self.port = port
        self.open = 0
        self.closed_by_server = 0
        self.connect_failures = 0

    async def client(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                self.connect_failures += 1
                await asyncio.sleep(1)
                continue
            self.open += 1
            try:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                for byte in TRICKLE * 100:
                    if stop.is_set() or reader.at_eof():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    try:  # a second, or until the server hangs up
                        if await asyncio.wait_for(reader.read(4096), 1.0) == b"":
                            break
                    except TimeoutError:
                        pass
                if not stop.is_set():
                    self.closed_by_server += 1
            except OSError:
                self.closed_by_server += 1
            finally:
                self.open -= 1
                writer.close()


async def grpc_health(target: str) -> tuple[bool, float]:
    """The gRPC port's health check on a new channel: a port other than the attacked one."""
    start = time.perf_counter()
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
        ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        ok = False
    return ok, time.perf_counter() - start


async def probe(client: httpx.AsyncClient, url: str) -> tuple[bool, float]:
    start = time.perf_counter()
    try:
        ok = (await client.get(url, timeout=5)).status_code == 200
    except httpx.HTTPError:
        ok = False
    return ok, time.perf_counter() - start


def attack_process(port: int, connections: int, ramped: Any, stop: Any, counts: Any) -> None:
    """The attack, in a process of its own: the probes' latency is then the server's, not
    that of a client loop busy with thousands of connections."""

    async def attack() -> None:
        attack, stopping = Attack(port), asyncio.Event()
        clients = []
        for i in range(connections):  # 50 at a time: the listen backlog is 128
            clients.append(asyncio.create_task(attack.client(stopping)))
            if i % 50 == 49:
                await asyncio.sleep(0.02)
        ramped.set()
        while not stop.is_set():
            counts[:] = [attack.open, attack.closed_by_server, attack.connect_failures]
            await asyncio.sleep(0.2)
        stopping.set()
        await asyncio.gather(*clients, return_exceptions=True)
        counts[:] = [attack.open, attack.closed_by_server, attack.connect_failures]

    asyncio.run(attack())


async def run(args: argparse.Namespace, kvgate: KvgateProcess) -> dict[str, Any]:
    assert kvgate.process is not None
    pid, port = kvgate.process.pid, kvgate.config.server.admin_port
    if args.nofile:
        hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (args.nofile, hard))
    fds0, rss0 = proc_stats(pid)
    ramped, stop = multiprocessing.Event(), multiprocessing.Event()
    counts = multiprocessing.Array("q", 3)
    attacker = multiprocessing.Process(target=attack_process,
                                       args=(port, args.connections, ramped, stop, counts))
    start = time.monotonic()
    attacker.start()
    ramped.wait()  # every attacking client started
    ramp_s = time.monotonic() - start
    samples: list[dict[str, Any]] = []
    cpu0, measured = cpu_s(pid), time.monotonic()
    # a new connection per probe (kubelet's probes come so), no pool kept
    transport = httpx.AsyncHTTPTransport(local_address=args.probes_from,
                                         limits=httpx.Limits(max_keepalive_connections=0))
    async with httpx.AsyncClient(transport=transport) as client:
        for _ in range(args.seconds):
            started = time.monotonic()
            metrics, healthz, grpc_ok = await asyncio.gather(
                probe(client, f"http://127.0.0.1:{port}/metrics"),
                probe(client, f"http://127.0.0.1:{port}/healthz"), grpc_health(kvgate.target))
            fds, rss = proc_stats(pid)
            samples.append({"fds": fds, "rss": rss, "attacking": counts[0],
                            "metrics": metrics, "healthz": healthz, "grpc": grpc_ok})
            await asyncio.sleep(max(0.0, 1 - (time.monotonic() - started)))
    cpu = (cpu_s(pid) - cpu0) / (time.monotonic() - measured)
    stop.set()
    attacker.join(30)
    _open, closed_by_server, connect_failures = counts[:]

    def answered(name: str) -> dict[str, Any]:
        oks = [s[name] for s in samples]
        latencies = sorted(t for ok, t in oks if ok)
        return {"ok": sum(ok for ok, _ in oks), "of": len(oks),
                "p50_ms": round(1000 * latencies[len(latencies) // 2], 1) if latencies else None,
                "max_ms": round(1000 * latencies[-1], 1) if latencies else None}

    return {"connections": args.connections, "seconds": args.seconds,
            "probes_from": args.probes_from, "ramp_s": round(ramp_s, 1),
            "nofile": args.nofile or resource.prlimit(pid, resource.RLIMIT_NOFILE)[0],
            "fds_before": fds0, "fds_peak": max(s["fds"] for s in samples),
            "fds_last": samples[-1]["fds"],
            "rss_mib_before": round(rss0, 1),
            "rss_mib_peak": round(max(s["rss"] for s in samples), 1),
            "kvgate_cpu_share": round(cpu, 2),
            "attacking_peak": max(s["attacking"] for s in samples),
            "closed_by_server": closed_by_server, "connect_failures": connect_failures,
            "metrics": answered("metrics"), "healthz": answered("healthz"),
            "grpc_health": answered("grpc")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--nofile", type=int, default=0,
                        help="kvgate's soft RLIMIT_NOFILE (0: as inherited)")
    parser.add_argument("--probes-from", default="127.0.0.2",
                        help="the probes' source address (the attack's is 127.0.0.1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kvgate = KvgateProcess(config(free_port()), Path(tmp))
        with kvgate:
            result = asyncio.run(run(args, kvgate))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
