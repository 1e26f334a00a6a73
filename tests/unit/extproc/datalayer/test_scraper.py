"""The scraper (extproc.datalayer.scraper) against real simulated vLLM engines over HTTP.

Engines run in-process (``extproc.engine.server.start_engine``); ``MetricsServers`` is a real HTTP
server (several ports) answering ``/metrics`` with a vLLM body after a delay, for what the
engine cannot show: how many scrapes are in flight at once, timeouts, non-vLLM answers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from extproc.config import hash_api_key, parse_config
from extproc.datalayer.agent import start_agent
from extproc.datalayer.endpoints import EndpointState, EndpointStore, StoreSnapshot
from extproc.datalayer.metrics import VLLM, parse_metrics
from extproc.datalayer.nvml import NOT_AVAILABLE_BYTES, GpuReading, NvmlReader
from extproc.datalayer.scraper import (
    MAX_ENGINE_PAGE_BYTES,
    MAX_GPU_PAGE_BYTES,
    GpuSource,
    Scraper,
    ScrapeSettings,
)
from extproc.engine.server import EngineHandle, start_engine
from extproc.scheduler import PoolScheduler
from limiter import Reject
from tests.paths import DATA
from tests.unit.extproc.datalayer.test_nvml import GPUS, FakeGpuReader, StubNvml

SAMPLE = (DATA / "vllm-sample-metrics.txt").read_text()
ENGINE_OPTS = {"ms_per_token": 1, "prefill_us_per_token": 1, "kv_blocks": 100,
               "block_size": 16}


@pytest.fixture
async def engine() -> AsyncIterator[EngineHandle]:
    handle = await start_engine(port=0, **ENGINE_OPTS)
    yield handle
    await handle.stop()


def address(engine: EngineHandle) -> str:
    return f"{engine.host}:{engine.port}"


async def post(url: str, payload: Any) -> Any:
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def eventually(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    """Wait until ``condition()`` holds; fail the test (not hang it) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def one_engine_store(engine: EngineHandle, pool: str = "chat") -> EndpointStore:
    store = EndpointStore()
    await store.set_endpoints(pool, [address(engine)])
    return store


class MetricsServers:
    """One aiohttp app on ``count`` ports: ``/metrics`` answers after ``delay_s``."""

    def __init__(self, count: int, delay_s: float = 0.0, status: int = 200,
                 body: str = SAMPLE, filtered: Callable[[str, list[str]], str] | None = None,
                 filter_on: str = "/metrics"):
        """``filtered(body, names)``: the answer to a ``?name[]=`` query on ``filter_on``
        (``/metrics`` or ``/metrics/``; None: the query is ignored)."""
        self.count, self.delay_s, self.status, self.body = count, delay_s, status, body
        self.filtered, self.filter_on = filtered, filter_on
        self.in_flight = self.max_in_flight = self.requests = 0
        self.asked: list[tuple[str, list[str], str]] = []  # path, name[], accept-encoding
        self.runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.requests += 1
        names = request.query.getall("name[]", [])
        self.asked.append((request.path, names, request.headers.get("accept-encoding", "")))
        body = self.body
        if self.filtered is not None and names and request.path == self.filter_on:
            body = self.filtered(self.body, names)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        return web.Response(text=body, status=self.status)

    async def __aenter__(self) -> list[str]:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._metrics)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        for _ in range(self.count):
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return [f"127.0.0.1:{port}" for _host, port in self.runner.addresses]

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


# -- values flow through -------------------------------------------------------------------


async def test_engine_values_flow_into_the_store(engine: EngineHandle) -> None:
    store = await one_engine_store(engine)
    await post(f"{engine.url}/v1/completions",
               {"prompt": "one two three four five", "max_tokens": 3})
    scraper = Scraper(store)
    try:
        before = time.monotonic()
        snapshot = await scraper.scrape_once()
    finally:
        await scraper.stop()
    state = snapshot.get("chat", address(engine))
    assert state is not None and state.healthy and state.is_fresh(time.monotonic())
    assert state.scraped_at is not None and state.scraped_at >= before
    metrics = state.metrics
    assert metrics is not None and metrics.problems == ()
    assert (metrics.prompt_tokens_total, metrics.generation_tokens_total) == (5, 3)
    assert (metrics.num_requests_running, metrics.num_requests_waiting) == (0, 0)
    assert metrics.kv_cache_usage == 0.0 and metrics.models == ("tiny-llama",)
    assert state.kv_capacity_tokens == 100 * 16


