"""Faults with real processes: kvgate killed under load, an engine killed mid-stream, a
scrape target that hangs or answers garbage. What the client sees, and that nothing admitted
stays held."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from aiohttp import web

from extproc.config import Config, hash_api_key, parse_config
from extproc.demo import ServerThread, local_stack
from extproc.engine.server import EngineProcess
from extproc.envoy_config import EXT_PROC_FAILURE_MESSAGE
from extproc.envoy_proc import EnvoyProcess
from extproc.processes import KvgateProcess
from limiter import Reject
from tests.conftest import free_port
from tests.paths import DATA

pytestmark = pytest.mark.e2e

KEY = "sk-faults"
HEADERS = {"authorization": f"Bearer {KEY}"}
SAMPLE = (DATA / "vllm-sample-metrics.txt").read_text()


def config(endpoint: str, **extra: object) -> Config:
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "one", "models": [{"name": "tiny-llama"}], "endpoints": [endpoint]}],
        **extra,
    })


def chat(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": "tiny-llama", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]}


def wait_until(predicate: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def in_background(work: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``work`` in a thread; its result (or exception) lands in the list."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(work())
        except Exception as exc:  # the outcome under test, not a test failure
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# -- kvgate killed ---------------------------------------------------------------------------


def test_a_killed_kvgate_means_json_503s_and_a_restarted_one_serves_at_once(
        tmp_path: Path) -> None:
    with EngineProcess(ms_per_token=20) as engine:
        cfg = config(f"127.0.0.1:{engine.port}")
        with KvgateProcess(cfg, tmp_path) as kvgate, EnvoyProcess(cfg) as envoy:
            url = envoy.url + "/v1/chat/completions"
            assert httpx.post(url, json=chat(), headers=HEADERS, timeout=10).status_code == 200
            # under load: streams in flight (100 tokens × 20 ms) when kvgate dies
            load = [in_background(lambda: httpx.post(
                url, json=chat(100, stream=True), headers=HEADERS, timeout=20))
                for _ in range(4)]
            wait_until(lambda: len(engine.requests()) >= 5)
            kvgate.kill()
            for thread, _outcome in load:
                thread.join(15)
                assert not thread.is_alive()  # every client got an answer or an error
            refused = httpx.post(url, json=chat(), headers=HEADERS, timeout=10)
            assert refused.status_code == 503
            assert refused.headers["content-type"] == "application/json"
            assert refused.json()["error"]["message"] == EXT_PROC_FAILURE_MESSAGE

            kvgate.start()  # same port, same config
            served = httpx.post(url, json=chat(), headers=HEADERS, timeout=10)
            assert served.status_code == 200, served.text


@pytest.mark.redis
@pytest.mark.parametrize("held", ["queued", "shaped"])
def test_a_killed_kvgate_gives_back_the_quota_of_requests_it_never_sent(
        tmp_path: Path, redis_server, held: str) -> None:
    """kvgate SIGKILLed with requests it admitted (their reservations charged to the daily
    quota in Redis) but never sent upstream: waiting in its queue (the engine's small cache
    runs one at a time), or held for their shaper's departure slot (one a second). Once
    their leases expire, only the requests that were running stay charged (their
    reservations: nobody knows how far their answers got), one of the shaped ones sent
    after a hold among them; those never sent are charged nothing."""
    redis_server.flushall()
    small_cache = {"kv_blocks": 8, "block_size": 16} if held == "queued" else {}
    with EngineProcess(ms_per_token=30, **small_cache) as engine:
        endpoint = f"127.0.0.1:{engine.port}"
        limits: dict[str, object] = {"daily_token_quota": 10**6}
        pool: dict[str, object] = {"name": "one", "models": [{"name": "tiny-llama"}],
                                   "endpoints": [endpoint]}
        if held == "queued":
            pool["watermarks"] = {"high": 0.45, "critical": 0.45}
            running = 1
        else:
            limits["shaping"] = {"requests_per_second": 1, "backlog": 5}
            running = 2
        cfg = config(endpoint, scrape={"interval_s": 0.05},
                     redis={"url": redis_server.url, "lease_ttl_s": 1},
                     tiers={"t": {"limits": limits}}, pools=[pool])
        admin = f"http://127.0.0.1:{cfg.server.admin_port}"

        def used() -> int:
            usage = httpx.get(admin + "/admin/tenants/acme/usage", timeout=5).json()
            return usage["quotas"]["daily"]["used"]

        def waiting() -> int:
            return httpx.get(admin + "/debug/queues").json()["pools"][0]["queued"]

        with KvgateProcess(cfg, tmp_path) as kvgate, EnvoyProcess(cfg) as envoy:
            url = envoy.url + "/v1/chat/completions"
            load = []
            for _ in range(4):
                load.append(in_background(lambda: httpx.post(
                    url, json=chat(100, stream=True), headers=HEADERS, timeout=30)))
                time.sleep(0.05)  # in this order
            wait_until(lambda: len(engine.requests()) == running
                       and (held == "shaped" or waiting() == 3))
            reserved = used()
            assert reserved % 4 == 0  # four alike
            kvgate.kill()
            for thread, _outcome in load:
                thread.join(15)
            time.sleep(1.5)  # past the lease TTL
            kvgate.start()
            assert len(engine.requests()) == running
            assert used() == reserved // 4 * running


# -- engine killed ---------------------------------------------------------------------------


@pytest.fixture
def stack() -> Iterator:
    cfg = config(f"127.0.0.1:{free_port()}", scrape={"interval_s": 0.05})
    with local_stack(cfg, engine_options={"ms_per_token": 20}) as running:
        yield running


def test_an_engine_killed_mid_stream_ends_the_stream_and_releases_everything(stack) -> None:
    (engine,) = stack.engines.values()
    director = stack.kvgate.server.director
    chunks: list[bytes] = []

    def stream() -> None:
        with httpx.stream("POST", stack.url + "/v1/chat/completions", headers=HEADERS,
                          json=chat(200, stream=True), timeout=10) as response:
            assert response.status_code == 200
            for chunk in response.iter_raw():
                chunks.append(chunk)

    thread, outcome = in_background(stream)
    wait_until(lambda: len(chunks) >= 3)
    assert director.active
    engine.proc.kill()  # SIGKILL mid-stream: no [DONE], no usage
    thread.join(10)
    assert not thread.is_alive()  # an error (or a cut-off stream), never a hang
    assert b"[DONE]" not in b"".join(chunks)
    wait_until(lambda: not director.active and not director.schedulers["one"].reservations)
    assert stack.kvgate.call(director.store.in_flight("acme")) == 0
    usage = httpx.get(f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
                      "/admin/tenants/acme/usage").json()
    assert usage["in_flight"] == 0, usage
    [result] = outcome  # a transport error, or a body cut off before [DONE]
    assert result is None or isinstance(result, httpx.HTTPError), result


# -- Envoy killed ----------------------------------------------------------------------------


def test_a_killed_envoy_leaves_nothing_held_and_a_restarted_one_serves(tmp_path: Path) -> None:
    """Envoy SIGKILLed with streams running and requests waiting in kvgate's queue: every
    ext_proc stream breaks, so every lease, reservation and queue entry goes, and kvgate
    serves the next Envoy at once. (The engine's small cache runs one request at a time.)"""
    cfg = config(f"127.0.0.1:{free_port()}", scrape={"interval_s": 0.05},
                 pools=[{"name": "one", "models": [{"name": "tiny-llama"}],
                         "endpoints": [f"127.0.0.1:{free_port()}"],
                         "watermarks": {"high": 0.45, "critical": 0.45}}])
    engine = {"ms_per_token": 20, "kv_blocks": 8, "block_size": 16}
    with local_stack(cfg, engine_options=engine) as stack:
        director = stack.kvgate.server.director
        url = stack.url + "/v1/chat/completions"
        load = [in_background(lambda: httpx.post(url, json=chat(100, stream=True),
                                                 headers=HEADERS, timeout=30))
                for _ in range(4)]
        wait_until(lambda: director.active and queued(stack) >= 2)
        stack.envoy.process.kill()
        for thread, _outcome in load:
            thread.join(15)
            assert not thread.is_alive()  # every client got an error, never a hang
        wait_until(lambda: not director.active and not director.schedulers["one"].reservations
                   and queued(stack) == 0)
        assert stack.kvgate.call(director.store.in_flight("acme")) == 0
        stack.envoy.stop()
        stack.envoy.start()
        served = httpx.post(url, json=chat(), headers=HEADERS, timeout=10)
        assert served.status_code == 200, served.text
        wait_until(lambda: stack.kvgate.call(director.store.in_flight("acme")) == 0)


def queued(stack) -> int:
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
    return httpx.get(admin + "/debug/queues").json()["pools"][0]["queued"]


# -- kvgate too slow: Envoy gives up as kvgate admits ----------------------------------------


def test_a_request_admitted_as_envoys_message_timeout_fires_is_charged_nothing() -> None:
    """kvgate's event loop is busy deciding a request past Envoy's message timeout: Envoy
    answers the client 504 and resets the ext_proc stream, and the admission kvgate then
    completes has its routing reply refused by gRPC. The request never reached the engine,
    so the tenant's tokens and quota come back in full; the engine never saw it."""
    cfg = config(f"127.0.0.1:{free_port()}", scrape={"interval_s": 0.05},
                 tiers={"t": {"limits": {"tokens_per_minute": 60, "token_burst": 10_000,
                                         "daily_token_quota": 100_000}}},
                 classes={name: {"priority": i, "deadline_s": 0.5} for i, name
                          in enumerate(("interactive", "batch", "offline"))})
    cfg = cfg.model_copy(update={"envoy": cfg.envoy.model_copy(
        update={"message_timeout_s": 1.5})})
    with local_stack(cfg) as stack:
        (engine,) = stack.engines.values()
        director = stack.kvgate.server.director
        url = stack.url + "/v1/chat/completions"
        assert httpx.post(url, json=chat(), headers=HEADERS, timeout=10).status_code == 200
        wait_until(lambda: not director.active)
        before = stack.kvgate.call(director.usage("acme"))
        engine.clear_requests()
        gave_up = threading.Event()
        admit = director.admit

        async def admit_as_envoy_gives_up(*args, **kwargs):  # type: ignore[no-untyped-def]
            decision = await admit(*args, **kwargs)
            assert gave_up.wait(10)  # kvgate's loop is busy until Envoy has given up
            time.sleep(0.2)  # ... and gRPC has taken in Envoy's reset
            return decision

        director.admit = admit_as_envoy_gives_up
        try:
            answer = httpx.post(url, json=chat(100), headers=HEADERS, timeout=10)
        finally:
            gave_up.set()
        assert answer.status_code == 504, answer.text  # Envoy's message timeout
        wait_until(lambda: not director.active and not director.schedulers["one"].reservations)
        after = stack.kvgate.call(director.usage("acme"))
        assert after["quotas"]["daily"]["used"] == before["quotas"]["daily"]["used"]
        assert after["tokens"]["available"] >= before["tokens"]["available"]
        assert after["in_flight"] == 0
        assert stack.kvgate.server.metrics.charges.values[("not_sent",)] == 1
        assert engine.requests() == []


# -- the Lua meter cannot report -----------------------------------------------------------


def test_streams_are_charged_their_reservation_once_the_meter_is_seen_not_to_report(
        monkeypatch) -> None:
    """``server.report_host`` names an address where nothing listens: Envoy's Lua meter
    reports nothing, so kvgate sees no first token of any stream. While it cannot tell that
    from clients that left before their first token, a streamed answer is charged its prompt
    (``not_started``); from the ``SILENT_AFTER``-th response in a row with no report on, each
    is charged its reservation, as the README promises: before, every streamed answer was
    charged its prompt only, its output free, for as long as the meter could not report."""
    from extproc import reports

    monkeypatch.setattr(reports, "SILENT_AFTER", 3)
    cfg = config(f"127.0.0.1:{free_port()}", scrape={"interval_s": 0.05},
                 tiers={"t": {"limits": {"max_concurrency": 1}}})
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(
        update={"report_host": "127.0.0.3"})})  # loopback, but kvgate listens on 127.0.0.1
    with local_stack(cfg, engine_options={"ms_per_token": 1}) as stack:
        director = stack.kvgate.server.director
        charges = stack.kvgate.server.metrics.charges.values
        for _ in range(5):
            answer = httpx.post(stack.url + "/v1/chat/completions", json=chat(8, stream=True),
                                headers=HEADERS, timeout=10)
            assert answer.status_code == 200 and b"[DONE]" in answer.content
            wait_until(lambda: not director.active)
        assert charges == {("not_started",): 2, ("cut_off",): 3}
        # nor is a silent meter's report waited for (REPORT_WAIT_S, 0.5 s): the tenant's
        # one slot is free as soon as Envoy has ended the answer's stream
        for _ in range(3):
            answer = httpx.post(stack.url + "/v1/chat/completions", json=chat(8, stream=True),
                                headers=HEADERS, timeout=10)
            assert answer.status_code == 200, answer.text
            wait_until(lambda: not director.active, timeout=0.3)


