"""End to end through the real Envoy binary: client → Envoy → kvgate ext_proc → engine."""

from __future__ import annotations

import contextlib
import gzip
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import free_port, wait_for

pytestmark = pytest.mark.e2e

UPSTREAM_KEY_ENV = "KVGATE_E2E_UPSTREAM_KEY"  # the engines' own key (vLLM --api-key)
UPSTREAM_KEY = "sk-engine-only"
KEYS = {"acme": "sk-e2e-acme", "slow": "sk-e2e-slow", "solo": "sk-e2e-solo",
        "tokens": "sk-e2e-tokens"}
MAX_BODY = 64 * 1024


def e2e_config(request_attributes=False):
    engines = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0, "max_body_bytes": MAX_BODY},
        "envoy": {"listen_port": free_port(), "admin_port": free_port(),
                  "request_attributes": request_attributes},
        "tiers": {
            "big": {"limits": {"requests_per_second": 100, "tokens_per_minute": 1_000_000}},
            "tight": {"limits": {"requests_per_second": 1, "request_burst": 1}},
            "single": {"limits": {"max_concurrency": 1}},
            "tokens": {"limits": {"tokens_per_minute": 600, "token_burst": 60}},
        },
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 5}},
        "tenants": [
            {"name": name, "tier": tier, "api_keys": [hash_api_key(KEYS[name])],
             "default_class": klass}
            for name, tier, klass in [("acme", "big", "batch"), ("slow", "tight", "interactive"),
                                      ("solo", "single", "interactive"),
                                      ("tokens", "tokens", "interactive")]
        ],
        "pools": [{"name": "tiny", "models": [{"name": "tiny-llama", "default_max_tokens": 16}],
                   "endpoints": engines, "priority_scheduling": True,
                   "upstream_api_key": {"env": UPSTREAM_KEY_ENV}}],
    })


# every test runs with the headers phase, and with the headers as attributes on the body
@pytest.fixture(scope="module", params=[False, True], ids=["headers", "attributes"])
def stack(request):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
        with local_stack(e2e_config(request_attributes=request.param),
                         engine_options={"ms_per_token": 5}) as running:
            yield running