async def test_debug_overrides_show_on_the_next_scrape(engine: EngineHandle) -> None:
    store = await one_engine_store(engine)
    scraper = Scraper(store)
    try:
        await scraper.scrape_once()
        await post(f"{engine.url}/debug/metrics",
                   {"kv_cache_usage_perc": 0.93, "num_requests_waiting": 12,
                    "num_preemptions_total": 4})
        metrics = (await scraper.scrape_once()).get("chat", address(engine)).metrics
        assert (metrics.kv_cache_usage, metrics.num_requests_waiting,
                metrics.num_preemptions_total) == (0.93, 12, 4)
        await post(f"{engine.url}/debug/metrics", {})
        metrics = (await scraper.scrape_once()).get("chat", address(engine)).metrics
        assert (metrics.kv_cache_usage, metrics.num_requests_waiting) == (0.0, 0)
    finally:
        await scraper.stop()


# -- asking for the series kvgate reads ---------------------------------------------------


def keep_series(body: str, names: list[str]) -> str:
    """What Prometheus's client library answers a ``name[]`` query with: those series."""
    return "".join(line for line in body.splitlines(keepends=True)
                   if line.split("{")[0].split(" ")[0] in names)


async def scrape_rounds(addresses: list[str], rounds: int) -> tuple[Scraper, EndpointState]:
    store = EndpointStore()
    await store.set_endpoints("p", addresses)
    scraper = Scraper(store)
    try:
        for _ in range(rounds):
            state = (await scraper.scrape_once()).get("p", addresses[0])
    finally:
        await scraper.stop()
    return scraper, state


WANTED = sorted(VLLM.wanted)


async def test_an_engine_is_asked_for_the_series_kvgate_reads_once_that_loses_nothing() -> None:
    servers = MetricsServers(1, filtered=keep_series)
    async with servers as [where]:
        scraper, state = await scrape_rounds([where], 3)
    # the first round reads the whole page and checks the filtered one against it
    assert [(path, names) for path, names, _ in servers.asked] == [
        ("/metrics", []), *[("/metrics", WANTED)] * 3]
    assert all(encoding == "identity" for *_, encoding in servers.asked)
    assert scraper.pages[where].startswith(f"http://{where}/metrics?name%5B%5D=")
    assert state.metrics == parse_metrics(SAMPLE)  # every figure, as from the whole page


async def test_a_filter_honoured_only_below_the_path_is_found_there() -> None:
    """vLLM answers ``/metrics`` with a handler that ignores the query, and routes
    ``/metrics/`` to Prometheus's client library, which filters."""
    servers = MetricsServers(1, filtered=keep_series, filter_on="/metrics/")
    async with servers as [where]:
        scraper, state = await scrape_rounds([where], 2)
    assert [(path, names) for path, names, _ in servers.asked] == [
        ("/metrics", []), ("/metrics", WANTED), ("/metrics/", WANTED), ("/metrics/", WANTED)]
    assert scraper.pages[where].startswith(f"http://{where}/metrics/?name%5B%5D=")
    assert state.metrics == parse_metrics(SAMPLE)


@pytest.mark.parametrize("drop", ["vllm:cache_config_info", "vllm:num_requests_waiting", "*"])
async def test_a_filter_that_loses_a_figure_is_not_used(drop: str) -> None:
    """A filtered page that lacks a figure, or has none (a multiprocess registry, SGLang's,
    answers every filter with an empty page): that endpoint is read from its whole page."""
    def lossy(body: str, names: list[str]) -> str:
        return keep_series(body, [n for n in names if drop not in (n, "*")])

    servers = MetricsServers(1, filtered=lossy)
    async with servers as [where]:
        scraper, state = await scrape_rounds([where], 3)
    assert [names for _, names, _ in servers.asked][-2:] == [[], []]
    assert scraper.pages == {where: f"http://{where}/metrics"}
    assert state.metrics == parse_metrics(SAMPLE)


async def test_a_server_without_the_filter_is_read_from_its_whole_page() -> None:
    servers = MetricsServers(1)
    async with servers as [where]:
        scraper, state = await scrape_rounds([where], 2)
    assert scraper.pages == {where: f"http://{where}/metrics"}
    assert state.metrics == parse_metrics(SAMPLE)


