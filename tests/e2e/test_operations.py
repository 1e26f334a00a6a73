"""Running kvgate, through the real Envoy: metrics and their labels after traffic, request
ids, readiness at start and on drain, hot reload (a changed limit, a broken file, a removed
tenant) with requests in flight, SIGTERM with a stream in flight, and what log lines never
carry."""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import orjson
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.soak import redis_leases
from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from extproc.engine.server import EngineProcess
from extproc.envoy_proc import EnvoyProcess
from extproc.processes import KvgateProcess
from extproc.reload import ConfigFile
from tests.conftest import free_port

pytestmark = pytest.mark.e2e

KEYS = {"acme": "sk-ops-acme-0123456789", "tight": "sk-ops-tight-0123456789",
        "gone": "sk-ops-gone-0123456789"}
SECRET_PROMPT = "zebra-marmalade-prompt-text"  # a body's words: must never reach a log line


def config_data(engine: str, **extra: object) -> dict:
    data = {
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"big": {"limits": {"requests_per_second": 100, "max_concurrency": 5}},
                  "tight": {"limits": {"requests_per_second": 1, "request_burst": 1}}},
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 5}},
        "tenants": [{"name": name, "tier": "tight" if name == "tight" else "big",
                     "api_keys": [hash_api_key(key)]} for name, key in KEYS.items()],
        "pools": [{"name": "tiny", "models": [{"name": "tiny-llama", "default_max_tokens": 8}],
                   "endpoints": [engine]}],
    }
    data.update(extra)
    return data


def chat(max_tokens: int = 4, stream: bool = False, model: str = "tiny-llama") -> dict:
    return {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": SECRET_PROMPT}]}


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS.get(tenant, tenant)}"}


def post(url: str, tenant: str, body: object, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(url + "/v1/chat/completions", content=content, timeout=30,
                      headers={"content-type": "application/json", **auth(tenant), **headers})


def samples(admin: str, name: str) -> list[dict[str, str | float]]:
    """Every sample of ``name`` on kvgate's /metrics, its labels and ``value``."""
    text = httpx.get(admin + "/metrics", timeout=5).text
    return [{**s.labels, "value": s.value} for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def wait_until(predicate: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


class Stream:
    """A streamed request read in a thread: ``started`` once the first chunk is in."""

    def __init__(self, url: str, tenant: str, max_tokens: int):
        self.started = threading.Event()
        self.status = 0
        self.body = b""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, tenant, max_tokens),
                                        daemon=True)
        self._thread.start()
        assert self.started.wait(15), f"stream never started: {self.error!r}"

    def _run(self, url: str, tenant: str, max_tokens: int) -> None:
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", headers=auth(tenant),
                              json=chat(max_tokens, stream=True), timeout=60) as response:
                self.status = response.status_code
                for chunk in response.iter_raw():
                    self.body += chunk
                    self.started.set()
        except BaseException as exc:  # the outcome under test
            self.error = exc
        finally:
            self.started.set()

    def finish(self, timeout: float = 30) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "stream did not end"
        assert self.error is None, repr(self.error)
        assert self.status == 200
        assert self.body.rstrip().endswith(b"data: [DONE]"), self.body[-200:]


def grpc_health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


# -- metrics and request ids, on an in-process kvgate ----------------------------------------


@pytest.fixture(scope="module")
def stack() -> Iterator:
    cfg = parse_config(config_data(f"127.0.0.1:{free_port()}", server={
        "grpc_port": free_port(), "admin_port": 0}))
    with local_stack(cfg, engine_options={"ms_per_token": 2}) as running:
        yield running


