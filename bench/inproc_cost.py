"""kvgate's own Python per non-streamed request, in process: no gRPC, no Envoy, no sockets.

    .venv/bin/python -m bench.inproc_cost [--requests 4000] [--batches 5]
    .venv/bin/python -m bench.inproc_cost --concurrency 16 [--requests 3200] [--batches 5]

What ``bench.overhead`` cannot separate: of an ext_proc process's CPU per request, how much
is kvgate's request path itself. One request here is what the shipped configuration does
with one (headers as attributes on the body message): Envoy's one message parsed as gRPC's
deserializer does (``parse``); ``ExternalProcessor.Process`` on it up to the routing reply;
the Lua meter's ``done`` report, as the bytes Envoy's HTTP/1.1 codec sends, through the
report port's parser; then the stream's end and the release. Both orders of the last two
are timed: the report usually comes first, and when it comes after, the release waits for
it in a task.

The same config as ``bench.overhead`` (one tenant with limits it never reaches, one pool of
one KV-aware engine kept freshly scraped and nearly empty), so every request is admitted at
once. Requests run one at a time on uvloop: caches stay warm, so these are lower bounds of
what the same code costs between gRPC's and the kernel's work in a served process. The
minimum of ``--batches`` batches; prints a table, writes ``bench/results/inproc-cost.{json,md}``.

``--concurrency N`` runs N requests at a time instead, first with the in-memory store, then
with Redis (a ``redis-server`` started on a free port, kvgate's store as ``redis: {url}``
builds it), and reports each one's CPU per request (``time.process_time``, which counts the
Redis client's socket calls too) and their ratio: what the Redis path costs in kvgate's own
Python, where the requests in flight share its writes as in a served process. Each request
gets its report first, then its stream's end. The pool's engine queue gate is opened
(``max_unstarted``: nothing here starts a request, so the gate would hold all but the first
back); a run in which the failure policy served any admission (Redis too slow for
``timeout_ms``) is marked, as it did not measure the Redis path. Writes
``bench/results/inproc-cost-concurrent.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

import kvgate_native
from bench.overhead import API_KEY, BODY, LIMITS, MODEL
from bench.redis_server import RedisServer
from extproc.config import Config, hash_api_key, parse_config
from extproc.datalayer.endpoints import EndpointStore, ScrapeResult
from extproc.datalayer.metrics import EngineMetrics
from extproc.messages import ATTRIBUTES_NAMESPACE, attribute_names, parse_request
from extproc.metrics import Metrics
from extproc.reports import ReportDesk, _ReportProtocol
from extproc.server import ExternalProcessor
from extproc.wiring import build_director, build_store

RESULTS = Path(__file__).parent / "results"
ENGINE = "127.0.0.1:9"
REFRESH_S = 0.1  # the engine is scraped again this often: kvgate's default scrape interval
STAGES = ("parse", "routing reply", "report", "stream end")
USAGE = b'{"usage":{"prompt_tokens":20,"completion_tokens":4,"total_tokens":24},' \
        b'"events":0,"answered":true}'


def config(redis_url: str | None = None, max_unstarted: int | None = None) -> Config:
    pool: dict[str, Any] = {"name": "bench", "models": [{"name": MODEL, "default_max_tokens": 16}],
            "endpoints": [ENGINE], "priority_scheduling": True}
    if max_unstarted is not None:
        pool["max_unstarted"] = max_unstarted
    data: dict[str, Any] = {
        "tiers": {"bench": {"limits": LIMITS}},
        "tenants": [{"name": "bench", "tier": "bench", "api_keys": [hash_api_key(API_KEY)]}],
        "pools": [pool],
    }
    if redis_url is not None:
        data["redis"] = {"url": redis_url}
    return parse_config(data)


def envoy_message(class_header: str) -> pb.ProcessingRequest:
    """The body message with the headers kvgate reads as attributes, as Envoy sends it."""
    message = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
    fields = message.attributes[ATTRIBUTES_NAMESPACE].fields
    attribute = {header: name for name, header in attribute_names(class_header).items()}
    for header, value in ((":path", "/v1/chat/completions"), (":method", "POST"),
                          ("authorization", f"Bearer {API_KEY}"),
                          ("x-request-id", "5f0c1e0e-2c4b-4b0e-9f43-d2a7")):
        fields[attribute[header]].string_value = value
    return message


def done_report(lease: str, key: str) -> bytes:
    """The meter's ``done`` report as Envoy's HTTP/1.1 codec writes it."""
    return (f"POST /done/{lease} HTTP/1.1\r\nhost: kvgate_report\r\n"
            f"x-envoy-original-dst-host: 127.0.0.1:40000\r\nx-kvgate-report-key: {key}\r\n"
            f"content-type: application/json\r\nx-forwarded-proto: http\r\n"
            f"x-request-id: 0b7d2c5e-1a2b-4c3d-8e9f-a0b1c2d3e4f5\r\n"
            f"x-envoy-expected-rq-timeout-ms: 1000\r\ncontent-length: {len(USAGE)}\r\n\r\n"
            ).encode() + USAGE


class _Transport:
    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


async def _envoy(message: pb.ProcessingRequest, end: asyncio.Event
                 ) -> AsyncIterator[pb.ProcessingRequest]:
    yield message
    await end.wait()  # Envoy half-closes once the response has ended


class Bench:
    def __init__(self, cfg: Config | None = None) -> None:
        cfg = cfg or config()
        self.endpoints = EndpointStore()
        self.metrics = Metrics()
        self.scraped_at = 0.0
        self.desk = ReportDesk(self.metrics)
        self.director = build_director(cfg, build_store(cfg, self.metrics), self.endpoints,
                                       metrics=self.metrics)
        self.processor = ExternalProcessor(self.director, self.metrics, cfg, self.desk)
        self.port = _ReportProtocol(self.desk.receive)
        self.port.connection_made(_Transport())  # type: ignore[arg-type]
        self.wire = envoy_message(cfg.classification.header).SerializeToString()

    async def scraped(self) -> None:
        """A scrape round, ended as the server's scraper ends one: the director reads it
        (the schedulers observe it, requests in flight are priced again) and kicks the
        queue's dispatcher, which runs here as served, should a request have waited."""
        for flow in self.director.flows.values():
            flow.start()
        self.scraped_at = time.monotonic()
        await self.endpoints.set_endpoints("bench", [ENGINE])
        await self.endpoints.apply([ScrapeResult(ENGINE, time.monotonic(), EngineMetrics(
            kv_cache_usage=0.01, kv_capacity_tokens=100_000, num_requests_running=0,
            num_requests_waiting=0))])
        self.director.scraped(self.endpoints.snapshot())

    async def close(self) -> None:
        """Stop the queue's dispatchers and close the store."""
        for flow in self.director.flows.values():
            await flow.stop()
        await self.director.store.close()

    async def fresh(self) -> None:
        """A scrape round every ``REFRESH_S``, as served. With one round per batch, a batch
        that ran past the scrape's freshness (a slow or busy machine, a larger ``--requests``)
        found the engine stale, its requests queued, and with no dispatcher running in the
        bench they waited for ever."""
        if time.monotonic() - self.scraped_at > REFRESH_S:
            await self.scraped()

    async def request(self, times: list[float], report_first: bool) -> None:
        """One request; adds each stage's seconds to ``times``. The release is counted in
        whichever of the report and the stream's end comes second."""
        clock = time.perf_counter
        started = clock()
        message, end = parse_request(self.wire), asyncio.Event()  # as gRPC hands it over
        built = clock()
        handler = self.processor.Process(_envoy(message, end), None)  # type: ignore[arg-type]
        reply = await anext(handler)
        routed = clock()
        (stream,) = self.processor.open
        assert isinstance(reply, bytes) and stream.admission is not None, reply
        report = done_report(stream.admission.lease_id, self.desk.key)
        if report_first:
            self.port.data_received(report)
            reported = clock()
            end.set()
            await anext(handler, None)
            ended = clock()
            spent = (reported - routed, ended - reported)
        else:
            end.set()
            await anext(handler, None)  # the release now waits for the report, in a task
            ended = clock()
            self.port.data_received(report)
            await asyncio.gather(*self.processor.releasing)
            spent = (clock() - ended, ended - routed)
        for i, seconds in enumerate((built - started, routed - built, *spent)):
            times[i] += seconds
        assert not self.director.active


    async def request_among_others(self) -> None:
        """One request while others are in flight: its routing reply, its done report,
        then its stream's end (and the release)."""
        message, end = parse_request(self.wire), asyncio.Event()
        handler = self.processor.Process(_envoy(message, end), None)  # type: ignore[arg-type]
        reply = await anext(handler)
        assert isinstance(reply, bytes), reply
        stream = next(s for s in self.processor.open
                      if s.admission is not None and s.admission.lease_id.encode() in reply)
        assert stream.admission is not None
        self.port.data_received(done_report(stream.admission.lease_id, self.desk.key))
        end.set()
        await anext(handler, None)

    def fallbacks(self) -> float:
        """Admissions the failure policy served (Redis did not answer in time)."""
        return sum(sample.value for metric in self.metrics.store_fallbacks.collect()
                   for sample in metric.samples if sample.name.endswith("_total"))


