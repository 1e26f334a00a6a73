"""Envoy's ``ratelimit`` filter pointed at kvgate's Rate Limit Service, through the real
Envoy, with the bootstrap ``kvgate render-envoy`` writes for ``envoy.ratelimit_domain``:
over-limit requests get 429 with Retry-After and x-ratelimit-* headers, and a tokens-per-
minute descriptor is charged each streamed response's real usage (the Lua meter's
``kvgate.usage`` metadata, ``apply_on_stream_done``) and refuses the next request once spent.
Once with the in-memory counters, once with a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import time
from typing import Any

import grpc
import httpx
import orjson
import pytest
import yaml
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from extproc.config import RateLimitSettings, hash_api_key, parse_config, parse_endpoint
from extproc.demo import ServerThread, local_stack
from extproc.engine.server import EngineProcess
from extproc.envoy_config import render_bootstrap
from extproc.envoy_proc import EnvoyProcess
from extproc.rls_import import import_files
from tests.conftest import free_port, store_section, wait_for
from tests.rls_support import descriptor

pytestmark = pytest.mark.e2e

DOMAIN = "kvgate"
KEYS = {"reqs": "sk-rls-reqs", "toks": "sk-rls-toks", "cut": "sk-rls-cut"}
TOKENS_PER_MINUTE = 60
PROMPT = "hello there gateway"  # the simulated engine counts 3 prompt tokens


def rls_config(store: dict[str, Any]):
    rules = [
        {"key": "kind", "value": "requests", "descriptors": [
            {"key": "tenant", "value": "reqs",
             "rate_limit": {"unit": "minute", "requests_per_unit": 2}}]},
        {"key": "kind", "value": "tokens", "descriptors": [
            {"key": "tenant", "rate_limit": {"unit": "minute", "debt": True,
                                             "requests_per_unit": TOKENS_PER_MINUTE}}]},
    ]
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port(),
                  "ratelimit_domain": DOMAIN},
        **store,
        "ratelimit": {"domains": [{"domain": DOMAIN, "descriptors": rules}]},
        "tiers": {"big": {"limits": {"requests_per_second": 100}}},
        "tenants": [{"name": name, "tier": "big", "api_keys": [hash_api_key(key)]}
                    for name, key in KEYS.items()],
        "pools": [{"name": "p", "models": [{"name": "tiny"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request):
    config = rls_config(store_section(request, timeout_ms=500))
    with local_stack(config, engine_options={"ms_per_token": 2}) as running:
        yield running


def chat(stack, tenant: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(f"{stack.url}/v1/chat/completions", content=orjson.dumps(body),
                      headers={"authorization": f"Bearer {KEYS[tenant]}",
                               "content-type": "application/json"}, timeout=30)


def tokens_left(stack, tenant: str) -> int:
    """Ask kvgate's RLS directly (0 hits: a check, charges nothing)."""
    check = descriptor(("kind", "tokens"), ("tenant", tenant), hits=0)

    async def ask() -> rls_pb2.RateLimitResponse:
        port = stack.kvgate.server.grpc_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            return await stub.ShouldRateLimit(
                rls_pb2.RateLimitRequest(domain=DOMAIN, descriptors=[check]))

    return asyncio.run(ask()).statuses[0].limit_remaining


def test_over_limit_gets_429_with_retry_after_and_x_ratelimit_headers(stack):
    first = chat(stack, "reqs", 4)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit"] == "2"  # the tightest limit, on a 200 too
    assert first.headers["x-ratelimit-remaining"] == "1"
    assert chat(stack, "reqs", 4).status_code == 200
    refused = chat(stack, "reqs", 4)
    assert refused.status_code == 429, refused.text
    assert refused.headers["x-envoy-ratelimited"] == "true"
    assert refused.headers["x-ratelimit-limit"] == "2"
    assert refused.headers["x-ratelimit-remaining"] == "0"
    assert 59 <= int(refused.headers["x-ratelimit-reset"]) <= 60  # both requests refilled
    # a token bucket of 2/min refills one request every 30 s
    assert 29_000 <= int(refused.headers["retry-after-ms"]) <= 30_000
    assert refused.headers["retry-after"] == "30"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "x-should-retry" not in refused.headers
    # a second client refused just after is told the slot after the first's (limiter.herd):
    # one refill later, less the time between the two refusals; told the same, both came
    # back together and one was refused again
    second = chat(stack, "reqs", 4)
    assert second.status_code == 429, second.text
    gap = int(second.headers["retry-after-ms"]) - int(refused.headers["retry-after-ms"])
    assert 29_000 <= gap <= 30_000, second.headers
    assert second.headers["retry-after"] == "60"
    # kvgate had admitted it before the filter refused: its lease is freed, and the meter
    # reported that it used nothing (two answers of 3 prompt + 4 output tokens were charged)
    server = stack.kvgate.server
    assert wait_for(lambda: stack.kvgate.call(server.director.store.in_flight("reqs")) == 0)
    assert wait_for(lambda: sum(value for labels, value in server.metrics.tokens_used.values.items()
                                if labels[0] == "reqs") == 14)