def test_metrics_carry_bounded_labels_after_traffic(stack) -> None:
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
    url = stack.url
    assert post(url, "acme", chat(6)).status_code == 200
    assert post(url, "acme", chat(5, stream=True)).status_code == 200
    assert post(url, "sk-nobody", chat()).status_code == 401
    assert post(url, "acme", chat(model="no-such-model")).status_code == 404
    assert post(url, "acme", b"{not json").status_code == 400
    statuses = [post(url, "tight", chat()).status_code for _ in range(3)]
    assert 429 in statuses and 200 in statuses
    wait_until(lambda: stack.kvgate.call(
        stack.kvgate.server.director.store.in_flight("acme")) == 0)

    requests = {(s["tenant"], s["model"], s["class"], s["decision"], s["reason"]): s["value"]
                for s in samples(admin, "kvgate_requests_total")}
    assert requests[("acme", "tiny-llama", "interactive", "admitted", "none")] == 2
    assert requests[("_none", "_none", "_none", "invalid", "invalid_api_key")] == 1
    assert requests[("acme", "_other", "_none", "invalid", "model_not_found")] == 1
    assert requests[("acme", "_none", "_none", "invalid", "invalid_json")] == 1
    assert requests[("tight", "_none", "_none", "rejected", "requests")] >= 1
    # bounded: only configured names and the two fixed values, never a key, path or id
    for tenant, model, klass, _decision, _reason in requests:
        assert tenant in {*KEYS, "_none", "_other"}
        assert model in {"tiny-llama", "_none", "_other"}
        assert klass in {"interactive", "batch", "_none", "_other"}

    used = {(s["tenant"], s["kind"]): s["value"] for s in samples(admin, "kvgate_tokens_used_total")
            if s["model"] == "tiny-llama"}
    assert used[("acme", "completion")] == 6 + 5  # the engine's own usage, streamed or not
    charges = {s["basis"]: s["value"] for s in samples(admin, "kvgate_charges_total")}
    assert charges.get("usage", 0) >= 2 and set(charges) <= {"usage", "no_response"}
    assert used[("acme", "prompt")] > 0
    reserved = {s["tenant"]: s["value"] for s in samples(admin, "kvgate_tokens_reserved_total")}
    assert reserved["acme"] >= 6 + 5  # the prompt estimates plus both max_tokens
    assert {s["tenant"]: s["value"] for s in samples(admin, "kvgate_in_flight_requests")
            }["acme"] == 0

    (engine,) = stack.engines
    endpoint = {"pool": "tiny", "endpoint": engine}
    for name in ("kvgate_endpoint_kv_cache_usage", "kvgate_endpoint_requests_waiting",
                 "kvgate_endpoint_requests_running", "kvgate_endpoint_scrape_age_seconds",
                 "kvgate_endpoint_healthy", "kvgate_endpoint_scrape_errors_total"):
        (sample,) = samples(admin, name)
        assert {k: sample[k] for k in endpoint} == endpoint, name
    assert samples(admin, "kvgate_endpoint_scrape_age_seconds")[0]["value"] < 2
    assert samples(admin, "kvgate_endpoint_healthy")[0]["value"] == 1
    assert samples(admin, "kvgate_admission_seconds_count")[0]["value"] >= 3
    assert samples(admin, "kvgate_ready")[0]["value"] == 1
    assert samples(admin, "kvgate_store_breaker_open")[0]["value"] == 0


def acme_tokens(admin: str) -> dict[str, float]:
    """acme's reserved, prompt and completion tokens on tiny-llama, and its charges (all
    bases), from kvgate's /metrics."""
    found = {"reserved": 0.0, "prompt": 0.0, "completion": 0.0}
    for s in samples(admin, "kvgate_tokens_reserved_total"):
        if (s["tenant"], s["model"]) == ("acme", "tiny-llama"):
            found["reserved"] += float(s["value"])
    for s in samples(admin, "kvgate_tokens_used_total"):
        if (s["tenant"], s["model"]) == ("acme", "tiny-llama"):
            found[str(s["kind"])] += float(s["value"])
    for s in samples(admin, "kvgate_charges_total"):
        found[f"charged_{s['basis']}"] = found.get(f"charged_{s['basis']}", 0.0) + s["value"]
    return found


