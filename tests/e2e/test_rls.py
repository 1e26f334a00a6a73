"""Envoy's ``ratelimit`` filter pointed at kvgate's Rate Limit Service, through the real
Envoy, with the bootstrap ``kvgate render-envoy`` writes for ``envoy.ratelimit_domain``:
over-limit requests get 429 with Retry-After and x-ratelimit-* headers, and a tokens-per-
minute descriptor is charged each streamed response's real usage (the Lua meter's
``kvgate.usage`` metadata, ``apply_on_stream_done``) and refuses the next request once spent.
Once with the in-memory counters, once with a real Redis."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import orjson
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf.wrappers_pb2 import UInt64Value

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import free_port
from tests.e2e.test_gateway import wait_for

pytestmark = pytest.mark.e2e

DOMAIN = "kvgate"
KEYS = {"reqs": "sk-rls-reqs", "toks": "sk-rls-toks"}
TOKENS_PER_MINUTE = 60
PROMPT = "hello there gateway"  # the simulated engine counts 3 prompt tokens


def rls_config(redis_url: str | None):
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
        **({"redis": {"url": redis_url, "timeout_ms": 500}} if redis_url else {}),
        "ratelimit": {"domains": [{"domain": DOMAIN, "descriptors": rules}]},
        "tiers": {"big": {"limits": {"requests_per_second": 100}}},
        "tenants": [{"name": name, "tier": "big", "api_keys": [hash_api_key(key)]}
                    for name, key in KEYS.items()],
        "pools": [{"name": "p", "models": [{"name": "tiny"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request):
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    with local_stack(rls_config(url), engine_options={"ms_per_token": 2}) as running:
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
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="kind", value="tokens"),
                 ratelimit_pb2.RateLimitDescriptor.Entry(key="tenant", value=tenant)],
        hits_addend=UInt64Value(value=0))

    async def ask() -> rls_pb2.RateLimitResponse:
        port = stack.kvgate.server.grpc_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            return await stub.ShouldRateLimit(
                rls_pb2.RateLimitRequest(domain=DOMAIN, descriptors=[descriptor]))

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
    # a token bucket of 2/min refills one request every 30 s
    assert 29_000 <= int(refused.headers["retry-after-ms"]) <= 30_000
    assert refused.headers["retry-after"] == "30"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "x-should-retry" not in refused.headers


def read_stream(response: httpx.Response) -> dict:
    """The usage of a streamed answer (its usage-only event)."""
    assert response.status_code == 200, response.text
    events = [orjson.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return next(e["usage"] for e in events if e.get("usage"))


def test_tokens_per_minute_is_charged_real_usage_and_blocks_once_spent(stack):
    assert tokens_left(stack, "toks") == TOKENS_PER_MINUTE
    usage = read_stream(chat(stack, "toks", 20, stream=True))
    assert usage["total_tokens"] == 23
    # charged after the response, when Envoy finishes the stream
    assert wait_for(lambda: tokens_left(stack, "toks") == TOKENS_PER_MINUTE - 23)
    usage = read_stream(chat(stack, "toks", 40, stream=True))
    # 43 of the 37 left: the bucket goes into debt, charged whatever the answer
    assert wait_for(lambda: tokens_left(stack, "toks") == 0)
    refused = chat(stack, "toks", 1, stream=True)
    assert refused.status_code == 429
    # 6 tokens of debt plus the one the check needs, at one token a second
    assert 6_000 <= int(refused.headers["retry-after-ms"]) <= 7_000
