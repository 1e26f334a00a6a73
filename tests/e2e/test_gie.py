"""kvgate as a Gateway API Inference Extension endpoint picker, through the real Envoy
configured as such a gateway configures its picker (``kvgate render-envoy --gie``: request
and response bodies FULL_DUPLEX_STREAMED, trailers sent, an ORIGINAL_DST upstream on the
``x-gateway-destination-endpoint`` header), in front of simulated engines."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import orjson
import pytest

from extproc.config import EXAMPLE_CONFIG, hash_api_key, load_config, parse_config
from extproc.demo import local_stack
from extproc.duplex import CHUNK_BYTES
from extproc.envoy_config import ext_proc_filter_config
from extproc.envoy_gie import render_gie_bootstrap, render_gie_yaml
from extproc.envoy_proc import validate
from tests.conftest import free_port, wait_for
from tests.paths import REPO

COMMITTED = REPO / "envoy" / "gie-picker.yaml"

pytestmark = pytest.mark.e2e

KEYS = {"acme": "sk-gie-acme", "slow": "sk-gie-slow", "solo": "sk-gie-solo"}


def gie_config():
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0, "max_body_bytes": 512 * 1024},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {
            "big": {"limits": {"requests_per_second": 100, "tokens_per_minute": 1_000_000}},
            "tight": {"limits": {"requests_per_second": 1, "request_burst": 1}},
            "single": {"limits": {"max_concurrency": 1}},
        },
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 5}},
        "tenants": [
            {"name": name, "tier": tier, "api_keys": [hash_api_key(KEYS[name])],
             "default_class": "batch"}
            for name, tier in [("acme", "big"), ("slow", "tight"), ("solo", "single")]
        ],
        "pools": [{"name": "tiny", "models": [{"name": "tiny-llama", "default_max_tokens": 16}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(2)],
                   "priority_scheduling": True}],
    })


class Releases:
    """Every release kvgate makes: (tenant, lease, tokens used, of which output)."""

    def __init__(self, director):
        self.seen: list[tuple[str, str, int | None, int | None]] = []
        release = director.release

        async def recorded(admission, used, output=None, **kwargs):
            self.seen.append((admission.tenant.name, admission.lease_id, used, output))
            await release(admission, used, output, **kwargs)

        director.release = recorded


@pytest.fixture(scope="module")
def stack():
    config = gie_config()
    with local_stack(config, engine_options={"ms_per_token": 5, "kv_blocks": 16384},
                     bootstrap=render_gie_bootstrap(config)) as running:
        running.releases = Releases(running.kvgate.server.director)
        yield running


def chat(max_tokens=8, **extra):
    return {"model": "tiny-llama", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there gateway"}], **extra}


def post(stack, tenant, body, **kwargs):
    headers = {"content-type": "application/json",
               "authorization": f"Bearer {KEYS.get(tenant, tenant)}",
               **kwargs.pop("headers", {})}
    return httpx.post(stack.url + "/v1/chat/completions", content=orjson.dumps(body),
                      headers=headers, timeout=30, **kwargs)


def messages_by_kind(stack) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.kvgate.server.admin_port}/metrics").text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_extproc_messages_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            counts[kind] = float(line.rsplit(" ", 1)[1])
    return counts


def one_release(stack, before: int):
    """The one release after ``before`` releases, once it has happened (and no second)."""
    assert wait_for(lambda: len(stack.releases.seen) > before)
    time.sleep(0.2)  # a second release would land now
    assert len(stack.releases.seen) == before + 1, stack.releases.seen[before:]
    return stack.releases.seen[-1]


def test_non_streamed_request_is_routed_with_priority_and_charged_its_usage(stack):
    before = len(stack.releases.seen)
    response = post(stack, "acme", chat(priority=-100),
                    headers={"x-gateway-destination-endpoint": "10.9.9.9:1"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 8
    served = response.headers["x-bench-engine"]
    received = stack.engines[served].requests()[-1]
    assert received["body"]["priority"] == 5  # acme's class, not the client's -100
    assert received["body"]["cache_salt"].startswith("kvgate-")  # acme's own prefix cache
    assert received["headers"]["x-gateway-destination-endpoint"] == served
    assert received["headers"]["x-kvgate-tenant"] == "acme"
    assert int(response.headers["x-ratelimit-remaining-requests"]) > 0
    tenant, _, used, output = one_release(stack, before)
    assert (tenant, used, output) == ("acme", usage["total_tokens"], 8)


def test_engine_control_headers_never_reach_the_engine(stack):
    """A gateway's route to an InferencePool removes no headers (this bootstrap's route
    neither): kvgate removes what an engine obeys, or x-vllm-priority jumps vLLM's queue."""
    for engine in stack.engines.values():
        engine.clear_requests()
    before = len(stack.releases.seen)
    response = post(stack, "acme", chat(), headers={
        "x-vllm-priority": "-1000", "x-data-parallel-rank": "0",
        "endpoint-load-metrics-format": "json", "x-kvgate-tenant": "someone-else"})
    assert response.status_code == 200, response.text
    one_release(stack, before)  # (so the next test counts only its own)
    received = next(r for engine in stack.engines.values() for r in engine.requests())
    for name in ("x-vllm-priority", "x-data-parallel-rank", "endpoint-load-metrics-format",
                 "accept-encoding"):
        assert name not in received["headers"], name
    assert received["headers"]["x-kvgate-tenant"] == "acme"


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "//v1//chat/completions?x=1",
                                  "/v1/x/%2e%2e/chat/completions", "/v1/chat%2Fcompletions"])