def settled(stack, admin: str, before: dict[str, float], body: dict,
            **headers: str) -> tuple[httpx.Response, dict[str, float]]:
    """Send ``body`` as acme; once kvgate has settled it, the response and what changed in
    acme's token counters."""
    response = post(stack.url, "acme", body, **headers)
    assert response.status_code == 200, response.text
    charges = sum(v for k, v in before.items() if k.startswith("charged_"))
    wait_until(lambda: sum(v for k, v in acme_tokens(admin).items()
                           if k.startswith("charged_")) > charges)
    after = acme_tokens(admin)
    return response, {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.mark.parametrize("mode", ["json", "stream", "stream_usage"])
def test_n_answers_are_reserved_and_charged_as_the_engine_counts_them(stack, mode) -> None:
    """``n: 2``: kvgate reserves the output of both answers (one more ``max_tokens`` than
    the same request with ``n: 1``), the engine answers two choices, and what kvgate
    charges is the engine's own usage, both answers' tokens, streamed or not (the engine
    refused n > 1, so none of this had an end-to-end test)."""
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
    (engine,) = stack.engines.values()
    stream = mode != "json"
    body = chat(4, stream=stream)
    if mode == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    _, one = settled(stack, admin, acme_tokens(admin), body)
    engine.clear_requests()
    response, two = settled(stack, admin, acme_tokens(admin), {**body, "n": 2})
    sent = engine.requests()[-1]["body"]
    assert (sent["n"], sent["max_tokens"]) == (2, 4)  # each answer's cap, as asked
    assert two["reserved"] - one["reserved"] == 4  # the second answer's output

    if not stream:
        answer = response.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        usage = answer["usage"]
    else:
        events = [orjson.loads(e.removeprefix("data: ")) for e in response.text.split("\n\n")
                  if e.startswith("data: ") and e != "data: [DONE]"]
        assert response.text.rstrip().endswith("data: [DONE]")
        texts = {0: "", 1: ""}
        for event in events:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["delta"].get("content", "")
        assert texts == {0: "the quick brown fox ", 1: "the quick brown fox "}
        if mode == "stream_usage":
            assert events[-1]["choices"] == []
            usage = events[-1]["usage"]
        else:  # kvgate's usage event, stripped: the engine counted the prompt's one word
            assert all(e["choices"] and "usage" not in e for e in events)
            usage = {"prompt_tokens": 1, "completion_tokens": 8}
    assert usage["completion_tokens"] == 2 * 4
    assert two["completion"] == usage["completion_tokens"]
    assert two["prompt"] == usage["prompt_tokens"] == one["prompt"]
    assert two.get("charged_usage") == 1 and one.get("charged_usage") == 1


def test_request_ids_tie_log_lines_to_the_engine_and_the_client(stack, caplog) -> None:
    """Envoy sets x-request-id (it replaces a client's at the edge); kvgate's log lines about
    a request carry it, the engine gets it, the client sees it (admitted or refused: only
    refusals carried it)."""
    (engine,) = stack.engines.values()
    engine.clear_requests()
    with caplog.at_level(logging.DEBUG, logger="extproc.stream"):
        admitted = post(stack.url, "acme", chat())
        assert admitted.status_code == 200
        refused = post(stack.url, "sk-nobody", chat())
        wait_until(lambda: len([r for r in caplog.records if hasattr(r, "request_id")]) >= 2)
    upstream = engine.requests()[-1]["headers"]["x-request-id"]
    assert admitted.headers.get_list("x-request-id") == [upstream]
    assert refused.status_code == 401 and refused.headers["x-request-id"] != upstream
    assert len(refused.headers.get_list("x-request-id")) == 1
    logged = {r.request_id: r for r in caplog.records if hasattr(r, "request_id")}
    assert logged[upstream].tenant == "acme"
    assert "invalid" in logged[refused.headers["x-request-id"]].getMessage()


# -- readiness, drain and shutdown, on `kvgate serve` processes ------------------------------


@pytest.mark.redis
def test_sigterm_lets_a_stream_finish_and_leaves_nothing_held(
        tmp_path: Path, redis_server) -> None:
    port = free_port()
    cfg = parse_config(config_data(
        f"127.0.0.1:{port}", redis={"url": redis_server.url},
        server={"grpc_port": free_port(), "admin_port": free_port(), "shutdown_grace_s": 30,
                "drain_delay_s": 2}))
    admin = f"http://127.0.0.1:{cfg.server.admin_port}"
    with KvgateProcess(cfg, tmp_path) as kvgate:
        # readiness at start: alive, but not ready until the pool's engine has been scraped
        assert httpx.get(admin + "/healthz").status_code == 200
        waiting = httpx.get(admin + "/readyz")
        assert waiting.status_code == 503
        assert waiting.json()["waiting_for"] == ["pool tiny: no endpoint scraped yet"]
        with EngineProcess(port=port, ms_per_token=25) as _engine, EnvoyProcess(cfg) as envoy:
            wait_until(lambda: httpx.get(admin + "/readyz").status_code == 200)
            assert grpc_health(kvgate.target) == health_pb2.HealthCheckResponse.SERVING
            assert grpc_health(kvgate.target, "envoy.service.ext_proc.v3.ExternalProcessor") \
                == health_pb2.HealthCheckResponse.SERVING

            stream = Stream(envoy.url, "acme", max_tokens=120)  # ~3 s of tokens
            assert redis_leases(redis_server.url) == 1
            assert kvgate.process is not None
            kvgate.process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(admin + "/readyz").status_code == 503, 5)
            assert "draining (shutting down)" in httpx.get(admin + "/readyz").json()[
                "waiting_for"]
            assert grpc_health(kvgate.target) == health_pb2.HealthCheckResponse.NOT_SERVING
            # a reload asked while draining is ignored: SIGHUP's default action (exit)
            # cut every open stream and left its lease in Redis
            kvgate.process.send_signal(signal.SIGHUP)
            # after the drain delay no new streams: Envoy fails closed
            wait_until(lambda: post(envoy.url, "acme", chat()).status_code == 503, 10)
            stream.finish()
            assert kvgate.process.wait(20) == 0  # exits once the stream ended, before the grace
    assert redis_leases(redis_server.url) == 0
    log = kvgate.log(tail=None)
    assert re.search(r"draining: not ready, no new streams; [12] open stream\(s\) get up to "
                     r"30 s", log)
    assert "stopped: 0 stream(s) cut at the grace, 0 lease(s) left held" in log
    assert "SIGHUP ignored: shutting down" in log