async def test_an_unreachable_endpoint_is_checked_again_when_it_answers(engine: EngineHandle
                                                                        ) -> None:
    store = await one_engine_store(engine)
    scraper = Scraper(store)
    where = address(engine)
    try:
        await scraper.scrape_once()
        assert "?name%5B%5D=" in scraper.pages[where]  # the simulated engine filters too
        await engine.stop()
        await scraper.scrape_once()
        assert where not in scraper.pages
    finally:
        await scraper.stop()


def _not_found() -> str:
    raise web.HTTPNotFound()


@pytest.mark.parametrize("status", [200, 404])
async def test_a_filter_that_stops_answering_metrics_is_chosen_again(status: int) -> None:
    """The server behind the address changed without ever being unreachable (a sidecar
    proxy answered while the engine restarted): its filter now gives an empty page, or its
    filtered path is gone. The whole page is read, and the endpoint stays fresh; a filter
    kept left it healthy but stale for good."""
    servers = MetricsServers(1, filtered=keep_series)
    async with servers as [where]:
        store = EndpointStore()
        await store.set_endpoints("p", [where])
        scraper = Scraper(store)
        try:
            await scraper.scrape_once()
            assert "?name%5B%5D=" in scraper.pages[where]
            servers.filtered = lambda body, names: "" if status == 200 else _not_found()
            first = await scraper.scrape_once()
            assert first.get("p", where).last_error is not None
            state = (await scraper.scrape_once()).get("p", where)
        finally:
            await scraper.stop()
    assert state.last_error is None and state.healthy
    assert state.scraped_at is not None and state.scraped_at > first.get("p", where).scraped_at
    assert state.metrics == parse_metrics(SAMPLE)
    assert scraper.pages[where] == f"http://{where}/metrics"  # none filters any more


async def test_an_address_discovery_dropped_and_gave_again_is_read_afresh() -> None:
    """The page chosen for an address was kept after discovery dropped it (every rollout's
    old pod addresses stayed in the table), and used as it was when the address came back,
    maybe for another server: one whose filter loses a figure (here the KV capacity) was
    read through it unchecked."""
    servers = MetricsServers(1, filtered=keep_series)
    async with servers as [where]:
        store = EndpointStore()
        await store.set_endpoints("p", [where])
        scraper = Scraper(store)
        try:
            await scraper.scrape_once()
            assert "?name%5B%5D=" in scraper.pages[where]
            await store.set_endpoints("p", [])
            await scraper.scrape_once()
            assert scraper.pages == {}
            servers.filtered = lambda body, names: keep_series(
                body, [n for n in names if n != "vllm:cache_config_info"])
            await store.set_endpoints("p", [where])
            state = (await scraper.scrape_once()).get("p", where)
        finally:
            await scraper.stop()
    assert state.metrics == parse_metrics(SAMPLE)
    assert state.kv_capacity_tokens is not None
    assert scraper.pages == {where: f"http://{where}/metrics"}


# -- failures, health and staleness --------------------------------------------------------


