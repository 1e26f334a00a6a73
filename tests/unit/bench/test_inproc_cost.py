"""``bench.inproc_cost --concurrency``: requests in flight together, each released."""

from __future__ import annotations

from bench.inproc_cost import Bench, concurrent_table, config, measure_concurrent


async def test_requests_in_flight_together_are_each_admitted_and_released():
    bench = Bench(config(max_unstarted=1000))
    cpu_us = await measure_concurrent(bench, requests=48, batches=1, concurrency=8)
    assert cpu_us > 0
    assert not bench.director.active and not bench.processor.open
    assert bench.fallbacks() == 0


def test_the_table_gives_each_store_against_memory():
    table = concurrent_table({"memory": {"cpu_us": 70.0, "fallbacks": 0.0},
                              "redis": {"cpu_us": 105.0, "fallbacks": 3.0}})
    assert table.splitlines()[2].split() == ["redis", "105.0", "1.50", "3"]