# -- hot reload ------------------------------------------------------------------------------


def reloads(admin: str, result: str) -> float:
    return sum(float(s["value"]) for s in samples(admin, "kvgate_config_reloads_total")
               if s["result"] == result)


def test_reload_applies_a_changed_limit_without_dropping_requests(tmp_path: Path) -> None:
    with EngineProcess(ms_per_token=25) as engine:
        data = config_data(f"127.0.0.1:{engine.port}")
        data["server"]["reload_poll_s"] = 0.2
        cfg = parse_config(data)
        admin = f"http://127.0.0.1:{cfg.server.admin_port}"
        options = ("--log-level", "debug", "--log-format", "json")
        with KvgateProcess(cfg, tmp_path, options=options) as kvgate, \
                EnvoyProcess(cfg) as envoy:
            wait_until(lambda: httpx.get(admin + "/readyz").status_code == 200)
            in_flight = Stream(envoy.url, "acme", max_tokens=160)  # ~4 s
            gone = Stream(envoy.url, "gone", max_tokens=160)
            assert post(envoy.url, "acme", chat()).status_code == 200  # 2 of 5 held

            # a broken file (the poll finds it): rejected, named in the log, the running
            # config stays
            kvgate.path.write_text("tiers: {big: {limits: {max_concurrency: -1}}}\n")
            wait_until(lambda: reloads(admin, "rejected") >= 1)
            assert "config reload (file changed) rejected, the running config stays" in (
                kvgate.log())
            assert "tiers.big.limits.max_concurrency" in kvgate.log()
            assert post(envoy.url, "acme", chat()).status_code == 200

            # SIGHUP: acme's concurrency 5 → 1, the tenant "gone" removed, and a change that
            # waits for a restart
            data["tiers"]["big"]["limits"]["max_concurrency"] = 1
            data["tenants"] = [t for t in data["tenants"] if t["name"] != "gone"]
            data["scrape"] = {"interval_s": 0.2}
            kvgate.write_config(parse_config(data))
            assert kvgate.process is not None
            kvgate.process.send_signal(signal.SIGHUP)
            wait_until(lambda: "config reloaded (SIGHUP)" in kvgate.log(tail=None))
            assert reloads(admin, "applied") >= 1
            over = post(envoy.url, "acme", chat())
            assert over.status_code == 429, over.text  # the stream in flight holds the 1
            assert over.headers["x-kvgate-reject"] == "concurrency"
            assert post(envoy.url, "gone", chat()).status_code == 401
            in_flight.finish()  # neither stream was dropped
            gone.finish()
            wait_until(lambda: post(envoy.url, "acme", chat()).status_code == 200)
            log = kvgate.log(tail=None)
    assert "removed ['gone'], changed ['acme']" in log
    assert "scrape changed in" in log and "take effect only after a restart" in log
    assert_log_lines_are_clean(log)