async def test_a_stopped_engine_turns_unhealthy_then_stale_and_recovers(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = await start_engine(port=0, **ENGINE_OPTS)
    port, where = engine.port, address(engine)
    store = await one_engine_store(engine)
    # a refused connection fails at once; the restarted engine's first answer may be slow
    # on a busy machine (CI once took over 0.5 s)
    scraper = Scraper(store, unhealthy_after=3, timeout_s=5.0)
    with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
        try:
            last_good = (await scraper.scrape_once()).get("chat", where).scraped_at
            await engine.stop()
            for attempt in range(1, 6):
                state = (await scraper.scrape_once()).get("chat", where)
                assert state.consecutive_failures == attempt
                assert state.healthy is (attempt < 3)
                assert state.scraped_at == last_good  # the last good scrape ages
            assert "Connect" in state.last_error
            assert state.is_fresh(last_good + 0.2, staleness_s=0.3)
            assert not state.is_fresh(last_good + 0.31, staleness_s=0.3)

            engine = await start_engine(port=port, **ENGINE_OPTS)
            state = (await scraper.scrape_once()).get("chat", where)
            assert state.healthy and state.consecutive_failures == 0
        finally:
            await scraper.stop()
            await engine.stop()
    messages = [r.getMessage() for r in caplog.records if r.name.endswith("scraper")]
    pages = [m for m in messages if "metrics read from" in m]
    assert len(pages) == 2  # chosen when it came up, and again when it came back
    messages = [m for m in messages if m not in pages]
    assert len(messages) == 3, messages  # up, unhealthy (once, not per failure), recovered
    assert "up" in messages[0] and "unhealthy after 3" in messages[1]
    assert "recovered" in messages[2]


async def test_a_slow_endpoint_times_out_without_holding_the_round() -> None:
    async with MetricsServers(1, delay_s=2.0) as [slow]:
        store = EndpointStore()
        await store.set_endpoints("p", [slow])
        scraper = Scraper(store, timeout_s=0.1)
        started = time.monotonic()
        try:
            state = (await scraper.scrape_once()).get("p", slow)
        finally:
            await scraper.stop()
        assert time.monotonic() - started < 0.5
        assert state.last_error == "timed out after 0.1s" and state.consecutive_failures == 0


async def test_a_slow_engine_keeps_its_last_reading_until_stale_and_stays_healthy() -> None:
    """Slow is not down: an engine that answers late keeps its last numbers (they age), and
    only an unreachable one is unhealthy."""
    servers = MetricsServers(1)
    async with servers as [where]:
        store = EndpointStore()
        await store.set_endpoints("p", [where])
        scraper = Scraper(store, timeout_s=0.1, unhealthy_after=3)
        try:
            good = (await scraper.scrape_once()).get("p", where)
            servers.delay_s = 1.0
            for _ in range(5):
                state = (await scraper.scrape_once()).get("p", where)
        finally:
            await scraper.stop()
    assert state.healthy and state.consecutive_failures == 0
    assert state.metrics == good.metrics and state.scraped_at == good.scraped_at
    assert state.last_error == "timed out after 0.1s"
    assert state.is_usable(good.scraped_at + 1.9) and not state.is_usable(good.scraped_at + 2.1)


async def test_a_connection_reset_counts_as_unreachable() -> None:
    async def reset(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # linger 0: the close sends RST

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    where = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    store = EndpointStore()
    await store.set_endpoints("p", [where])
    scraper = Scraper(store, unhealthy_after=2)
    try:
        for _ in range(2):
            state = (await scraper.scrape_once()).get("p", where)
    finally:
        await scraper.stop()
        server.close()
    assert state.consecutive_failures == 2 and state.last_error


@pytest.mark.parametrize(("status", "body", "error"), [
    (404, "not found", "HTTP 404"),
    (200, "<html>a proxy page</html>", "no vllm metrics"),
])
async def test_answers_that_are_not_vllm_metrics_are_failures(status: int, body: str,
                                                              error: str) -> None:
    async with MetricsServers(1, status=status, body=body) as [where]:
        store = EndpointStore()
        await store.set_endpoints("p", [where])
        scraper = Scraper(store)
        try:
            state = (await scraper.scrape_once()).get("p", where)
        finally:
            await scraper.stop()
        assert state.metrics is None and error in state.last_error


async def test_the_loop_keeps_metrics_within_the_staleness_bound(engine: EngineHandle) -> None:
    store = await one_engine_store(engine)
    scraper = Scraper(store, interval_s=0.02)
    scraper.start()
    try:
        await eventually(lambda: scraper.rounds > 0)
        worst = 0.0
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            state = store.snapshot().get("chat", address(engine))
            worst = max(worst, time.monotonic() - state.scraped_at)
            await asyncio.sleep(0.003)
        assert worst < 0.3  # interval + one round, with room for a busy CI machine
        assert scraper.rounds >= 8
    finally:
        await scraper.stop()
    assert not scraper.running
    rounds = scraper.rounds
    await asyncio.sleep(0.05)
    assert scraper.rounds == rounds  # stopped means stopped


async def test_readers_see_the_previous_snapshot_while_a_round_waits_on_the_network() -> None:
    servers = MetricsServers(2, delay_s=0.2)
    async with servers as addresses:
        store = EndpointStore()
        await store.set_endpoints("p", addresses)
        before = store.snapshot()
        scraper = Scraper(store)
        round_task = asyncio.create_task(scraper.scrape_once())
        try:
            await eventually(lambda: servers.in_flight == 2)  # the round waits on both ...
            assert store.snapshot() is before  # ... and readers get the last swap's state
            after = await round_task
        finally:
            await scraper.stop()
    assert after.version == before.version + 1
    assert servers.max_in_flight == 2


@pytest.mark.parametrize("own_session", [False, True], ids=["default", "factory"])
async def test_concurrency_is_bounded(own_session: bool) -> None:
    servers = MetricsServers(10, delay_s=0.03)
    # a factory's session has aiohttp's default connection limit (100): the semaphore bounds
    factory = aiohttp.ClientSession if own_session else None
    async with servers as addresses:
        store = EndpointStore()
        await store.set_endpoints("p", addresses)
        scraper = Scraper(store, session_factory=factory, max_concurrency=3)
        started = time.monotonic()
        try:
            await scraper.scrape_once()
            snapshot = await scraper.scrape_once()
        finally:
            await scraper.stop()
        elapsed = time.monotonic() - started
    assert all(state.healthy for state in snapshot.states())
    # the first round also tries both filtered URLs once (this server ignores the filter)
    assert servers.requests == 40 and servers.max_in_flight == 3
    assert elapsed >= 2 * 4 * 0.03  # two rounds of ceil(10 / 3) waves


# -- GPU sources ---------------------------------------------------------------------------


async def test_gpu_readings_from_an_agent_url(engine: EngineHandle) -> None:
    agent = await start_agent(reader=FakeGpuReader(), interval_s=0.05)
    store = await one_engine_store(engine)
    scraper = Scraper(store, gpu_sources={address(engine): agent.metrics_url})
    try:
        state = (await scraper.scrape_once()).get("chat", address(engine))
    finally:
        await scraper.stop()
        await agent.stop()
    assert state.gpus == tuple(GPUS) and state.gpus_read_at is not None
    assert state.gpu_memory_used_ratio == pytest.approx(40 / 141)


async def test_an_agent_url_template_and_a_gpu_filter_per_pool(engine: EngineHandle) -> None:
    agent = await start_agent(reader=FakeGpuReader())
    store = await one_engine_store(engine)
    template = f"http://{{ip}}:{agent.port}"  # /metrics is added
    source = GpuSource(GpuSource.parse(template).url, gpus=frozenset({"1:2", "GPU-aaaa"}))
    scraper = Scraper(store, gpu_sources={"chat": source})
    try:
        state = (await scraper.scrape_once()).get("chat", address(engine))
    finally:
        await scraper.stop()
        await agent.stop()
    assert state.gpus == (GPUS[0], GPUS[2])  # by UUID, and MIG slot 2 of GPU 1 by key


async def test_local_gpu_reader_is_read_once_per_round(engine: EngineHandle) -> None:
    second = await start_engine(port=0, **ENGINE_OPTS)
    reader = FakeGpuReader()
    store = EndpointStore()
    await store.set_endpoints("chat", [address(engine), address(second)])
    scraper = Scraper(store, gpu_sources={"chat": "local"}, gpu_reader=reader)
    try:
        snapshot = await scraper.scrape_once()
    finally:
        await scraper.stop()
        await second.stop()
    assert reader.reads == 1
    assert all(state.gpus == tuple(GPUS) for state in snapshot.states())


async def test_a_failing_gpu_source_keeps_old_readings_and_logs_once(
        engine: EngineHandle, caplog: pytest.LogCaptureFixture) -> None:
    reader = FakeGpuReader()
    store = await one_engine_store(engine)
    scraper = Scraper(store, gpu_sources={"chat": "local"}, gpu_reader=reader)
    try:
        first = (await scraper.scrape_once()).get("chat", address(engine))
        reader.fail = True
        with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
            for _ in range(3):
                state = (await scraper.scrape_once()).get("chat", address(engine))
            reader.fail = False
            await scraper.scrape_once()
    finally:
        await scraper.stop()
    assert state.gpus == tuple(GPUS) and state.gpus_read_at == first.gpus_read_at
    assert state.healthy  # GPU trouble is not endpoint trouble
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]


async def test_a_gpu_reading_kept_past_the_staleness_bound_is_unknown(
        engine: EngineHandle) -> None:
    """An agent that stops answering leaves its last reading in the store; within
    ``staleness_s`` it still holds a full GPU's endpoint, past it the GPU is unknown (as
    without NVML) instead of holding it for good, or trusting an old low reading."""
    GiB = 1 << 30
    reader = FakeGpuReader([GpuReading(0, "GPU-aaaa", "H200", 139 * GiB, 141 * GiB)])
    agent = await start_agent(reader=reader)
    store = await one_engine_store(engine)
    now = [1000.0]
    scraper = Scraper(store, timeout_s=2.0, gpu_sources={"chat": agent.metrics_url},
                      clock=lambda: now[0])
    pool = parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "chat", "models": ["m"], "endpoints": [address(engine)],
                   "gpu_source": agent.metrics_url}],
    }).pools[0]
    scheduler = PoolScheduler(pool, {"x": 1.0}, staleness_s=2.0)

    async def placed_after(seconds: float) -> bool:
        now[0] += seconds
        snapshot = await scraper.scrape_once()
        return not isinstance(scheduler.place("x", 10, snapshot, now[0], random.Random(1)),
                              Reject)

    try:
        assert not await placed_after(0)  # 98.6% used: held
        await agent.stop()
        assert not await placed_after(1.5)  # the agent is gone; its reading is 1.5 s old
        assert await placed_after(1.0)  # 2.5 s old: unknown, the engine's own figures rule
        state = scraper.store.snapshot().get("chat", address(engine))
        assert state.gpus and state.current_gpu_memory_used_ratio(2.0) is None
    finally:
        await scraper.stop()
        await agent.stop()


