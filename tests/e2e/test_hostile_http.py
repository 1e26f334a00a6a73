"""Whatever HTTP a client throws at the gateway: an answer, or a 4xx with an OpenAI-style
JSON error (a 503 only for capacity), and nothing held once it is over.

Random requests through the real Envoy, kvgate and simulated engines, seeded so a failure
replays: methods and paths kvgate knows and does not (encoded, doubled, dotted, long), keys
good and bad, content types and encodings, classes asked for, bodies that are valid with
any of the fields kvgate reads set to any JSON, cut short, not UTF-8, nested deep or larger
than allowed, streamed or not, over HTTP/1.1 and HTTP/2, some left as soon as the answer
starts. On the in-memory store and on Redis."""

from __future__ import annotations

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import free_port, store_section, wait_for

pytestmark = pytest.mark.e2e

KEYS = {"acme": "sk-hostile-acme", "tight": "sk-hostile-tight"}
MAX_BODY = 256 * 1024
REQUESTS = 400
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
ODD_PATHS = ["/v1/models", "/health", "/v1/chat/completions/", "//v1//chat/completions",
             "/v1/chat/completions?x=1", "/v1/%63hat/completions", "/v1/chat/../completions",
             "/V1/chat/completions", "/v1/responses", "/metrics", "/admin/reload",
             "/%2e%2e/v1/models", "/v1/embeddings?a=%zz", "/" + "a" * 3000, "/v1/models/x"]
FIELDS = ["model", "messages", "prompt", "input", "suffix", "tools", "chat_template_kwargs",
          "n", "best_of", "max_tokens", "max_completion_tokens", "echo", "stream",
          "stream_options", "priority", "prompt_embeds", "kv_transfer_params", "cache_salt",
          "logprobs", "prompt_logprobs", "encoding_format", "user", "ignore_eos",
          "chat_template", "mm_processor_kwargs", "request_id", "rid", "input_ids",
          "use_beam_search", "vllm_xargs", "min_tokens", "lora_path"]
SCALARS = [None, True, False, 0, -1, 1, 3, 16, 2**31, 2**63, 1.5, 1e308, "", "x", "tiny-llama",
           "user", "text", "\u0000", "a" * 50]
KEYWORDS = ["role", "content", "type", "text", "name", "include_usage", "image_url",
            "function", "arguments", "tool_calls", "prompt_token_ids"]


def hostile_config(store: dict[str, Any]):
    data: dict[str, Any] = {
        "server": {"grpc_port": free_port(), "admin_port": 0, "max_body_bytes": MAX_BODY},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"big": {"limits": {"requests_per_second": 1000, "request_burst": 2000,
                                     "max_concurrency": 64}},
                  "tight": {"limits": {"requests_per_second": 2, "request_burst": 2,
                                       "tokens_per_minute": 2000, "max_concurrency": 1}}},
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 1}},
        "tenants": [{"name": name, "tier": "big" if name == "acme" else "tight",
                     "api_keys": [hash_api_key(key)]} for name, key in KEYS.items()],
        "pools": [{"name": "tiny", "models": [{"name": "tiny-llama", "default_max_tokens": 16}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(2)],
                   "priority_scheduling": True}],
        **store,
    }
    return parse_config(data)


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request):
    config = hostile_config(store_section(request))
    with local_stack(config, engine_options={"ms_per_token": 2}) as running:
        yield running


def any_json(r: random.Random, depth: int = 0) -> Any:
    roll = r.random()
    if depth > 3 or roll < 0.5:
        return r.choice([*SCALARS, [], {}])
    if roll < 0.75:
        return [any_json(r, depth + 1) for _ in range(r.randrange(4))]
    return {r.choice(KEYWORDS): any_json(r, depth + 1) for _ in range(r.randrange(4))}


def body_for(r: random.Random, path: str) -> bytes:
    body: dict[str, Any] = {"model": "tiny-llama", "max_tokens": r.choice([1, 4, 8, None])}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hello " * r.randrange(1, 40)}]
    elif "embeddings" in path:
        body["input"] = "hello"
    else:
        body["prompt"] = "hello there"
    for _ in range(r.randrange(4)):
        body[r.choice(FIELDS)] = any_json(r)
    if r.random() < 0.3:
        body["stream"] = True
        if r.random() < 0.5:
            body["stream_options"] = {"include_usage": r.choice([True, False])}
    raw = json.dumps(body).encode()
    roll = r.random()
    if roll < 0.05:
        return raw[: r.randrange(len(raw))]  # cut short
    if roll < 0.08:
        return b"\xff\xfe" + raw  # not UTF-8
    if roll < 0.09:
        return b"[" * 5000 + b"]" * 5000  # nested deeper than any parser reads
    if roll < 0.1:  # nested deeper than kvgate writes back (254), as JSON reads it (1024)
        levels = r.randrange(250, 1024)
        return raw[:-1] + b', "deep": ' + b"[" * levels + b"]" * levels + b"}"
    if roll < 0.12:
        return json.dumps({**body, "pad": "z" * (MAX_BODY + 1)}).encode()  # too large
    return raw