def read_stream(response: httpx.Response) -> dict:
    """The usage of a streamed answer (its usage-only event)."""
    assert response.status_code == 200, response.text
    events = [orjson.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return next(e["usage"] for e in events if e.get("usage"))


def failed_open(stack) -> int:
    """Requests Envoy's rate limit filter let through because the Rate Limit Service did not
    answer in time (or failed)."""
    text = httpx.get(stack.envoy.admin_url + "/stats",
                     params={"filter": "ratelimit.failure_mode_allowed"}).text
    return sum(int(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.split(":")[0].endswith("ratelimit.failure_mode_allowed"))


def test_tokens_per_minute_is_charged_real_usage_and_blocks_once_spent(stack):
    assert tokens_left(stack, "toks") == TOKENS_PER_MINUTE
    usage = read_stream(chat(stack, "toks", 20, stream=True))
    answered = time.monotonic()
    assert usage["total_tokens"] == 23
    # charged after the response, when Envoy finishes the stream; the bucket refills a token
    # a second from then (a busy machine's check may come a second or two later)
    assert wait_for(lambda: tokens_left(stack, "toks") < TOKENS_PER_MINUTE - 10)
    left, waited = tokens_left(stack, "toks"), time.monotonic() - answered
    assert TOKENS_PER_MINUTE - 23 <= left <= TOKENS_PER_MINUTE - 23 + waited
    usage = read_stream(chat(stack, "toks", 40, stream=True))
    # 43 of the 37 left: the bucket goes into debt, charged whatever the answer
    assert wait_for(lambda: tokens_left(stack, "toks") == 0)
    debt = 6  # 43 of the 37 left
    allowed_before = failed_open(stack)
    refused = chat(stack, "toks", 1, stream=True)
    if refused.status_code == 200 and failed_open(stack) > allowed_before:
        # the Rate Limit Service's answer came past Envoy's 100 ms (a busy machine), and a
        # request is let through then (failure_mode_deny: false): it is charged all the same
        debt += read_stream(refused)["total_tokens"]
        assert wait_for(lambda: tokens_left(stack, "toks") == 0)
        refused = chat(stack, "toks", 1, stream=True)
    assert refused.status_code == 429
    # the tokens of debt plus the one the check needs, at one token a second
    assert debt * 1000 <= int(refused.headers["retry-after-ms"]) <= (debt + 1) * 1000


def test_an_answer_the_client_cuts_off_is_charged_as_kvgate_charges_it(stack):
    """A client that hung up mid-answer ended the Lua meter before it published a usage, and
    Envoy's stream-done charge (which still runs) spent nothing: an answer cut off just
    before its end was free of the tokens-per-minute limit. The meter publishes kvgate's
    reservation first, which kvgate charges itself for an answer cut off (cut_off)."""
    server = stack.kvgate.server

    def charged() -> int:  # by kvgate itself, for this tenant
        return sum(value for labels, value in server.metrics.tokens_used.values.items()
                   if labels[0] == "cut")

    assert tokens_left(stack, "cut") == TOKENS_PER_MINUTE
    cut_before = server.metrics.charges.values.get(("cut_off",), 0)
    body = {"model": "tiny", "max_tokens": 1000, "stream": True,  # 2 s of answer
            "messages": [{"role": "user", "content": PROMPT}]}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", content=orjson.dumps(body),
                      headers={"authorization": f"Bearer {KEYS['cut']}",
                               "content-type": "application/json"}, timeout=30) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: {"))
        # stamped before the hang-up, not after: kvgate (a thread of this process) may
        # charge the cut-off answer before this thread runs again once the stream is closed
        hung_up = time.monotonic()
    assert wait_for(lambda: charged() > 0)
    assert server.metrics.charges.values.get(("cut_off",), 0) == cut_before + 1
    reserved = charged()
    assert reserved > 1000
    # the bucket refills a token a second from the charge, and goes into debt for it
    assert wait_for(lambda: tokens_left(stack, "cut") == 0)
    refused = chat(stack, "cut", 1)
    assert refused.status_code == 429, refused.text
    debt_ms = int(refused.headers["retry-after-ms"])
    waited_ms = (time.monotonic() - hung_up) * 1000
    # the debt plus the one token the check needs, at one a second (the limiter's clock
    # counts whole milliseconds: 1 ms of slack)
    assert (reserved - TOKENS_PER_MINUTE) * 1000 - waited_ms <= debt_ms - 1000 + 1
    assert debt_ms <= (reserved - TOKENS_PER_MINUTE + 1) * 1000


# -- an imported envoyproxy/ratelimit config, through Envoy, beside its hand-written twin -------

ENVOYPROXY_CONFIG = """
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: remote_address
    value: 10.0.0.1
    rate_limit: {name: office, unit: hour, requests_per_unit: 1}
  - key: path
    value: /api/*
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: user
    descriptors:
      - key: plan
        value: premium
        rate_limit: {unit: hour, requests_per_unit: 5, replaces: [{name: office}]}
      - key: plan
        rate_limit: {unit: HOUR, requests_per_unit: 2}
  - key: canary
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"""


def hour(n: int, **extra: object) -> dict:
    return {"unit": "hour", "requests_per_unit": n, "algorithm": "fixed_window", **extra}


HAND_WRITTEN = {"domain": "edge-hand", "descriptors": [
    {"key": "remote_address", "rate_limit": hour(3)},
    {"key": "remote_address", "value": "10.0.0.1", "rate_limit": hour(1, name="office")},
    {"key": "path", "value": "/api/*", "rate_limit": hour(2)},
    {"key": "user", "descriptors": [
        {"key": "plan", "value": "premium",
         "rate_limit": hour(5, replaces=[{"name": "office"}])},
        {"key": "plan", "rate_limit": hour(2)},
    ]},
    {"key": "canary", "shadow_mode": True, "rate_limit": hour(1)},
]}

# Envoy builds the descriptors from request headers; a descriptor whose header is absent is
# not sent
HEADER_DESCRIPTORS = [
    [("x-remote-address", "remote_address")],
    [("x-path", "path")],
    [("x-user", "user"), ("x-plan", "plan")],
    [("x-canary", "canary")],
]
SEQUENCE = (
    [{"x-remote-address": "10.0.0.9"}] * 4
    + [{"x-remote-address": "10.0.0.1"}] * 2
    + [{"x-remote-address": "10.0.0.1", "x-user": "u1", "x-plan": "premium"}]
    + [{"x-path": "/api/chat"}] * 3 + [{"x-path": "/other"}]
    + [{"x-user": "u2", "x-plan": "basic"}] * 3
    + [{"x-canary": "yes"}] * 2
)
EXPECTED = [200, 200, 200, 429, 200, 429, 200, 200, 200, 429, 200, 200, 200, 429, 200, 200]


def imported_twins_bootstrap(config) -> dict:
    """kvgate's bootstrap, its ratelimit filter fed from request headers; requests with
    ``x-rl-config: hand`` ask domain ``edge-hand`` (a per-route override), others ``edge``."""
    bootstrap = copy.deepcopy(render_bootstrap(config))
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    typed = hcm["typed_config"]
    ratelimit = next(f for f in typed["http_filters"]
                     if f["name"] == "envoy.filters.http.ratelimit")["typed_config"]
    # the twins must both be decided: past the shipped 100 ms Envoy lets a request through
    # undecided (a busy CI machine answered one late in plain Python, and the counts parted)
    ratelimit["timeout"] = "5s"
    ratelimit["rate_limits"] = [
        {"actions": [{"request_headers": {"header_name": h, "descriptor_key": k}}
                     for h, k in actions]} for actions in HEADER_DESCRIPTORS]
    routes = typed["route_config"]["virtual_hosts"][0]["routes"]
    hand = copy.deepcopy(routes[0])
    hand["name"] = "hand"
    hand["match"]["headers"] = [{"name": "x-rl-config", "string_match": {"exact": "hand"}}]
    hand["typed_per_filter_config"] = {"envoy.filters.http.ratelimit": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3."
                 "RateLimitPerRoute", "domain": "edge-hand"}}
    routes.insert(0, hand)
    return bootstrap


@pytest.fixture(scope="module", params=["memory", "redis"])
def twins(request, tmp_path_factory):
    source = tmp_path_factory.mktemp("rl") / "edge.yaml"
    source.write_text(ENVOYPROXY_CONFIG)
    imported = yaml.safe_load(import_files([source])[0])["ratelimit"]["domains"]
    base = rls_config(store_section(request, timeout_ms=500))
    config = base.model_copy(update={
        "envoy": base.envoy.model_copy(update={"ratelimit_domain": "edge"}),
        "ratelimit": RateLimitSettings.model_validate({"domains": [*imported, HAND_WRITTEN]}),
    })
    with contextlib.ExitStack() as stack:
        host, port = parse_endpoint(config.pools[0].endpoints[0])
        stack.enter_context(EngineProcess(port=port, host=host, model="tiny", ms_per_token=2))
        kvgate = ServerThread(config).start()
        stack.callback(kvgate.stop)
        yield stack.enter_context(EnvoyProcess(bootstrap=imported_twins_bootstrap(config)))


def limit_headers(response: httpx.Response) -> dict[str, str]:
    """The headers that must agree exactly (reset times move on between the twins' calls)."""
    return {k: v for k, v in response.headers.items()
            if k in ("x-ratelimit-limit", "x-ratelimit-remaining", "x-should-retry")}


def test_an_imported_config_decides_as_its_hand_written_equivalent(twins):
    left = 3600 - time.time() % 3600
    if left < 20:  # both twins must count in the same hour
        time.sleep(left + 0.5)
    body = orjson.dumps({"model": "tiny", "max_tokens": 2,
                         "messages": [{"role": "user", "content": PROMPT}]})
    answers: dict[str, list[httpx.Response]] = {"imported": [], "hand": []}
    for headers in SEQUENCE:
        for twin in answers:
            answers[twin].append(httpx.post(
                f"{twins.url}/v1/chat/completions", content=body, timeout=30,
                headers={**headers, "x-rl-config": twin, "content-type": "application/json",
                         "authorization": f"Bearer {KEYS['reqs']}"}))
    imported, hand = answers["imported"], answers["hand"]
    assert [r.status_code for r in imported] == EXPECTED
    assert [r.status_code for r in hand] == EXPECTED
    assert [limit_headers(r) for r in imported] == [limit_headers(r) for r in hand]
    for a, b in zip(imported, hand, strict=True):
        for name in ("retry-after", "x-ratelimit-reset"):
            assert abs(int(a.headers.get(name, 0)) - int(b.headers.get(name, 0))) <= 1


def test_a_header_value_that_is_not_utf8_is_limited_not_let_through(twins):
    """Envoy copies the header into the descriptor as it came; a value that is not UTF-8
    must be counted like any other (a call kvgate failed to parse, Envoy would let through)."""
    left = 3600 - time.time() % 3600
    if left < 10:  # the four requests must count in the same hour
        time.sleep(left + 0.5)
    body = orjson.dumps({"model": "tiny", "max_tokens": 2,
                         "messages": [{"role": "user", "content": PROMPT}]})
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nAuthorization: Bearer "
               + KEYS["reqs"].encode() + b"\r\nX-Remote-Address: 10.7.7.\xff\xfe\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
    statuses = []
    for _ in range(4):
        with socket.create_connection((twins.listen_host, twins.listen_port), timeout=10) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        statuses.append(int(reply.split(b" ", 2)[1]))
    assert statuses == [200, 200, 200, 429]  # remote_address: 3 an hour