# -- discovery that finds no endpoint -------------------------------------------------------


@pytest.mark.parametrize("shaped", [False, True])
def test_a_pool_discovery_left_empty_refuses_health_checks_as_inference(shaped: bool) -> None:
    """The first pool's DNS name resolves to nothing: ``GET /health`` (sent to any endpoint
    of it) gets the 503 an inference request gets, with its retry-after; an empty placement
    failed admission (``internal_error``, an exception logged per request). A shaped tenant
    routes after its slot, the same way."""
    limits = {"limits": {"shaping": {"requests_per_second": 100, "backlog": 10}}} if shaped \
        else {}
    cfg = config(f"127.0.0.1:{free_port()}",
                 tiers={"t": limits},
                 pools=[{"name": "one", "models": [{"name": "tiny-llama"}],
                         "dns": {"hostname": "no-such-engine.invalid", "port": free_port()}}])
    with local_stack(cfg) as stack:
        for path in ("/health", "/v1/chat/completions"):
            answer = httpx.request("GET" if path == "/health" else "POST", stack.url + path,
                                   json=None if path == "/health" else chat(),
                                   headers=HEADERS, timeout=10)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"]["code"] == "no_ready_endpoint", (path, answer.text)
            assert answer.headers["retry-after"] == "1"
        director = stack.kvgate.server.director
        assert not director.active
        assert stack.kvgate.call(director.store.in_flight("acme")) == 0