def test_a_path_the_engine_would_route_elsewhere_is_sent_as_kvgate_metered_it(stack, path):
    """kvgate meters the path as an engine routes it (decoded, slashes merged, dot segments
    resolved, no trailing slash), and a gateway's route may not normalise it: the engine
    got the raw path after kvgate had admitted and charged the request (vLLM redirects a
    trailing slash, and the client's retry is admitted again; a dot segment is a 404)."""
    before = len(stack.releases.seen)
    response = httpx.post(stack.url + path, content=orjson.dumps(chat()), timeout=30,
                          headers={"authorization": f"Bearer {KEYS['acme']}",
                                   "content-type": "application/json"})
    assert response.status_code == 200, response.text
    served = stack.engines[response.headers["x-bench-engine"]].requests()[-1]
    assert served["path"] == "/v1/chat/completions"
    assert served["query"] == ({"x": "1"} if "?" in path else {})  # the query as sent
    one_release(stack, before)  # (so the next test counts only its own)


def test_a_headers_only_request_with_a_body_passes_it_on(stack):
    """In this mode Envoy sends a body even after kvgate decided on the headers alone
    (GET /health here): it was answered 400 after kvgate had admitted the request."""
    before = len(stack.releases.seen)
    response = httpx.request("GET", stack.url + "/health", content=b"hello",
                             headers={"authorization": f"Bearer {KEYS['acme']}"}, timeout=30)
    assert response.status_code == 200, response.text
    one_release(stack, before)  # (so the next test counts only its own)