async def measure_concurrent(bench: Bench, requests: int, batches: int,
                             concurrency: int) -> float:
    """CPU µs per request, ``concurrency`` requests at a time: the minimum of ``batches``
    batches after one that warms up."""
    async def client(count: int) -> None:
        for _ in range(count):
            await bench.fresh()
            await bench.request_among_others()

    best = None
    for _ in range(batches + 1):
        await bench.scraped()
        started = time.process_time()
        await asyncio.gather(*(client(requests // concurrency) for _ in range(concurrency)))
        while bench.processor.releasing:
            await asyncio.gather(*bench.processor.releasing)
        spent = (time.process_time() - started) / (requests // concurrency * concurrency)
        best = spent if best is None else min(best, spent)
    await asyncio.sleep(0.05)  # the last releases' answers
    assert not bench.director.active, bench.director.active
    assert best is not None
    return best * 1e6


async def concurrent_rows(requests: int, batches: int, concurrency: int
                          ) -> dict[str, dict[str, float]]:
    rows = {}
    memory = Bench(config(max_unstarted=1000))
    rows["memory"] = {"cpu_us": await measure_concurrent(memory, requests, batches,
                                                         concurrency), "fallbacks": 0.0}
    await memory.close()
    with RedisServer() as server:
        redis = Bench(config(server.url, max_unstarted=1000))
        cpu = await measure_concurrent(redis, requests, batches, concurrency)
        rows["redis"] = {"cpu_us": cpu, "fallbacks": redis.fallbacks()}
        await redis.close()
    return rows


def concurrent_table(rows: dict[str, dict[str, float]]) -> str:
    memory = rows["memory"]["cpu_us"]
    lines = [f"{'store':8} {'CPU µs/request':>15} {'÷ memory':>9} {'fallback admissions':>20}"]
    for store, row in rows.items():
        lines.append(f"{store:8} {row['cpu_us']:15.1f} {row['cpu_us'] / memory:9.2f} "
                     f"{row['fallbacks']:20.0f}")
    return "\n".join(lines)


async def measure(requests: int, batches: int) -> dict[str, list[float]]:
    bench = Bench()
    await bench.scraped()
    rows = {}
    for report_first in (True, False):
        best: list[float] | None = None
        for _ in range(batches + 1):  # the first batch warms up
            await bench.scraped()
            times = [0.0] * len(STAGES)
            for _ in range(requests):
                await bench.fresh()
                await bench.request(times, report_first)
            per_request = [t / requests * 1e6 for t in times]
            if best is None or sum(per_request) < sum(best):
                best = per_request
        assert best is not None
        rows["report, then the stream's end" if report_first
             else "the stream's end, then the report"] = best
    await bench.close()
    return rows


def table(rows: dict[str, list[float]]) -> str:
    lines = [f"{'order':36} " + " ".join(f"{s:>15}" for s in (*STAGES, "total")),]
    for order, stages in rows.items():
        lines.append(f"{order:36} " + " ".join(f"{v:15.1f}" for v in (*stages, sum(stages))))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.inproc_cost", description=__doc__)
    parser.add_argument("--requests", type=int, default=4000, help="per batch")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="requests at a time, memory and Redis (default: one at a time, "
                             "memory, by stage)")
    args = parser.parse_args()
    uvloop.install()
    if args.concurrency:
        concurrent_main(args)
        return
    rows = asyncio.run(measure(args.requests, args.batches))
    command = "python -m bench.inproc_cost " + " ".join(sys.argv[1:])
    text = (f"µs per request, minimum of {args.batches} batches of {args.requests}; "
            f"hot path: {kvgate_native.status()}\n\n{table(rows)}")
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "inproc-cost.json").write_text(json.dumps(
        {"command": command, "hot_path": kvgate_native.status(), "stages": STAGES,
         "rows": rows}, indent=1) + "\n")
    (RESULTS / "inproc-cost.md").write_text(f"# kvgate's Python per request, in process\n\n"
                                            f"`.venv/bin/{command.strip()}`\n\n```\n{text}\n```\n")


def concurrent_main(args: argparse.Namespace) -> None:
    rows = asyncio.run(concurrent_rows(args.requests, args.batches, args.concurrency))
    command = "python -m bench.inproc_cost " + " ".join(sys.argv[1:])
    text = (f"CPU µs per request, {args.concurrency} at a time, minimum of {args.batches} "
            f"batches of {args.requests}; hot path: {kvgate_native.status()}\n\n"
            f"{concurrent_table(rows)}")
    if rows["redis"]["fallbacks"]:
        text += "\n\nThe failure policy served admissions: the Redis row is not the Redis path."
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "inproc-cost-concurrent.json").write_text(json.dumps(
        {"command": command, "hot_path": kvgate_native.status(), "rows": rows}, indent=1)
        + "\n")
    (RESULTS / "inproc-cost-concurrent.md").write_text(
        f"# kvgate's Python per request, in process, {args.concurrency} at a time\n\n"
        f"`.venv/bin/{command.strip()}`\n\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