# -- a scrape target that hangs or answers garbage -------------------------------------------


class FlakyMetrics:
    """A real HTTP ``/metrics`` on its own thread: good vLLM metrics, until told to hang
    or to answer garbage. Counts the scrapes in flight, to show they do not pile up."""

    def __init__(self) -> None:
        self.mode = "good"
        self.in_flight = self.max_in_flight = self.requests = 0
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if self.mode == "garbage":
                return web.Response(body=b"\x00\xff<html>not metrics", status=200)
            return web.Response(text=SAMPLE)
        finally:
            self.in_flight -= 1

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        # a scraper that gives up closes its connection: that ends the handler too, so
        # in_flight counts the scrapes still waiting on this target
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1,
                                    handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self._ready.set()
        self.loop.run_forever()

    def __enter__(self) -> FlakyMetrics:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.mark.parametrize("fault", ["hang", "garbage"])
def test_a_hung_or_garbled_scrape_target_goes_stale_without_piling_up(fault: str) -> None:
    with FlakyMetrics() as target:
        cfg = config(f"127.0.0.1:{target.port}",
                     scrape={"interval_s": 0.05, "timeout_s": 0.2, "staleness_s": 1.0})
        kvgate = ServerThread(cfg).start()
        try:
            server = kvgate.server
            where = f"127.0.0.1:{target.port}"
            state = lambda: server.endpoints.snapshot().get("one", where)  # noqa: E731
            assert state().is_usable(time.monotonic(), 1.0)
            target.mode = fault
            rounds = server.scraper.rounds
            wait_until(lambda: not state().is_usable(time.monotonic(), 1.0))  # stale: unused
            assert state().healthy  # reachable, so not "down": its numbers aged out
            assert server.scraper.rounds > rounds + 2  # each round bounded by the timeout
            assert target.max_in_flight <= 1  # one scrape at a time, however long they hang
            admit = lambda: server.director.admit(  # noqa: E731
                server.director.authenticate(f"Bearer {KEY}"), _parsed(chat()), None)

            async def waits() -> bool:
                try:
                    await asyncio.wait_for(admit(), 0.5)
                except TimeoutError:
                    return True
                return False

            # reachable but late: the request waits for a fresh scrape instead of a 503
            assert kvgate.call(waits())
            assert server.scraper.running  # nothing crashed
            target.mode = "good"
            wait_until(lambda: state().is_usable(time.monotonic(), 1.0))
            decision = kvgate.call(admit())
            assert not isinstance(decision, Reject), decision
            kvgate.call(server.director.release(decision, 0))
            assert kvgate.call(server.director.store.in_flight("acme")) == 0
        finally:
            kvgate.stop()


def _parsed(body: dict):  # type: ignore[no-untyped-def]
    from extproc.openai import parse_body

    return parse_body("/v1/chat/completions", orjson.dumps(body))