def test_streamed_request_arrives_whole_without_kvgates_usage_event(stack):
    before = len(stack.releases.seen)
    with httpx.stream("POST", stack.url + "/v1/chat/completions",
                      json=chat(max_tokens=64, stream=True),
                      headers={"authorization": f"Bearer {KEYS['acme']}"},
                      timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e.removeprefix("data:")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(text.split()) == 64
    assert all(c["choices"] for c in chunks)  # kvgate's own usage chunk was stripped
    tenant, _, used, output = one_release(stack, before)
    assert tenant == "acme" and output == 64 and used > 64  # the engine's own usage


def test_client_asking_for_usage_gets_it(stack):
    body = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
    events = [e for e in post(stack, "acme", body).text.split("\n\n") if e.startswith("data: {")]
    assert orjson.loads(events[-1].removeprefix("data: "))["usage"]["completion_tokens"] == 4


def test_a_body_of_several_chunks_arrives_intact(stack):
    content = "word " * (3 * CHUNK_BYTES // 5)  # ~3 chunks each way
    response = post(stack, "acme", chat(max_tokens=2, messages=[
        {"role": "user", "content": content}]))
    assert response.status_code == 200, response.text
    received = stack.engines[response.headers["x-bench-engine"]].requests()[-1]
    assert received["body"]["messages"][0]["content"] == content
    assert received["body"]["priority"] == 5
    assert received["body_bytes"] > 2 * CHUNK_BYTES


def test_over_limit_is_429_with_retry_after(stack):
    assert post(stack, "slow", chat(max_tokens=1)).status_code == 200
    rejected = post(stack, "slow", chat(max_tokens=1))
    assert rejected.status_code == 429
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert rejected.headers["retry-after"] == "1"
    assert 0 < int(rejected.headers["retry-after-ms"]) <= 1000


def test_bad_key_and_bad_json_are_refused(stack):
    assert post(stack, "sk-nobody", chat()).status_code == 401
    response = httpx.post(stack.url + "/v1/chat/completions", content=b'{"model": ',
                          headers={"authorization": f"Bearer {KEYS['acme']}"}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_completed_requests_end_their_streams_normally(stack):
    errors = stack.kvgate.server.metrics.stream_errors.values
    before = dict(errors)
    assert post(stack, "acme", chat(max_tokens=2)).status_code == 200
    assert post(stack, "acme", chat(max_tokens=2, stream=True)).status_code == 200
    time.sleep(0.3)
    assert errors == before  # neither cut off nor cancelled


def test_client_leaving_mid_stream_releases_once(stack):
    before = len(stack.releases.seen)
    errors = stack.kvgate.server.metrics.stream_errors.values
    cut = sum(errors.values())
    body = orjson.dumps(chat(max_tokens=2000, stream=True))
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Authorization: Bearer " + KEYS["solo"].encode() + b"\r\n"
               b"Content-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port)) as sock:
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        busy = post(stack, "solo", chat(max_tokens=1))
        assert busy.status_code == 429  # the stream holds solo's one slot
    tenant, _, used, _ = one_release(stack, before)
    assert tenant == "solo" and used is not None
    assert sum(errors.values()) == cut + 1  # counted as a stream cut short
    assert post(stack, "solo", chat(max_tokens=1)).status_code == 200


def send_in_one_byte_frames(stack, body: bytes) -> bytes:
    """POST ``body`` over HTTP/2 as one DATA frame per byte, all sent at once; what came back."""
    import h2.config
    import h2.connection

    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2c.initiate_connection()
    h2c.send_headers(1, [(":method", "POST"), (":path", "/v1/chat/completions"),
                         (":scheme", "http"), (":authority", "gie"),
                         ("authorization", f"Bearer {KEYS['acme']}")])
    frames = bytearray()
    for i, byte in enumerate(body):  # length, type DATA, END_STREAM on the last, stream 1
        frames += struct.pack(">I", 1)[1:] + bytes([0, i == len(body) - 1]) + \
            struct.pack(">I", 1) + bytes([byte])
    with socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port)) as sock:
        sock.settimeout(20)
        sock.sendall(h2c.data_to_send())
        h2c.receive_data(sock.recv(65536))  # Envoy's SETTINGS: its window holds the body
        sock.sendall(h2c.data_to_send() + frames)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
            if b'"error"' in received or b"usage" in received:
                break
        return received


def test_a_body_in_tiny_frames_cuts_no_other_request(stack):
    """Envoy writes kvgate a message per body chunk the client sends: 120,000 one-byte DATA
    frames overran Envoy's outbound-frame flood guard on the connection to kvgate, and Envoy
    closed it, cutting every request in flight on it."""
    done: dict[str, object] = {}

    def other() -> None:
        with httpx.stream("POST", stack.url + "/v1/chat/completions",
                          json=chat(max_tokens=300, stream=True),
                          headers={"authorization": f"Bearer {KEYS['acme']}"},
                          timeout=60) as response:
            done["text"] = b"".join(response.iter_raw())

    streaming = threading.Thread(target=other)
    streaming.start()
    time.sleep(0.3)  # under way
    body = orjson.dumps(chat(max_tokens=1, messages=[
        {"role": "user", "content": "x" * 120_000}]))
    answer = send_in_one_byte_frames(stack, body)
    streaming.join(60)
    assert done["text"].endswith(b"data: [DONE]\n\n")
    # the tiny-framed request itself: refused once past kvgate's bound on a body's pieces
    assert b"body_too_fragmented" in answer


def test_models_list_is_answered_by_kvgate(stack):
    response = httpx.get(stack.url + "/v1/models",
                         headers={"authorization": f"Bearer {KEYS['acme']}"}, timeout=10)
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["tiny-llama"]


def test_messages_per_request(stack):
    """What this mode costs in gRPC messages (kvgate's own configuration: 2 per request)."""
    counts = []
    for body in (chat(max_tokens=8), chat(max_tokens=64, stream=True)):
        before = messages_by_kind(stack)
        assert post(stack, "acme", body).status_code == 200
        time.sleep(0.2)
        after = messages_by_kind(stack)
        counts.append({k: after[k] - before.get(k, 0) for k in after
                       if after[k] != before.get(k, 0)})
    plain, streamed = counts
    print("messages per request:", plain, streamed)
    # Envoy sends a body's data, then (often) an empty chunk with end_of_stream
    assert plain["request_headers"] == 1 and 1 <= plain["request_body"] <= 2
    assert plain["response_headers"] == 1 and 1 <= plain["response_body"] <= 2
    assert sum(plain.values()) <= 6
    # about one per token the engine writes (Envoy coalesces some when busy)
    assert streamed["response_body"] >= 32


def test_the_committed_gie_bootstrap_is_current_and_valid(tmp_path):
    example = load_config(EXAMPLE_CONFIG)
    assert COMMITTED.read_text() == render_gie_yaml(example), (
        "envoy/gie-picker.yaml is stale: regenerate it with `kvgate render-envoy --gie "
        "extproc/examples/kvgate.yaml -o envoy/gie-picker.yaml`")
    validate(COMMITTED)
    mode = ext_proc_filter_config(render_gie_bootstrap(example))["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["request_trailer_mode"] == mode["response_trailer_mode"] == "SEND"
    written = tmp_path / "gie.yaml"
    subprocess.run([sys.executable, "-m", "extproc.cli", "render-envoy", "--gie",
                    str(EXAMPLE_CONFIG), "-o", str(written)], cwd=REPO, check=True,
                   capture_output=True)
    assert written.read_text() == COMMITTED.read_text()
