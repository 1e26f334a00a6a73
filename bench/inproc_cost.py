"""kvgate's own Python per non-streamed request, in process: no gRPC, no Envoy, no sockets.

    .venv/bin/python -m bench.inproc_cost [--requests 4000] [--batches 5]

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

import kvgate_native
from bench.overhead import API_KEY, BODY, LIMITS, MODEL
from extproc.config import hash_api_key, parse_config
from extproc.datalayer.endpoints import EndpointStore, ScrapeResult
from extproc.datalayer.metrics import EngineMetrics
from extproc.messages import ATTRIBUTES_NAMESPACE, attribute_names, parse_request
from extproc.metrics import Metrics
from extproc.reports import ReportDesk, _ReportProtocol
from extproc.server import ExternalProcessor
from extproc.wiring import build_director
from limiter.stores import MemoryStore

RESULTS = Path(__file__).parent / "results"
ENGINE = "127.0.0.1:9"
STAGES = ("parse", "routing reply", "report", "stream end")
USAGE = b'{"usage":{"prompt_tokens":20,"completion_tokens":4,"total_tokens":24},' \
        b'"events":0,"answered":true}'


def config():
    return parse_config({
        "tiers": {"bench": {"limits": LIMITS}},
        "tenants": [{"name": "bench", "tier": "bench", "api_keys": [hash_api_key(API_KEY)]}],
        "pools": [{"name": "bench", "models": [{"name": MODEL, "default_max_tokens": 16}],
                   "endpoints": [ENGINE], "priority_scheduling": True}],
    })


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
    def __init__(self) -> None:
        cfg = config()
        self.endpoints = EndpointStore()
        self.metrics = Metrics()
        self.desk = ReportDesk(self.metrics)
        self.director = build_director(cfg, MemoryStore(), self.endpoints)
        self.processor = ExternalProcessor(self.director, self.metrics, cfg, self.desk)
        self.port = _ReportProtocol(self.desk.receive)
        self.port.connection_made(_Transport())  # type: ignore[arg-type]
        self.wire = envoy_message(cfg.classification.header).SerializeToString()

    async def scraped(self) -> None:
        await self.endpoints.set_endpoints("bench", [ENGINE])
        await self.endpoints.apply([ScrapeResult(ENGINE, time.monotonic(), EngineMetrics(
            kv_cache_usage=0.01, kv_capacity_tokens=100_000, num_requests_running=0,
            num_requests_waiting=0))])

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
                await bench.request(times, report_first)
            per_request = [t / requests * 1e6 for t in times]
            if best is None or sum(per_request) < sum(best):
                best = per_request
        assert best is not None
        rows["report, then the stream's end" if report_first
             else "the stream's end, then the report"] = best
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
    args = parser.parse_args()
    uvloop.install()
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


if __name__ == "__main__":
    main()