async def test_an_nvml_memory_sentinel_is_no_watermark(engine: EngineHandle) -> None:
    """``gpu_source: local`` on a GPU whose memory NVML answers with its "not available"
    sentinel: the endpoint's GPU memory is unknown (placed on its own figures, as without
    NVML), where it read as 1.8e17 times full and was held for good."""
    nvml = StubNvml()
    nvml.devices[("gpu", 0)].update(used=NOT_AVAILABLE_BYTES, util=0xFFFFFFFF)
    store = await one_engine_store(engine)
    scraper = Scraper(store, timeout_s=2.0, gpu_reader=NvmlReader(nvml),
                      gpu_sources={"chat": GpuSource(gpus=frozenset({"0"}))})
    pool = parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "chat", "models": ["m"], "endpoints": [address(engine)],
                   "gpu_source": "local", "gpus": ["0"]}],
    }).pools[0]
    try:
        snapshot = await scraper.scrape_once()
    finally:
        await scraper.stop()
    state = snapshot.get("chat", address(engine))
    assert state.healthy and state.gpus == () and state.gpus_read_at is not None
    assert state.current_gpu_memory_used_ratio() is None
    placement = PoolScheduler(pool, {"x": 1.0}).place("x", 10, snapshot, state.scraped_at,
                                                      random.Random(1))
    assert not isinstance(placement, Reject)


