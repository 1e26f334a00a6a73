"""What real clients see through real Envoy: the openai-python client with its default
retries recovers from a concurrent burst (every refused client gets its own retry time),
admitted responses carry x-ratelimit-* without an extra gRPC message, and GET /v1/models
lists every pool's models. Run on the in-memory store and on Redis."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import openai
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from extproc.envoy_config import EXT_PROC_CLUSTER, render_bootstrap
from tests.conftest import free_port, store_section

pytestmark = pytest.mark.e2e

KEYS = {"herd": "sk-clients-herd", "pair": "sk-clients-pair", "plain": "sk-clients-plain",
        "paced": "sk-clients-paced"}


def clients_config(store: dict[str, Any]):
    pools = [("tiny", "tiny-llama", 2), ("other", "other-llama", 1)]
    data = {
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {
            "herd": {"limits": {"requests_per_second": 2, "request_burst": 4}},
            "pair": {"limits": {"max_concurrency": 2}},
            "plain": {"limits": {"requests_per_second": 100, "tokens_per_minute": 600_000}},
            # 1 request/s and 10 tokens/s: a 40-token answer's reservation outlasts the
            # request bucket's refill
            "paced": {"limits": {"requests_per_second": 1, "request_burst": 1,
                                 "tokens_per_minute": 600, "token_burst": 60}},
        },
        "tenants": [{"name": name, "tier": name, "api_keys": [hash_api_key(key)]}
                    for name, key in KEYS.items()],
        "pools": [{"name": pool, "models": [{"name": model, "default_max_tokens": 16}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(n)]}
                  for pool, model, n in pools],
        **store,
    }
    return parse_config(data)


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request):
    config = clients_config(store_section(request))
    with local_stack(config, engine_options={"ms_per_token": 5}) as running:
        yield running


def client(stack, tenant: str) -> openai.AsyncOpenAI:
    """The real client, default max_retries (2) and its own retry timing."""
    return openai.AsyncOpenAI(api_key=KEYS[tenant], base_url=stack.url + "/v1", timeout=60)


async def ask(api: openai.AsyncOpenAI, model: str = "tiny-llama") -> str:
    answer = await api.chat.completions.create(
        model=model, max_tokens=8, messages=[{"role": "user", "content": "hello there"}])
    return answer.choices[0].message.content or ""


def burst(stack, tenant: str, n: int, *, before: int = 0) -> list[object]:
    """``before`` requests one after the other, then ``n`` at once; each result or error."""

    async def run() -> list[object]:
        api = client(stack, tenant)
        try:
            for _ in range(before):
                await ask(api)
            return await asyncio.gather(*(ask(api) for _ in range(n)), return_exceptions=True)
        finally:
            await api.close()

    return asyncio.run(run())


def test_a_rate_limited_herd_all_succeed_on_default_retries(stack):
    """2 req/s, burst 4, the bucket empty: 20 concurrent requests, each refused one told
    its own retry time, all served within the client's two retries."""
    results = burst(stack, "herd", 20, before=4)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]


def test_a_concurrency_limited_herd_all_succeed_on_default_retries(stack):
    """max_concurrency 2, requests of ~40 ms (learnt from the first few): 50 at once."""
    results = burst(stack, "pair", 50, before=4)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert wait_until(lambda: in_flight(stack, "pair") == 0)


def test_refused_clients_are_told_distinct_times(stack):
    """The same burst seen raw: every 429 names another retry time, a refill apart."""
    time.sleep(2.5)  # the herd tenant's bucket full again, its promises spent
    auth = {"authorization": f"Bearer {KEYS['herd']}"}
    body = {"model": "tiny-llama", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}

    async def run() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            async def ask() -> tuple[httpx.Response, float]:
                response = await http.post("/v1/chat/completions", json=body, headers=auth)
                return response, time.monotonic()  # when the answer came

            return await asyncio.gather(*(ask() for _ in range(12)))

    start = time.monotonic()
    answers = asyncio.run(run())
    # each wait counts from its own answer, and under load (Redis, a busy CI machine) the
    # burst's requests leave and their answers come over a few hundred ms: compare the
    # times the answers name, on one clock
    told = sorted((at - start) * 1000 + int(r.headers["retry-after-ms"])
                  for r, at in answers if r.status_code == 429)
    assert len(told) >= 7  # 4 (burst) + what refilled meanwhile were admitted
    gaps = [b - a for a, b in itertools.pairwise(told)]
    assert all(400 <= gap <= 600 for gap in gaps), told  # one refill (500 ms) apart