def assert_log_lines_are_clean(log: str) -> None:
    """JSON lines with request ids; never an API key, a key's hash, or a body's words."""
    lines = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert len(lines) >= 10
    ids = [line["request_id"] for line in lines if "request_id" in line]
    assert len(ids) >= 5 and all(len(i) >= 16 for i in ids)
    for secret in (*KEYS.values(), SECRET_PROMPT):
        assert secret not in log
        assert hash_api_key(secret).removeprefix("sha256:") not in log


def test_queued_requests_ride_through_a_reload(tmp_path: Path) -> None:
    """Requests waiting in the fair queue when a reload lowers their tenant's concurrency
    are dispatched and served; the lowered limit applies to new requests only."""
    # 8 blocks × 16 tokens of KV: one ~100-token request's committed KV leaves no room for
    # another's, nor (at the 0.45 watermark) the cache now for another's whole reservation
    data = config_data(f"127.0.0.1:{free_port()}", server={
        "grpc_port": free_port(), "admin_port": 0}, scrape={"interval_s": 0.05})
    data["pools"][0]["watermarks"] = {"high": 0.45, "critical": 0.45}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data))
    engine = {"ms_per_token": 8, "kv_blocks": 8, "block_size": 16}
    with local_stack(parse_config(data), engine_options=engine) as running:
        server = running.kvgate.server
        server.config_file = ConfigFile(path)
        streams = [Stream(running.url, "acme", max_tokens=100)]
        waiting = [threading.Thread(target=lambda: statuses.append(
            post(running.url, "acme", chat(100)).status_code)) for _ in range(2)]
        statuses: list[int] = []
        for thread in waiting:
            thread.start()
        queues = f"http://127.0.0.1:{server.admin_port}/debug/queues"
        wait_until(lambda: httpx.get(queues).json()["pools"][0]["queued"] == 2)

        data["tiers"]["big"]["limits"]["max_concurrency"] = 1
        path.write_text(yaml.safe_dump(data))

        async def reload() -> bool:
            return server.reload("test")

        assert running.kvgate.call(reload())
        assert httpx.get(queues).json()["pools"][0]["queued"] == 2  # nobody dropped
        over = post(running.url, "acme", chat())
        assert over.status_code == 429 and over.headers["x-kvgate-reject"] == "concurrency"
        for stream in streams:
            stream.finish()
        for thread in waiting:
            thread.join(30)
        assert statuses == [200, 200]



def test_kvgate_listening_on_ipv6_any_serves_and_hears_the_meter() -> None:
    """``server.host: "::"`` (an IPv6 cluster's pods): gRPC was handed ``:::9001``, a
    misformatted name, and `kvgate serve` died in a traceback; and the meter was told to
    report to 127.0.0.1, where the report port on ``::`` (IPv6 alone) refused it, so no
    response was ever charged the engine's usage."""
    cfg = parse_config(config_data(f"127.0.0.1:{free_port()}", server={
        "host": "::", "grpc_port": free_port(), "admin_port": free_port()}))
    with local_stack(cfg) as running:
        admin = f"http://127.0.0.1:{running.kvgate.server.admin_port}"
        assert running.kvgate.server.desk.address.startswith("[::1]:")
        assert post(running.url, "acme", chat(4)).status_code == 200
        assert post(running.url, "acme", chat(4, stream=True)).status_code == 200
        assert wait_until_charged(admin, 2)
        reports = {s["kind"]: s["value"] for s in samples(admin, "kvgate_meter_reports_total")}
        assert reports.get("done") == 2 and not reports.get("refused"), reports


def wait_until_charged(admin: str, n: int) -> bool:
    """Whether ``n`` requests were charged the engine's own usage within 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        charges = {s["basis"]: s["value"] for s in samples(admin, "kvgate_charges_total")}
        if charges.get("usage", 0) >= n:
            return True
        time.sleep(0.1)
    return False
