"""What scraping the engines costs a kvgate process, per endpoint.

    .venv/bin/python -m bench.scrape_cost [--endpoints 1,4,16] [--duration 10]

kvgate reads every endpoint's ``/metrics`` every ``scrape.interval_s`` (100 ms), whatever the
traffic: that CPU grows with the number of endpoints (and every replica scrapes them all),
not with requests. This runs kvgate's own ``Scraper`` (its ``aiohttp`` session, parser and
endpoint store, on uvloop as ``kvgate serve`` does) on one core against N stand-in engines
on the other, each answering a recorded metrics page: a real vLLM 0.32's
(``tests/data/vllm-0.32-metrics.txt``, 56 KB), the part of it kvgate asks for (``?name[]=``:
the series it reads, as Prometheus's client library answers the query) and the simulated
engine's. It reports the
scraper's CPU per scrape (the process's CPU over the window: fetch, parse, store swap), the
share of a core each endpoint costs at the default interval, and the parse alone. Writes
``bench/results/scrape-cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from extproc.datalayer.endpoints import EndpointStore
from extproc.datalayer.metrics import VLLM, parse_metrics
from extproc.datalayer.scraper import Scraper
from extproc.engine.server import EngineProcess
from extproc.ports import free_port
from extproc.server import new_event_loop

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
VLLM_PAGE = ROOT / "tests" / "data" / "vllm-0.32-metrics.txt"
SCRAPER_CORE, SERVER_CORE = {1}, {0}
INTERVAL_S = 0.1  # the default scrape.interval_s
POOL = "bench"


# -- the stand-in engines: one process, one port per endpoint --------------------------------


async def _serve(body: bytes, ports: list[int]) -> None:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
            b"content-length: %d\r\n\r\n" % len(body))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    servers = [await asyncio.start_server(answer, "127.0.0.1", port) for port in ports]
    await asyncio.gather(*(server.serve_forever() for server in servers))


def serve_main(page: Path, ports: list[int]) -> None:
    os.sched_setaffinity(0, SERVER_CORE)
    loop = new_event_loop()
    loop.run_until_complete(_serve(page.read_bytes(), ports))


# -- the measurement ---------------------------------------------------------------------------


async def _measure(addresses: list[str], warmup_s: float, duration_s: float) -> dict[str, Any]:
    store = EndpointStore()
    await store.set_endpoints(POOL, addresses)
    scraper = Scraper(store, interval_s=INTERVAL_S)
    scraper.start()
    try:
        await asyncio.sleep(warmup_s)
        rounds0, cpu0, wall0 = scraper.rounds, time.process_time(), time.monotonic()
        await asyncio.sleep(duration_s)
        rounds, cpu, wall = (scraper.rounds - rounds0, time.process_time() - cpu0,
                             time.monotonic() - wall0)
    finally:
        await scraper.stop()
    scrapes = rounds * len(addresses)
    healthy = sum(1 for state in store.snapshot().states() if state.metrics is not None)
    return {"endpoints": len(addresses), "rounds": rounds, "scrapes": scrapes,
            "healthy": healthy, "wall_s": wall, "cpu_s": cpu,
            "us_per_scrape": 1e6 * cpu / max(scrapes, 1),
            "core_share": cpu / wall,
            "core_share_per_endpoint": cpu / wall / len(addresses)}


def _parse_us(text: str, repeats: int = 200) -> float:
    parse_metrics(text)
    started = time.process_time()
    for _ in range(repeats):
        parse_metrics(text)
    return 1e6 * (time.process_time() - started) / repeats


def _sim_page() -> str:
    """The simulated engine's metrics page, as it serves it."""
    with EngineProcess() as engine:
        url = f"http://{engine.host}:{engine.port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()


def series_page(text: str, names: frozenset[str]) -> str:
    """``text`` cut to the ``names`` series and their ``# HELP``/``# TYPE`` lines: what
    Prometheus's client library answers ``?name[]=…`` with."""
    kept = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#"):
            family = line.split(" ")[2] if line.count(" ") >= 2 else ""
            keep = family in names or f"{family}_total" in names
        else:
            keep = line.split("{")[0].split(" ")[0] in names
        if keep:
            kept.append(line)
    return "".join(kept)