def test_a_client_refused_by_its_request_rate_is_told_when_its_tokens_fit_too(stack):
    """A refusal's retry time is the latest of every limit the retry takes from: a client
    refused by its request rate while its token bucket is also short must not be told the
    request bucket's time alone (it came back then and was refused again, by tokens: with
    the body riding with the headers, the request-count peek answered before the body, and
    so the token bucket, was read)."""
    api = openai.OpenAI(api_key=KEYS["paced"], base_url=stack.url + "/v1", max_retries=0)

    def ask() -> openai.APIResponse:
        return api.chat.completions.with_raw_response.create(
            model="tiny-llama", max_tokens=40, messages=[{"role": "user", "content": "hi"}])

    with api:
        ask()  # ~48 of the 60 tokens reserved, and the one request
        with pytest.raises(openai.RateLimitError) as refused:
            ask()
        wait_ms = int(refused.value.response.headers["retry-after-ms"])
        assert wait_ms > 2000, refused.value.response.headers  # the tokens' wait, not 1 s
        time.sleep(wait_ms / 1000)
        assert ask().http_response.status_code == 200  # not refused again


def test_admitted_responses_carry_ratelimit_headers_without_an_extra_message(stack):
    messages = stack.kvgate.server.metrics.messages.values
    before = sum(messages.values())
    auth = {"authorization": f"Bearer {KEYS['plain']}"}
    body = {"model": "tiny-llama", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        answers = [http.post("/v1/chat/completions", json=body, headers=auth) for _ in range(5)]
        other = http.post("/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {KEYS['pair']}"})
    assert [a.status_code for a in answers] == [200] * 5
    # one each: the body, the headers it needs riding with it as attributes
    assert wait_until(lambda: sum(messages.values()) - before == 6)
    last = answers[-1].headers
    assert last["x-ratelimit-limit-requests"] == "200"  # the bucket's capacity (2 × rate)
    assert 190 <= int(last["x-ratelimit-remaining-requests"]) < 200
    assert last["x-ratelimit-reset-requests"].endswith("ms")
    assert last["x-ratelimit-limit-tokens"] == "600000"
    assert int(last["x-ratelimit-remaining-tokens"]) < 600_000
    assert last["x-ratelimit-reset-tokens"].endswith("s")
    assert other.status_code == 200  # a tenant with neither limit: no header, no empty one
    assert not [k for k in other.headers if k.startswith("x-ratelimit-")]


def test_models_lists_every_pool(stack):
    async def run() -> list[str]:
        api = client(stack, "plain")
        try:
            return [m.id async for m in api.models.list()]
        finally:
            await api.close()

    assert asyncio.run(run()) == ["tiny-llama", "other-llama"]
    assert burst(stack, "plain", 1) and asyncio.run(ask_other(stack)) is not None


def test_an_untyped_image_part_is_refused_on_a_text_only_model(stack):
    """vLLM reads a content part without a type by its media field: the text beside it
    must not carry the image past kvgate's default-deny (it reached the engine)."""
    api = openai.OpenAI(api_key=KEYS["plain"], base_url=stack.url + "/v1", max_retries=0)
    part = {"text": "hi", "image_url": "http://example.com/a.png"}
    with api, pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="tiny-llama", max_tokens=2, messages=[
            {"role": "user", "content": [part]}])  # type: ignore[list-item]
    assert refused.value.code == "unsupported_content"
    assert refused.value.response.headers["x-should-retry"] == "false"


async def ask_other(stack) -> str:
    api = client(stack, "plain")
    try:
        return await ask(api, "other-llama")
    finally:
        await api.close()


def in_flight(stack, tenant: str) -> int:
    return stack.kvgate.call(stack.kvgate.server.director.store.in_flight(tenant))


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def pinging_every(bootstrap: dict[str, Any], interval: str) -> dict[str, Any]:
    """``bootstrap`` with Envoy pinging its kvgate connections every ``interval`` (30 s as
    rendered: the same ping, only sooner)."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == EXT_PROC_CLUSTER:
            options = next(iter(cluster["typed_extension_protocol_options"].values()))
            http2 = options["explicit_http_config"]["http2_protocol_options"]
            http2["connection_keepalive"]["interval"] = interval
    return bootstrap


def test_an_answer_outlasts_envoys_pings_on_its_quiet_ext_proc_stream():
    """An ext_proc stream carries nothing while its answer streams back, and Envoy pings
    the connection all the while: gRPC's default ping policy answered the fourth ping with
    GOAWAY too_many_pings, cutting answers longer than ~2 minutes (pings every 30 s). Here
    every 1.5 s: an 8 s answer then saw four, and was cut after ~6 s."""
    config = clients_config({})
    bootstrap = pinging_every(render_bootstrap(config), "1.5s")
    with local_stack(config, engine_options={"ms_per_token": 50}, bootstrap=bootstrap) as stack:
        api = openai.OpenAI(api_key=KEYS["plain"], base_url=stack.url + "/v1", max_retries=0)
        with api:
            chunks = list(api.chat.completions.create(
                model="tiny-llama", max_tokens=160, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": "take your time"}]))
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 160
        assert wait_until(lambda: in_flight(stack, "plain") == 0)