def request_for(r: random.Random) -> dict[str, Any]:
    path = r.choice(ODD_PATHS) if r.random() < 0.3 else r.choice(PATHS)
    method = r.choice(["POST"] * 8 + ["GET", "PUT", "DELETE", "OPTIONS", "PATCH", "HEAD"])
    headers = {"content-type": r.choice(["application/json"] * 6 + ["text/plain", "",
                                                                     "multipart/form-data"])}
    roll = r.random()
    if roll < 0.8:
        headers["authorization"] = "Bearer " + r.choice(list(KEYS.values()))
    elif roll < 0.9:
        headers["authorization"] = r.choice(["Bearer x", "bearer " + KEYS["acme"],
                                             "Basic abc", "Bearer " + "k" * 5000])
    if r.random() < 0.05:
        headers["content-encoding"] = r.choice(["gzip", "identity", "br", "x"])
    if r.random() < 0.2:
        headers["x-kvgate-class"] = r.choice(["interactive", "batch", "offline", "nope"])
    if r.random() < 0.05:
        headers["x-request-id"] = r.choice(["a" * 1000, "ok-id", "%00"])
    body = body_for(r, path) if method in ("POST", "PUT", "PATCH") else None
    return {"method": method, "path": path, "headers": headers, "body": body,
            "http2": r.random() < 0.2, "leave_early": r.random() < 0.1}


def send(url: str, spec: dict[str, Any]) -> tuple[int, bytes]:
    http2 = spec["http2"]
    with httpx.Client(http2=http2, http1=not http2, timeout=60) as client, client.stream(
            spec["method"], url + spec["path"], content=spec["body"],
            headers=spec["headers"]) as response:
        if spec["leave_early"]:
            next(response.iter_raw(64), b"")
            return response.status_code, b""
        return response.status_code, response.read()


def what_is_wrong(status: int, text: bytes, spec: dict[str, Any]) -> str | None:
    """None when the answer is one a client can act on."""
    if status >= 500 and (status != 503 or not text):
        return "a server error"
    if status >= 400 and text and spec["method"] != "HEAD":
        try:
            error = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return "a 4xx/5xx without an OpenAI-style JSON error"
        if not error.get("message"):
            return "an error without a message"
        if error.get("code") == "internal_error":
            return "a kvgate bug (internal_error)"
    return None


def test_any_request_gets_an_answer_or_a_clear_error_and_leaves_nothing_held(stack):
    specs = [request_for(random.Random(1000 + n)) for n in range(REQUESTS)]
    statuses: Counter[int | str] = Counter()
    wrong = []

    def one(n: int) -> None:
        spec = specs[n]
        try:
            status, text = send(stack.url, spec)
        except httpx.HTTPError as error:  # the client's own refusals, or a reset while sending
            statuses[type(error).__name__] += 1
            return
        statuses[status] += 1
        problem = what_is_wrong(status, text, spec)
        if problem:
            wrong.append((n, problem, status, spec["method"], spec["path"], text[:200]))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(REQUESTS)))
    assert not wrong, wrong[:5]
    assert statuses[200] >= REQUESTS // 10, statuses  # enough got through to exercise the path
    director = stack.kvgate.server.director
    assert wait_for(lambda: not director.active, timeout=15), director.active
    for tenant in KEYS:
        assert stack.kvgate.call(director.store.in_flight(tenant)) == 0, tenant
    gauge = stack.kvgate.server.metrics.in_flight.values
    assert all(value == 0 for value in gauge.values()), gauge  # counted out as counted in
    assert stack.kvgate._thread.is_alive()


@pytest.mark.parametrize("http2", [False, True])
@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "tools"),
                                             ("/v1/chat/completions", "metadata"),
                                             ("/v1/completions", "logit_bias")])
def test_a_body_nested_deeper_than_kvgate_writes_back_is_a_400_before_admission(
        stack, path, field, http2):
    """JSON parsers read 1024 levels, orjson writes 254: a body in between was admitted, then
    failed as kvgate wrote it back — a 503 after the tenant's limits were charged, and the
    in-flight gauge counted out a request it never counted in."""
    base = {"model": "tiny-llama", "max_tokens": 4, "stream": http2}
    base.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path
                else {"prompt": "x"})
    raw = json.dumps(base).encode()[:-1] + f', "{field}": '.encode() + b"[" * 300 + b"]" * 300 \
        + b"}"
    metrics = stack.kvgate.server.metrics

    def admitted() -> float:
        return sum(n for labels, n in metrics.requests.values.items() if "admitted" in labels)

    before = admitted()
    with httpx.Client(http2=http2, http1=not http2, timeout=30) as client:
        response = client.post(stack.url + path, content=raw, headers={
            "authorization": "Bearer " + KEYS["acme"], "content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"
    assert "254" in response.json()["error"]["message"]
    assert admitted() == before  # refused before admission: nothing charged
    gauge = metrics.in_flight.values
    assert all(value == 0 for value in gauge.values()), gauge