async def test_a_hung_local_gpu_read_does_not_hold_the_round(engine: EngineHandle) -> None:
    reader = FakeGpuReader(gate=threading.Event())
    store = await one_engine_store(engine)
    # 1 s: long enough for the engine's own /metrics on a loaded machine (0.3 s was not)
    scraper = Scraper(store, timeout_s=1.0, gpu_sources={"chat": "local"}, gpu_reader=reader)
    try:
        started = time.monotonic()
        state = (await scraper.scrape_once()).get("chat", address(engine))
        assert time.monotonic() - started < 4.0  # the 1 s timeout, not the 5 s hang
        assert state.healthy and state.gpus == ()
        await scraper.scrape_once()
        assert reader.reads <= 1  # no second thread stuck behind the first
    finally:
        reader.gate.set()
        await scraper.stop()


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversized_gpu_page_is_refused_unread(engine: EngineHandle,
                                                       chunked: bool) -> None:
    """A broken or hostile agent's huge page is no reading: parsing it would hold the event
    loop every admission shares (and each placement would then read every GPU in it)."""
    line = 'kvgate_gpu_memory_{}_bytes{{gpu="{}",uuid="GPU-{}",name="x",mig_instance=""}} {}\n'
    page = "".join(line.format("used", i, i, 1) + line.format("total", i, i, 100)
                   for i in range(MAX_GPU_PAGE_BYTES // 100)).encode()
    assert len(page) > MAX_GPU_PAGE_BYTES

    async def huge(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=page)
        response = web.StreamResponse()  # no content-length: found as it arrives
        await response.prepare(request)
        for at in range(0, len(page), 32 * 1024):
            await response.write(page[at:at + 32 * 1024])
        return response

    app = web.Application()
    app.router.add_get("/metrics", huge)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    agent_url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    store = await one_engine_store(engine)
    scraper = Scraper(store, timeout_s=2.0, gpu_sources={"chat": agent_url})
    try:
        state = (await scraper.scrape_once()).get("chat", address(engine))
    finally:
        await scraper.stop()
        await runner.cleanup()
    assert state.healthy and state.gpus == () and state.gpus_read_at is None
    assert agent_url in scraper._failing_gpu_targets


async def test_an_oversized_engine_page_is_refused_unread() -> None:
    """A broken or hostile engine's huge metrics page is no reading: the endpoint is not
    read from it (parsed, it would hold the event loop every admission shares, every
    round), and the error names the size."""
    padding = "# padding\n" * (MAX_ENGINE_PAGE_BYTES // 10)
    async with MetricsServers(1, body=SAMPLE + padding) as [where]:
        store = EndpointStore()
        await store.set_endpoints("p", [where])
        scraper = Scraper(store)
        try:
            state = (await scraper.scrape_once()).get("p", where)
        finally:
            await scraper.stop()
    assert state.metrics is None and state.scraped_at is None
    assert state.last_error is not None and f"over {MAX_ENGINE_PAGE_BYTES}" in state.last_error


def test_gpu_source_specs() -> None:
    assert GpuSource.parse("local") == GpuSource()
    assert GpuSource.parse("http://10.0.0.9:9400").url == "http://10.0.0.9:9400/metrics"
    assert GpuSource.parse("http://{ip}:9400/gpu").target("10.1.2.3:8000") == (
        "http://10.1.2.3:9400/gpu")
    assert GpuSource.parse("http://{ip}:9400").target("[fd00::1]:8000") == (
        "http://[fd00::1]:9400/metrics")
    with pytest.raises(ValueError, match="neither"):
        GpuSource.parse("10.0.0.9:9400")


# -- the update hook and the loop's resilience ---------------------------------------------


async def test_on_update_gets_each_rounds_snapshot_sync_or_async(engine: EngineHandle) -> None:
    seen: list[int] = []
    async_seen: list[StoreSnapshot] = []

    async def on_update(snapshot: StoreSnapshot) -> None:
        await asyncio.sleep(0)
        async_seen.append(snapshot)

    store = await one_engine_store(engine)
    for hook in (lambda snapshot: seen.append(snapshot.version), on_update):
        scraper = Scraper(store, on_update=hook)
        try:
            returned = await scraper.scrape_once()
        finally:
            await scraper.stop()
    assert seen == [returned.version - 1] and async_seen == [returned]


async def test_the_loop_survives_a_failing_hook_and_a_failing_round(
        engine: EngineHandle, caplog: pytest.LogCaptureFixture) -> None:
    class FlakyScraper(Scraper):
        calls = 0

        async def scrape_once(self) -> StoreSnapshot:
            self.calls += 1
            if self.calls <= 2:
                raise RuntimeError("a bug in a round")
            return await super().scrape_once()

    def bad_hook(snapshot: StoreSnapshot) -> None:
        raise ValueError("a bug in the hook")

    store = await one_engine_store(engine)
    scraper = FlakyScraper(store, interval_s=0.01, on_update=bad_hook)
    with caplog.at_level(logging.ERROR, logger="extproc.datalayer"):
        scraper.start()
        try:
            await eventually(lambda: scraper.rounds >= 5)
        finally:
            await scraper.stop()
    assert store.snapshot().get("chat", address(engine)).healthy
    errors = [r.getMessage() for r in caplog.records]
    assert errors.count("scrape round failed; the loop goes on") == 1  # same error: once
    assert errors.count("on_update hook failed; scraping goes on") == 1


def test_settings_build_a_scraper() -> None:
    settings = ScrapeSettings(interval_s=0.2, timeout_s=0.3, max_concurrency=4,
                              unhealthy_after=5, metrics_path="/m")
    scraper = Scraper.from_settings(EndpointStore(), settings)
    assert (scraper.interval_s, scraper.timeout_s, scraper.max_concurrency,
            scraper.unhealthy_after, scraper.metrics_path) == (0.2, 0.3, 4, 5, "/m")
    with pytest.raises(ValueError):
        Scraper(EndpointStore(), max_concurrency=0)
