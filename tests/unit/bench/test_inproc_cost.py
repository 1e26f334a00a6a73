"""``bench.inproc_cost --concurrency``: requests in flight together, each released."""

from __future__ import annotations

import asyncio
import time

from bench.inproc_cost import (
    ENGINE,
    REFRESH_S,
    Bench,
    concurrent_table,
    config,
    measure_concurrent,
)
from extproc.datalayer.endpoints import ScrapeResult
from extproc.datalayer.metrics import EngineMetrics


async def test_requests_in_flight_together_are_each_admitted_and_released():
    bench = Bench(config(max_unstarted=1000))
    cpu_us = await measure_concurrent(bench, requests=48, batches=1, concurrency=8)
    assert cpu_us > 0
    assert not bench.director.active and not bench.processor.open
    assert bench.fallbacks() == 0
    await bench.close()


async def test_a_request_queued_behind_a_stale_scrape_goes_at_the_next_round():
    """A batch that outlived the scrape's freshness queued its requests and, with no
    dispatcher running, waited for ever: the bench now scrapes every ``REFRESH_S`` and
    runs the queue's dispatcher, as served."""
    bench = Bench(config(max_unstarted=1000))
    await bench.scraped()
    await bench.endpoints.apply([ScrapeResult(ENGINE, time.monotonic() - 60, EngineMetrics(
        kv_cache_usage=0.01, kv_capacity_tokens=100_000, num_requests_running=0,
        num_requests_waiting=0))])  # the last round, a minute old
    request = asyncio.ensure_future(bench.request_among_others())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not request.done() and bench.director.active  # queued
    bench.scraped_at -= REFRESH_S
    await bench.fresh()
    await asyncio.wait_for(request, 5)
    assert not bench.director.active
    await bench.close()


def test_the_table_gives_each_store_against_memory():
    table = concurrent_table({"memory": {"cpu_us": 70.0, "fallbacks": 0.0},
                              "redis": {"cpu_us": 105.0, "fallbacks": 3.0}})
    assert table.splitlines()[2].split() == ["redis", "105.0", "1.50", "3"]
