"""The scraper reads each pool's bodies through its own engine's names, from the port its
engines serve metrics on (``metrics_port``: Triton's is not its inference port)."""

from __future__ import annotations

from extproc.datalayer.endpoints import EndpointStore
from extproc.datalayer.metrics import SGLANG, TRTLLM
from extproc.datalayer.scraper import Scraper
from tests.conftest import free_port
from tests.paths import DATA
from tests.unit.extproc.datalayer.test_scraper import MetricsServers


async def test_each_pool_is_read_as_its_engine_from_its_metrics_port() -> None:
    triton = MetricsServers(1, body=(DATA / "trtllm-triton-sample-metrics.txt").read_text())
    sglang = MetricsServers(1, body=(DATA / "sglang-sample-metrics.txt").read_text())
    async with triton as [triton_metrics], sglang as [sglang_address]:
        metrics_port = int(triton_metrics.rpartition(":")[2])
        triton_address = f"127.0.0.1:{free_port()}"  # where requests go; nothing scraped there
        store = EndpointStore()
        await store.set_endpoints("triton", [triton_address])
        await store.set_endpoints("sg", [sglang_address])
        scraper = Scraper(store, engines={"triton": "trtllm", "sg": "sglang"},
                          metrics_ports={"triton": metrics_port})
        try:
            snapshot = await scraper.scrape_once()
        finally:
            await scraper.stop()
    trt, sg = snapshot.get("triton", triton_address), snapshot.get("sg", sglang_address)
    assert trt.healthy and sg.healthy
    assert (trt.kv_cache_usage, trt.kv_capacity_tokens, trt.metrics.num_requests_waiting) == (
        0.25, 4096 * 64, 2)
    assert (sg.kv_cache_usage, sg.kv_capacity_tokens) == (0.25, 8192)
    # each asked, after its whole page, for its own engine's series
    assert [names for _, names, _ in triton.asked][:2] == [[], sorted(TRTLLM.wanted)]
    assert [names for _, names, _ in sglang.asked][:2] == [[], sorted(SGLANG.wanted)]


async def test_a_pool_read_as_the_wrong_engine_says_so() -> None:
    async with MetricsServers(1, body=(DATA / "tgi-sample-metrics.txt").read_text()) as [addr]:
        store = EndpointStore()
        await store.set_endpoints("p", [addr])
        scraper = Scraper(store)  # vLLM by default
        try:
            state = (await scraper.scrape_once()).get("p", addr)
        finally:
            await scraper.stop()
    assert state.metrics is None and state.last_error == f"no vllm metrics at http://{addr}/metrics"