def run(endpoints: list[int], duration_s: float, warmup_s: float) -> list[dict[str, Any]]:
    rows = []
    os.sched_setaffinity(0, SCRAPER_CORE)
    with tempfile.TemporaryDirectory(prefix="kvgate-scrape-") as workdir:
        sim_path = Path(workdir, "sim-metrics.txt")
        sim_path.write_text(_sim_page())
        asked_path = Path(workdir, "vllm-asked.txt")
        asked_path.write_text(series_page(VLLM_PAGE.read_text(), VLLM.wanted))
        for name, page in (("vLLM 0.32", VLLM_PAGE), ("vLLM 0.32, as asked", asked_path),
                           ("simulated engine", sim_path)):
            text = page.read_text()
            parse_us = _parse_us(text)
            for n in endpoints:
                row = _measure_against(page, n, duration_s, warmup_s)
                row |= {"page": name, "page_bytes": len(text.encode()), "parse_us": parse_us}
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _measure_against(page: Path, endpoints: int, duration_s: float, warmup_s: float
                     ) -> dict[str, Any]:
    """The scraper against ``endpoints`` stand-in engines serving ``page``."""
    ports = [free_port() for _ in range(endpoints)]
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.scrape_cost", "--serve", str(page),
         "--ports", ",".join(map(str, ports))], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        time.sleep(1.0)
        loop = new_event_loop()
        try:
            return loop.run_until_complete(
                _measure([f"127.0.0.1:{p}" for p in ports], warmup_s, duration_s))
        finally:
            loop.close()
    finally:
        server.terminate()
        server.wait(10)


async def chosen_page(address: str) -> str:
    """The URL kvgate's scraper reads ``address``'s figures from, once it has chosen."""
    store = EndpointStore()
    await store.set_endpoints(POOL, [address])
    scraper = Scraper(store)
    try:
        await scraper.scrape_once()
    finally:
        await scraper.stop()
    return scraper.pages[address]


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one process, from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_side(rates: list[float], duration_s: float) -> list[dict[str, Any]]:
    """A real vLLM's API server (idle, on core 0): its CPU per ``/metrics`` answered, with
    the page fetched ``rate`` times a second (one kvgate process at the default interval:
    10/s; three replicas: 30/s). Needs ``bench/vllm_cpu/setup.sh``."""
    from bench.vllm_cpu.launch import VllmServer

    rows = []
    with VllmServer(cpus=SERVER_CORE) as server:
        assert server.proc is not None
        pid, whole = server.proc.pid, server.url + "/metrics"
        time.sleep(2.0)
        cpu0, wall0 = _process_cpu_s(pid), time.monotonic()
        time.sleep(duration_s)
        idle = (_process_cpu_s(pid) - cpu0) / (time.monotonic() - wall0)
        asked = asyncio.run(chosen_page(server.url.partition("://")[2]))
        for page, url in (("whole", whole), ("as kvgate asks", asked)):
            body = urllib.request.urlopen(url, timeout=10).read()  # uncompressed, as kvgate
            for rate in rates:
                fetched, cpu0, wall0 = 0, _process_cpu_s(pid), time.monotonic()
                while (now := time.monotonic()) - wall0 < duration_s:
                    urllib.request.urlopen(url, timeout=10).read()
                    fetched += 1
                    time.sleep(max(0.0, wall0 + fetched / rate - time.monotonic()))
                busy = _process_cpu_s(pid) - cpu0 - idle * (now - wall0)
                rows.append({"page": page, "url": url, "rate": rate, "fetched": fetched,
                             "page_bytes": len(body), "idle_core_share": idle,
                             "ms_per_scrape": 1e3 * busy / fetched,
                             "core_share": busy / (now - wall0),
                             "figures_as_whole": parse_metrics(body.decode()) == parse_metrics(
                                 urllib.request.urlopen(whole, timeout=10).read().decode())})
                print(f"vLLM API server, {page} ({len(body)} B): {rate:4.0f}/s, {fetched} "
                      f"scrapes, {rows[-1]['ms_per_scrape']:.2f} ms CPU each above idle "
                      f"({100 * rows[-1]['core_share']:.1f}% of a core)", flush=True)
    return rows