def chat(tenant="acme", max_tokens=8, **extra):
    return {"model": "tiny-llama", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there gateway"}], **extra}


def post(stack, tenant, body, path="/v1/chat/completions", **kwargs):
    content = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    content = kwargs.pop("content", content)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    if tenant:
        headers["authorization"] = f"Bearer {KEYS.get(tenant, tenant)}"
    return httpx.post(stack.url + path, content=content, headers=headers, timeout=30, **kwargs)


def in_flight(stack, tenant):
    return stack.kvgate.call(stack.kvgate.server.director.store.in_flight(tenant))


def test_admitted_request_reaches_engine_with_priority_and_content_length(stack):
    for engine in stack.engines.values():
        engine.clear_requests()
    response = post(stack, "acme", chat(priority=-100, **{"x": "y"}),
                    headers={"x-gateway-destination-endpoint": "10.9.9.9:1",
                             "x-kvgate-tenant": "someone-else",
                             # vLLM obeys these (over the body's priority): never passed on
                             "x-vllm-priority": "-1000", "x-data-parallel-rank": "0",
                             "endpoint-load-metrics-format": "json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    served = response.headers["x-bench-engine"]
    received = stack.engines[served].requests()[-1]
    assert received["body"]["priority"] == 5  # acme's class (batch), not the client's -100
    assert int(received["content_length"]) == received["body_bytes"]
    assert received["headers"]["x-kvgate-tenant"] == "acme"
    assert received["headers"]["x-kvgate-priority"] == "5"
    assert received["headers"]["x-gateway-destination-endpoint"].split(",")[0] == served
    for name in ("x-vllm-priority", "x-data-parallel-rank", "endpoint-load-metrics-format"):
        assert name not in received["headers"], name
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


def test_each_tenant_reaches_the_engines_prefix_cache_under_its_own_salt(stack):
    """Two tenants sending the same prompt never share cached prefixes (the timing of a hit
    would tell one what the other sent); a client's own salt still splits its requests."""
    def salt_sent(tenant, **extra):
        response = post(stack, tenant, chat(**extra))
        assert response.status_code == 200, response.text
        served = stack.engines[response.headers["x-bench-engine"]]
        return served.requests()[-1]["body"]["cache_salt"]

    acme, solo = salt_sent("acme"), salt_sent("solo")
    assert acme == salt_sent("acme") != solo  # the simulated engine checks vLLM's rules
    mine = salt_sent("acme", cache_salt="user-17")
    assert mine not in (acme, solo, "user-17") and mine == salt_sent("acme", cache_salt="user-17")
    assert salt_sent("solo", cache_salt="user-17") not in (mine, solo)
    before = engine_log_sizes(stack)
    refused = post(stack, "acme", chat(cache_salt=""))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
    assert engine_log_sizes(stack) == before
    assert wait_for(lambda: in_flight(stack, "acme") == in_flight(stack, "solo") == 0)


def test_an_http2_client_sends_a_large_prompt(stack):
    """Cleartext HTTP/2 (prior knowledge) with a body near the largest allowed (the rendered
    flow-control windows hold one such body): admitted and answered like HTTP/1.1."""
    # one long word: the simulated engine holds one token of KV for it, so the next tests
    # find both engines as idle as before
    body = chat(messages=[{"role": "user", "content": "w" * 60_000}], max_tokens=2)
    assert MAX_BODY * 0.9 < len(orjson.dumps(body)) < MAX_BODY
    with httpx.Client(http1=False, http2=True, timeout=60) as client:
        response = client.post(stack.url + "/v1/chat/completions", content=orjson.dumps(body),
                               headers={"content-type": "application/json",
                                        "authorization": f"Bearer {KEYS['acme']}"})
    assert response.http_version == "HTTP/2", response.http_version
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


def test_engines_get_the_pools_key_never_a_tenants(stack):
    for engine in stack.engines.values():
        engine.clear_requests()
    assert post(stack, "acme", chat()).status_code == 200
    assert post(stack, "acme", chat(stream=True)).status_code == 200
    auth = {"authorization": f"Bearer {KEYS['acme']}"}
    assert httpx.get(stack.url + "/v1/models", headers=auth, timeout=10).status_code == 200
    received = [r for engine in stack.engines.values() for r in engine.requests()]
    assert len(received) == 2  # kvgate answers /v1/models itself: no engine sees it
    assert all(r["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}" for r in received)
    assert KEYS["acme"] not in orjson.dumps(received).decode()


def test_requests_spread_over_both_engines(stack):
    served = {post(stack, "acme", chat(max_tokens=1)).headers["x-bench-engine"]
              for _ in range(12)}
    assert served == set(stack.engines)


def test_streamed_response_arrives_intact(stack):
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=chat(max_tokens=20,
                      stream=True), headers={"authorization": f"Bearer {KEYS['acme']}"},
                      timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e.removeprefix("data:")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(text.split()) == 20
    assert all(c["choices"] for c in chunks)  # kvgate's own usage chunk was stripped


def test_client_asking_for_usage_gets_it(stack):
    body = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
    response = post(stack, "acme", body)
    events = [e for e in response.text.split("\n\n") if e.startswith("data: {")]
    usage = orjson.loads(events[-1].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 4


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True},
                                     {"continuous_usage_stats": True, "include_usage": False}])
def test_continuous_usage_stats_without_include_usage_bring_no_usage(stack, options):
    """vLLM adds usage to every chunk only with ``include_usage``: a client asking for
    ``continuous_usage_stats`` alone gets none from it. kvgate asks for the final usage
    chunk (include_usage) and strips it, and must not turn the per-chunk usage on with it:
    every chunk arrives as vLLM alone would send it (it did: usage on every chunk)."""
    body = chat(max_tokens=6, stream=True, stream_options=options)
    events = [e for e in post(stack, "acme", body).text.split("\n\n") if e.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["choices"] and c.get("usage") is None for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(text.split()) == 6
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


def test_continuous_usage_stats_with_include_usage_pass_through(stack):
    """Asked for both, the client gets vLLM's answer as it is: usage on every chunk and
    the final usage chunk (kvgate strips nothing it did not add)."""
    body = chat(max_tokens=4, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = [e for e in post(stack, "acme", body).text.split("\n\n") if e.startswith("data:")]
    chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and not chunks[-1]["choices"]
    assert all(c.get("usage") for c in chunks)


def test_stream_null_is_not_streamed(stack):
    response = post(stack, "acme", chat(max_tokens=2, stream=None, n=None))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_unknown_key_is_401(stack):
    response = post(stack, "sk-unknown", chat())
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert post(stack, None, chat()).status_code == 401


def test_malformed_json_is_400(stack):
    response = post(stack, "acme", b'{"model": "tiny-llama", "messages": [')
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert in_flight(stack, "acme") == 0


def test_missing_fields_and_unknown_model(stack):
    assert post(stack, "acme", {"messages": [{"role": "user", "content": "x"}]}).status_code == 400
    response = post(stack, "acme", chat() | {"model": "gpt-9"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("length", [b"0", b"00", b"000", None])
@pytest.mark.parametrize("tenant", ["acme", None], ids=["key", "no-key"])
def test_a_post_without_a_body_is_refused_however_its_length_is_written(stack, length,
                                                                        tenant):
    """A zero length written with several digits (valid HTTP) declares no body either. The
    route that skips the headers phase took ``00`` for a body to come: the request reached
    kvgate in no message at all, and Envoy answered 503 (no host), which clients retry. (No
    length at all, no body: the headers phase refuses it too.)"""
    auth = b"" if tenant is None else b"Authorization: Bearer " + KEYS[tenant].encode() + b"\r\n"
    declared = b"" if length is None else b"Content-Length: " + length + b"\r\n"
    reply = raw_exchange(stack, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: close\r\n" + auth + declared + b"\r\n")
    got, headers, body = json_reply(reply)
    if tenant is None:
        assert (got, body["error"]["code"]) == (401, "invalid_api_key"), reply
    else:
        assert got == 400, reply
        assert "needs a JSON request body" in body["error"]["message"]
    assert headers["x-should-retry"] == "false"


def http2_exchange(stack, path: str, send: Callable[[Any], None]) -> tuple[int, dict]:
    """One HTTP/2 POST with acme's key, its body and trailers written by ``send`` on the
    ``h2`` connection: the status and JSON body Envoy answers."""
    import h2.config
    import h2.connection
    import h2.events

    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2c.initiate_connection()
    h2c.send_headers(1, [(":method", "POST"), (":path", path), (":scheme", "http"),
                         (":authority", "x"), ("authorization", f"Bearer {KEYS['acme']}"),
                         ("content-type", "application/json")])
    send(h2c)
    status, body = 0, b""
    with socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port)) as sock:
        sock.settimeout(20)
        sock.sendall(h2c.data_to_send())
        while chunk := sock.recv(65536):
            for event in h2c.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return status, orjson.loads(body)
            sock.sendall(h2c.data_to_send())
    return status, orjson.loads(body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/"])
def test_an_http2_request_of_trailers_and_no_body_is_refused(stack, path):
    """HTTP/2 headers, then trailers, no DATA: Envoy has no body to send kvgate, and (request
    trailers not asked for) kvgate heard nothing more of the request, which Envoy then sent
    on unrouted: 503 no healthy upstream. Now a 400; a body with trailers still passes."""
    status, body = http2_exchange(stack, path, lambda h2c: h2c.send_headers(
        1, [("x-trailer", "1")], end_stream=True))
    assert status == 400, body
    assert "needs a JSON request body" in body["error"]["message"]

    def with_body(h2c) -> None:
        h2c.send_data(1, orjson.dumps(chat()))
        h2c.send_headers(1, [("x-trailer", "1")], end_stream=True)

    status, body = http2_exchange(stack, path, with_body)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


@pytest.mark.parametrize("compress", [True, False], ids=["gzipped", "plain-but-labelled"])
def test_an_encoded_request_body_is_415_and_never_reaches_an_engine(stack, compress):
    """kvgate meters the body it reads: one the engine would decode first is refused."""
    body = orjson.dumps(chat())
    sent = sum(len(engine.requests()) for engine in stack.engines.values())
    response = post(stack, "acme", gzip.compress(body) if compress else body,
                    headers={"content-encoding": "gzip"})
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_content_encoding"
    assert sum(len(engine.requests()) for engine in stack.engines.values()) == sent
    assert in_flight(stack, "acme") == 0
    assert post(stack, "acme", chat(), headers={"content-encoding": "identity"}).status_code == 200


def test_oversized_body_is_413(stack):
    big = chat() | {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    response = post(stack, "acme", big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    chunked = post(stack, "acme", None, content=iter([orjson.dumps(big)]))  # no content-length
    assert chunked.status_code == 413


def test_over_limit_gets_429_and_succeeds_after_retry_after(stack):
    first = post(stack, "slow", chat(max_tokens=1))
    assert first.status_code == 200
    rejected = post(stack, "slow", chat(max_tokens=1))
    assert rejected.status_code == 429
    h = rejected.headers
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert 0 < int(h["retry-after-ms"]) <= 1000 and h["retry-after"] == "1"
    assert h["x-ratelimit-limit-requests"] == "1"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("ms")
    time.sleep(int(h["retry-after-ms"]) / 1000)
    assert post(stack, "slow", chat(max_tokens=1)).status_code == 200


def test_token_limit_429_names_tokens_and_recovers(stack):
    body = chat(max_tokens=40)  # ~45 tokens of a 60-token bucket refilling 10/s
    assert post(stack, "tokens", body).status_code == 200
    rejected = post(stack, "tokens", body)
    assert rejected.status_code == 429, rejected.text
    assert rejected.headers["x-ratelimit-limit-tokens"] == "60"
    time.sleep(int(rejected.headers["retry-after-ms"]) / 1000)
    assert post(stack, "tokens", body).status_code == 200


def test_concurrency_slot_released_after_completion(stack):
    assert post(stack, "solo", chat(max_tokens=2)).status_code == 200
    assert wait_for(lambda: in_flight(stack, "solo") == 0)
    assert post(stack, "solo", chat(max_tokens=2)).status_code == 200


def test_concurrency_slot_released_after_client_disconnect(stack):
    body = orjson.dumps(chat("solo", max_tokens=2000, stream=True))
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Authorization: Bearer " + KEYS["solo"].encode() + b"\r\n"
               b"Content-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port)) as sock:
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert in_flight(stack, "solo") == 1
        busy = post(stack, "solo", chat(max_tokens=1))
        assert busy.status_code == 429
        assert busy.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert wait_for(lambda: in_flight(stack, "solo") == 0)
    assert post(stack, "solo", chat(max_tokens=1)).status_code == 200


def test_admin_port_serves_usage_and_metrics(stack):
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
    usage = httpx.get(f"{admin}/admin/tenants/tokens/usage").json()
    assert usage["tenant"] == "tokens" and usage["tokens"]["limit"] == 60
    assert httpx.get(f"{admin}/admin/tenants/nobody/usage").status_code == 404
    metrics = httpx.get(f"{admin}/metrics").text
    assert "# TYPE kvgate_requests_total counter" in metrics


# -- hostile paths and Envoy's own replies -------------------------------------------------


def raw_exchange(stack, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection; everything Envoy answers until it closes (a
    reply sent before the whole request was read may be followed by a reset: the kernel's
    answer to a close with unread bytes, after the reply)."""
    received = b""
    with socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port),
                                  timeout=10) as sock:
        sock.sendall(request)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    return received


def json_reply(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of a whole HTTP/1.1 reply (chunked or sized)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    if headers.get("transfer-encoding") == "chunked":
        whole = b""
        while body:  # the last chunk (size 0) may be cut off by a reset, see raw_exchange
            size, _, body = body.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            whole, body = whole + body[: int(size, 16)], body[int(size, 16) + 2 :]
        body = whole
    return int(status_line.split()[1]), headers, orjson.loads(body)


def engine_log_sizes(stack):
    return {endpoint: len(engine.requests()) for endpoint, engine in stack.engines.items()}


@pytest.mark.parametrize("path", ["/v1/chat%2Fcompletions", "/v1/chat%2fcompletions",
                                  "/v1%5Cchat/completions"])
def test_an_escaped_slash_is_refused_before_anything_runs(stack, path):
    before = engine_log_sizes(stack)
    response = post(stack, "acme", chat(priority=-100), path=path)
    assert response.status_code == 400, response.text
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert engine_log_sizes(stack) == before


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_without_an_output_cap_is_capped_at_what_was_reserved(stack, stream):
    """The engine's own default is the rest of the model's context: the request would
    outgrow the KV and the price kvgate reserved for it (the model's default_max_tokens)."""
    body = chat(stream=stream)
    del body["max_tokens"]
    response = post(stack, "acme", body)
    assert response.status_code == 200, response.text
    served = stack.engines[response.headers["x-bench-engine"]].requests()[-1]
    assert served["body"]["max_tokens"] == 16  # e2e_config's default_max_tokens
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


def test_content_kvgate_cannot_meter_never_reaches_an_engine(stack):
    """An image part's tokens show in no text: refused unless the model says what one
    costs (here it does not)."""
    before = engine_log_sizes(stack)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                       image]}])
    response = post(stack, "acme", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "unsupported_content"
    assert response.headers["x-should-retry"] == "false"
    assert engine_log_sizes(stack) == before
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


@pytest.mark.parametrize(("path", "field", "value", "code"), [
    ("/v1/chat/completions", "kv_transfer_params", {"prompt_token_ids": [1] * 500},
     "unsupported_parameter"),
    ("/v1/chat/completions", "session_params", {"id": "s"}, "unsupported_parameter"),
    ("/v1/chat/completions", "chat_template", "{% for i in range(99999) %}{{ messages }}"
     "{% endfor %}", "unsupported_parameter"),
    ("/v1/completions", "prompt_embeds", ["AAAA"], "unsupported_content"),
    ("/v1/chat/completions", "mm_processor_kwargs", {"max_pixels": 12845056},
     "unsupported_parameter"),
    ("/v1/chat/completions", "input_ids", [1] * 500, "unsupported_parameter"),
    ("/v1/chat/completions", "request_id", "chatcmpl-someone-elses", "unsupported_parameter"),
    ("/v1/completions", "rid", "someone-elses", "unsupported_parameter"),
    ("/v1/completions", "use_beam_search", True, "unsupported_parameter"),
])
def test_a_prompt_an_engine_would_take_elsewhere_never_reaches_it(stack, path, field, value,
                                                                   code):
    """Fields from which an engine would run a prompt kvgate never counted."""
    before = engine_log_sizes(stack)
    body = chat() if path == "/v1/chat/completions" else {
        "model": chat()["model"], "prompt": "hi", "max_tokens": 4}
    response = post(stack, "acme", {**body, field: value}, path=path)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, field)
    assert response.headers["x-should-retry"] == "false"
    assert engine_log_sizes(stack) == before
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


def test_paths_kvgate_cannot_meter_never_reach_an_engine(stack):
    before = engine_log_sizes(stack)
    auth = {"authorization": f"Bearer {KEYS['acme']}"}
    for path in ("/v1/responses", "/v1/score", "/pooling", "/invocations", "/tokenize",
                 "/v1/audio/transcriptions", "/v1/chat/completions%252F", "/metrics"):
        response = post(stack, "acme", chat(), path=path)
        assert response.status_code == 404, (path, response.text)
        assert response.headers["x-kvgate-reject"] == "unknown_url"
        assert response.json()["error"]["type"] == "invalid_request_error"
    debug = httpx.get(stack.url + "/debug/requests", headers=auth, timeout=10)
    assert debug.status_code == 404 and "authorization" not in debug.text
    wrong = httpx.get(stack.url + "/v1/chat/completions", headers=auth, timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert engine_log_sizes(stack) == before
    assert httpx.get(stack.url + "/v1/models", headers=auth, timeout=10).status_code == 200
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


@pytest.mark.parametrize("path", ["//v1//chat/completions", "/v1/chat/completions/",
                                  "/v1/./chat/completions//?x=1"])
def test_a_path_the_engine_would_route_elsewhere_is_sent_as_kvgate_metered_it(stack, path):
    """Merged slashes, dot segments, a trailing slash: metered as chat, and the engine gets
    the path it routes as chat (vLLM answers a trailing slash with a redirect)."""
    response = post(stack, "acme", chat(priority=-100), path=path)
    assert response.status_code == 200, response.text
    served = stack.engines[response.headers["x-bench-engine"]].requests()[-1]
    assert served["body"]["priority"] == 5
    assert served["path"] == "/v1/chat/completions"


@pytest.mark.parametrize(("request_bytes", "status", "code", "says"), [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431,
     "request_headers_too_large", "Too Large"),
    (b"GET /v1/models HTTP/1.1\r\nHost x\r\n\r\n", 400, "malformed_request",
     "malformed HTTP request"),
    (b"GET /v1/models HTTP/1.0\r\n\r\n", 426, "unsupported_http_version",
     "only HTTP/1.1 and HTTP/2 are supported"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
     b"Authorization: Bearer " + KEYS["acme"].encode() + b"\r\n\r\n"
     + b"%x\r\n" % (MAX_BODY + 200_000) + b"x" * (MAX_BODY + 200_000) + b"\r\n0\r\n\r\n", 413,
     "request_too_large", "Too Large"),  # kvgate's own 413 has that code too
    (b"POST /v1/chat%00completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 400,
     "malformed_request", "malformed HTTP request"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
     b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", 403,
     "upgrade_not_supported", "upgrades (WebSocket"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
     b"Authorization: Bearer " + KEYS["acme"].encode() + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400,
     "unsupported_transfer_encoding",
     "transfer-encoding must be chunked"),  # Envoy's own answer: 501, retried by clients
    (b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404,
     "invalid_request_target", "must be a path"),
    (b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n", 400, "missing_host_header",
     "no Host header"),
], ids=["header-too-large", "malformed-header", "http-1.0", "body-over-buffer", "nul-in-path",
        "websocket", "transfer-encoding", "asterisk-target", "no-host"])
def test_envoys_own_replies_arrive_whole(stack, request_bytes, status, code, says):
    got, headers, body = json_reply(raw_exchange(stack, request_bytes))
    assert (got, body["error"]["code"]) == (status, code)  # a string, as kvgate's own
    assert says in body["error"]["message"], body  # never empty: says what was wrong
    assert headers["content-type"] == "application/json"
    assert headers["x-should-retry"] == "false"


def raw_chat(header: bytes, tenant: str | None = "acme") -> bytes:
    body = orjson.dumps(chat())
    auth = b"" if tenant is None else b"Authorization: Bearer " + KEYS[tenant].encode() + b"\r\n"
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + auth + header + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize(("header", "tenant", "status", "code"), [
    (b"X-Request-Class: \xff\xfebatch", "acme", 400, "invalid_request_class"),
    (b"Authorization: Bearer sk-\xff\xfe", None, 401, "invalid_api_key"),
    (b"X-Request-Id: r\xe9quest-\xff", "acme", 200, None),
    (b"X-Unread: \xff\xfe", "acme", 200, None),
], ids=["class", "api-key", "request-id", "unread"])
def test_header_bytes_that_are_not_utf8_are_judged_like_any_value(stack, header, tenant,
                                                                  status, code):
    """Envoy passes header values that are not UTF-8; as an attribute such a value would not
    parse as a protobuf string. A header kvgate reads is judged with the bytes replaced (a
    4xx naming what is wrong), one it does not read changes nothing: never a 503."""
    reply = raw_exchange(stack, raw_chat(header, tenant))
    got, headers, body = json_reply(reply)
    assert got == status, reply
    if code is None:
        assert body["choices"][0]["message"]["content"]
    else:
        assert body["error"]["code"] == code and headers["x-should-retry"] == "false"
    assert wait_for(lambda: in_flight(stack, "acme") == 0)


def test_a_large_upload_gets_a_whole_413_not_a_broken_connection(stack):
    response = post(stack, "acme", b"x" * 5_000_000)
    assert response.status_code == 413
    assert response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["code"] == "request_too_large"  # Envoy's, as kvgate's own