def _line(r: dict[str, Any]) -> str:
    return (f"{r['page']:17} {r['page_bytes']:6} B  endpoints {r['endpoints']:3}  "
            f"scrapes {r['scrapes']:5} ({r['healthy']} healthy)  "
            f"{r['us_per_scrape']:6.0f} µs/scrape (parse {r['parse_us']:4.0f})  "
            f"{100 * r['core_share_per_endpoint']:5.2f}% of a core per endpoint")


def write(rows: list[dict[str, Any]], command: str) -> None:
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.joinpath("scrape-cost.json").write_text(json.dumps(
        {"command": command, "when": when, "machine": platform.processor() or platform.machine(),
         "split_us": split_costs(rows),
         "interval_s": INTERVAL_S, "rows": rows}, indent=1))
    lines = [
        "# What scraping the engines costs a kvgate process",
        "",
        f"`{command}` — {when}. kvgate's `Scraper` (uvloop, its aiohttp session) on one "
        "core, the stand-in engines on the other, every endpoint scraped every "
        f"{INTERVAL_S * 1000:.0f} ms (the default `scrape.interval_s`). µs per scrape = the "
        "scraper process's CPU over the window ÷ scrapes: fetch, parse and store swap.",
        "",
        "| metrics page | bytes | endpoints | scrapes | CPU µs per scrape | of which parsing "
        "| % of a core per endpoint |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['page']} | {r['page_bytes']:,} | {r['endpoints']} | {r['scrapes']:,} | "
              f"{r['us_per_scrape']:.0f} | {r['parse_us']:.0f} | "
              f"{100 * r['core_share_per_endpoint']:.2f} |" for r in rows]
    lines += ["", "Per round of the default interval (from the two largest endpoint counts of each "
              "page): a fixed part, and a part per endpoint.", ""]
    for page, (fixed_us, per_endpoint_us) in split_costs(rows).items():
        lines.append(f"- {page}: {fixed_us:.0f} µs per round + {per_endpoint_us:.0f} µs per "
                     f"endpoint, i.e. {fixed_us / INTERVAL_S / 1e4:.1f}% of a core + "
                     f"{per_endpoint_us / INTERVAL_S / 1e4:.2f}% per endpoint.")
    RESULTS.joinpath("scrape-cost.md").write_text("\n".join(lines) + "\n")


def split_costs(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """page → (µs per round whatever the endpoints, µs per endpoint per round)."""
    split = {}
    for page in dict.fromkeys(r["page"] for r in rows):
        mine = sorted((r for r in rows if r["page"] == page), key=lambda r: r["endpoints"])
        if len(mine) < 2:
            continue
        (n1, c1), (n2, c2) = ((r["endpoints"], r["us_per_scrape"] * r["endpoints"])
                              for r in mine[-2:])
        per_endpoint = (c2 - c1) / (n2 - n1)
        split[page] = (c1 - n1 * per_endpoint, per_endpoint)
    return split


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", default="1,4,16")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--engine-side", default="",
                        help="instead: scrapes per second against a real vLLM (e.g. 10,30), "
                        "its API server's CPU per scrape (bench/vllm_cpu/setup.sh first)")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the engines' process
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_main(args.serve, [int(p) for p in args.ports.split(",")])
        return
    if args.engine_side:
        rows = engine_side([float(r) for r in args.engine_side.split(",")], args.duration)
        RESULTS.joinpath("scrape-cost-vllm.json").write_text(json.dumps(
            {"command": " ".join(["python -m bench.scrape_cost", *argv]),
             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows},
            indent=1))
        print("wrote bench/results/scrape-cost-vllm.json")
        return
    rows = run([int(n) for n in args.endpoints.split(",")], args.duration, args.warmup)
    write(rows, " ".join(["python -m bench.scrape_cost", *argv]))
    print("wrote bench/results/scrape-cost.{md,json}")


if __name__ == "__main__":
    main(sys.argv[1:])
