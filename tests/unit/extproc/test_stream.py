"""The per-request state machine, driven with real ext_proc messages but no Envoy."""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import parse_config
from extproc.envoy_config import ext_proc_filter_config, render_bootstrap
from extproc.metrics import Metrics
from extproc.openai import Usage
from extproc.reports import ReportDesk
from extproc.stream import RequestStream
from extproc.wiring import build_director
from limiter.stores import MemoryStore

KEY = "sk-test-acme"


def make_config(**limits):
    return parse_config(
        {
            "tiers": {"gold": {"limits": limits}},
            "tenants": [
                {"name": "acme", "tier": "gold", "api_keys": [_hash(KEY)]},
            ],
            "pools": [
                {
                    "name": "p",
                    "models": [{"name": "m", "default_max_tokens": 100}],
                    "endpoints": ["127.0.0.1:7001", "127.0.0.1:7002"],
                    "priority_scheduling": True,
                    "kv_aware": False,  # no scraping here: least-in-flight picking
                }
            ],
        }
    )


def _hash(key: str) -> str:
    from extproc.config import hash_api_key

    return hash_api_key(key)


def headers_msg(path="/v1/chat/completions", key=KEY, end_of_stream=False, **extra):
    method = "GET" if end_of_stream else "POST"
    values = {":method": method, ":path": path, "content-type": "application/json", **extra}
    if key is not None:
        values["authorization"] = f"Bearer {key}"
    header_list = [HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=header_list), end_of_stream=end_of_stream
        )
    )


def body_msg(body, end_of_stream=True):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=end_of_stream))


def chat(max_tokens=10, **extra):
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * 40}], **extra}


def new_stream(config=None):
    config = config or make_config(requests_per_second=1, request_burst=2, max_concurrency=5)
    store = MemoryStore()
    return RequestStream(build_director(config, store), Metrics(), config.server,
                         ReportDesk()), store


def parsed(reply):
    """A reply as a message (routing replies come already serialized)."""
    if isinstance(reply, bytes):
        return pb.ProcessingResponse.FromString(reply)
    return reply


def header_dict(mutation):
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_admitted_request_is_routed_with_priority_and_content_length():
    stream, _ = new_stream()
    spoofed = headers_msg(**{"x-gateway-destination-endpoint": "6.6.6.6:1"})
    reply = parsed(await stream.handle(spoofed))
    removed = reply.request_headers.response.header_mutation.remove_headers
    assert "x-gateway-destination-endpoint" in removed
    reply = parsed(await stream.handle(body_msg(chat(priority=-5))))
    common = reply.request_body.response
    sent = orjson.loads(common.body_mutation.body)
    headers = header_dict(common.header_mutation)
    assert sent["priority"] == 0  # the tenant's class, not the client's -5
    assert headers["content-length"] == str(len(common.body_mutation.body))
    assert headers["x-kvgate-tenant"] == "acme"
    chosen, fallback = headers["x-gateway-destination-endpoint"].split(",")
    assert {chosen, fallback} == {"127.0.0.1:7001", "127.0.0.1:7002"}
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == f"{chosen},{fallback}"
    assert common.clear_route_cache


async def test_unknown_key_is_401_json():
    stream, _ = new_stream()
    reply = parsed(await stream.handle(headers_msg(key="sk-nope")))
    assert reply.immediate_response.status.code == 401
    assert orjson.loads(reply.immediate_response.body)["error"]["code"] == "invalid_api_key"
    assert stream.done


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"{not json", 400), (b"[1,2]", 400), ({"messages": []}, 400),
     ({"model": "m", "messages": "hi"}, 400),
     ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
     (chat(max_tokens=-1), 400),
     # deeper than kvgate can write back: refused before admission (was a 503 after it)
     (orjson.dumps(chat())[:-1] + b',"x":' + b"[" * 300 + b"]" * 300 + b"}", 400)],
)
async def test_bad_bodies_are_4xx_and_hold_nothing(body, status):
    stream, store = new_stream()
    await stream.handle(headers_msg())
    reply = parsed(await stream.handle(body_msg(body)))
    assert reply.immediate_response.status.code == status
    assert "error" in orjson.loads(reply.immediate_response.body)
    assert await store.in_flight("acme") == 0


async def test_oversized_body_is_413():
    config = make_config()
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"max_body_bytes": 100})})
    stream, _ = new_stream(config)
    reply = parsed(await stream.handle(headers_msg(**{"content-length": "5000"})))
    assert reply.immediate_response.status.code == 413


async def test_request_rate_rejects_at_headers_with_retry_after():
    stream, _ = new_stream()
    for _ in range(2):
        s = RequestStream(stream.director, stream.metrics, stream.settings, stream.desk)
        await s.handle(headers_msg())
        await s.handle(body_msg(chat()))
    reply = parsed(await stream.handle(headers_msg()))
    immediate = reply.immediate_response
    assert immediate.status.code == 429
    headers = header_dict(immediate.headers)
    assert int(headers["retry-after-ms"]) > 0
    assert headers["retry-after"] == "1"
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "messages"),
                                             ("/v1/completions", "prompt")])
async def test_context_too_long_is_400_do_not_retry_naming_the_prompts_field(path, field):
    stream, _ = new_stream(make_config(max_context_tokens=5))
    await stream.handle(headers_msg(path))
    body = chat() if field == "messages" else {"model": "m", "max_tokens": 10, "prompt": "x" * 40}
    reply = parsed(await stream.handle(body_msg(body)))
    assert reply.immediate_response.status.code == 400
    assert header_dict(reply.immediate_response.headers)["x-should-retry"] == "false"
    body = orjson.loads(reply.immediate_response.body)
    assert (body["error"]["code"], body["error"]["param"]) == ("context_length_exceeded", field)


async def test_a_streamed_request_is_metered_by_the_lua_meter_and_settled_on_its_report():
    """kvgate asks the engine for usage, tells the meter (metadata) to strip that event, and
    settles what the meter reported when Envoy ends the stream."""
    stream, store = new_stream(make_config(tokens_per_minute=1000, max_concurrency=1))
    await stream.handle(headers_msg())
    reply = parsed(await stream.handle(body_msg(chat(max_tokens=100, stream=True))))
    sent = orjson.loads(reply.request_body.response.body_mutation.body)
    assert sent["stream_options"] == {"include_usage": True}
    ours = reply.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert ours["meter"].string_value == "sse-strip"
    assert ours["report"].string_value == stream.desk.address
    assert ours["key"].string_value == stream.desk.key
    lease = ours["lease"].string_value
    assert await store.in_flight("acme") == 1 and not stream.done
    assert stream.desk.receive(f"/done/{lease}".encode(), stream.desk.key.encode(),
                               b'{"usage":{"prompt_tokens":13,"completion_tokens":1},'
                               b'"events":1}').startswith(b"HTTP/1.1 204")
    assert stream.response.done and stream.holds_admission  # released at the stream's end
    await stream.close(None)
    assert await store.in_flight("acme") == 0
    assert stream.response.settle(stream.admission.cost) == (14, 1, "usage")


async def test_a_second_done_report_does_not_replace_the_first():
    """Only the meter (holding the process's key) reports; a second report for one request
    is a fault, and must not turn a settled usage into a charge of the reservation."""
    stream, _ = new_stream()
    await stream.handle(headers_msg())
    reply = parsed(await stream.handle(body_msg(chat(max_tokens=100, stream=True))))
    lease = reply.dynamic_metadata.fields["kvgate"].struct_value.fields["lease"].string_value
    for body in (b'{"usage":{"prompt_tokens":13,"completion_tokens":3},"events":3}',
                 b'{"usage":null,"events":3,"answered":true}'):
        stream.desk.receive(f"/done/{lease}".encode(), stream.desk.key.encode(), body)
    await stream.close(None)
    assert stream.response.settle(stream.admission.cost) == (16, 3, "usage")


@pytest.mark.parametrize(("meter", "extra"), [
    ("json", {}), ("sse", {"stream": True, "stream_options": {"include_usage": True}}),
    ("sse-strip", {"stream": True, "n": 2}),
    ("sse-final", {"stream": True, "n": 2, "stream_options": {"include_usage": True}})])
async def test_the_meter_is_told_how_to_read_the_response(meter, extra):
    stream, _ = new_stream()
    await stream.handle(headers_msg())
    reply = parsed(await stream.handle(body_msg(chat(**extra))))
    ours = reply.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert ours["meter"].string_value == meter
    # and the most the request can have used, to which it holds what it publishes for
    # Envoy's rate limit filter (kvgate holds its own charge to the same)
    bound = reply.dynamic_metadata.fields["kvgate.bound"].struct_value.fields
    cost = stream.admission.cost
    prompt_max = max(16 * cost.prompt_tokens, cost.prompt_tokens + 4096)
    # then the reservation, which it publishes until the usage comes (a cut answer's charge)
    assert bound["usage"].string_value == (f"{prompt_max}:{cost.max_output_tokens}:"
                                           f"{cost.prompt_tokens}:{cost.max_output_tokens}")
    assert "kvgate" in reply.dynamic_metadata.fields  # not replaced by the bound's message
    # Envoy drops a namespace its ext_proc filter does not receive: the bound never reached
    # the meter, which published an engine's absurd count unbounded
    accepted = ext_proc_filter_config(render_bootstrap(make_config()))[
        "metadata_options"]["receiving_namespaces"]["untyped"]
    assert set(reply.dynamic_metadata.fields) <= set(accepted)


@pytest.mark.parametrize(("streamed", "first", "report", "used", "basis"), [
    (True, False, None, lambda cost: cost.prompt_tokens, "not_started"),
    (True, True, None, lambda cost: cost.prompt_tokens + 100, "cut_off"),
    (True, True, (None, 3, True), lambda cost: cost.prompt_tokens + 100, "no_usage"),
    (True, True, (None, 3, False), lambda cost: cost.prompt_tokens + 3, "engine_error"),
    (True, True, (Usage(13, 2), 2, True), lambda cost: 15, "usage"),
    (False, True, (Usage(13, 2), 0, True), lambda cost: 15, "usage"),
    (False, True, (None, 0, False), lambda cost: cost.prompt_tokens, "engine_error"),
    # an error answer's events past the output cap kvgate sent (a buggy engine or proxy, a
    # report with an absurd count): at most the cap, as a usage past it is (one report of
    # 2**64 - 1 events charged that many tokens and locked the tenant out for 142 years)
    (True, True, (None, 2**64 - 1, False), lambda cost: cost.prompt_tokens + 100,
     "engine_error"),
    (False, True, (None, 0, True), lambda cost: cost.prompt_tokens + 100, "no_usage"),
    # past what the request can have used (a buggy engine, a duplicated key): at the bound
    (True, True, (Usage(13, 50_000), 2, True), lambda cost: 13 + 100, "usage_bounded"),
    (False, True, (Usage(2**31 - 1, 2**31 - 1), 0, True),
     lambda cost: cost.prompt_tokens + 4096 + 100, "usage_bounded"),
    (False, True, (Usage(99_999_999, 2), 0, True),
     lambda cost: cost.prompt_tokens + 4096 + 2, "usage_bounded")])
async def test_what_a_response_is_charged(streamed, first, report, used, basis):
    """Usage when the engine reported it; the reservation for an answer (2xx), streamed or
    not, that ended without a usage kvgate could read, and for a response cut off
    mid-answer; the prompt (plus one token per streamed event) for an engine's error; the
    prompt when the client left before the response began. Only the engine's usage teaches
    the scheduler what the tenant's answers use (``measured``): a request cancelled before
    its first token, charged 0 output, taught a cheap "short answers"."""
    stream, _ = new_stream()
    await stream.handle(headers_msg())
    await stream.handle(body_msg(chat(max_tokens=100, stream=streamed)))
    if first:
        stream.first_reported()
    if report is not None:
        stream.done_reported(*report)
    charged = []

    async def release(admission, used_tokens, output_tokens, *, measured=True):
        charged.append((used_tokens, measured))

    stream.director.release = release
    await stream.close(None)
    assert charged == [(used(stream.admission.cost), basis.startswith("usage"))]
    assert stream.metrics.charges.values == {(basis,): 1}


async def test_first_response_chunk_ends_the_prefill_the_scheduler_counts():
    """The reservation carries the class band and prompt; the meter's first-chunk report
    (not the end) tells the scheduler the engine is done prefilling it."""
    stream, _ = new_stream()
    await stream.handle(headers_msg(**{"x-request-class": "batch"}))
    await stream.handle(body_msg(chat(stream=True)))
    scheduler = stream.admission.scheduler
    endpoint = stream.admission.endpoint
    held = scheduler.reservations[stream.admission.lease_id]
    assert held.band == 1 and held.prefill == stream.admission.cost.prompt_tokens > 0
    assert scheduler.prefill_tokens[endpoint] == held.prefill
    assert scheduler.low_prefills[endpoint] == 1
    stream.first_reported()
    stream.first_reported()  # a repeat changes nothing
    assert scheduler.prefill_tokens[endpoint] == 0 and scheduler.low_prefills[endpoint] == 0
    assert stream.holds_admission  # still streaming; the lease is held until the end


async def test_a_report_after_the_release_changes_nothing():
    stream, store = new_stream()
    await stream.handle(headers_msg())
    reply = parsed(await stream.handle(body_msg(chat(stream=True))))
    lease = reply.dynamic_metadata.fields["kvgate"].struct_value.fields["lease"].string_value
    await stream.close("cancelled")
    for kind in ("first", "done"):
        answer = stream.desk.receive(f"/{kind}/{lease}".encode(), stream.desk.key.encode(), b"{}")
        assert answer.startswith(b"HTTP/1.1 204")
    assert not stream.response.done and await store.in_flight("acme") == 0


async def test_a_failure_after_admission_leaves_the_in_flight_gauge_where_it_was(monkeypatch):
    """The release counts the request out of ``kvgate_in_flight_requests``; a failure between
    admission and routing (the body written back) must have counted it in."""
    def broken(*args, **kwargs):
        raise RuntimeError("the body could not be written back")

    monkeypatch.setattr("extproc.stream.mutate_body", broken)
    stream, store = new_stream()
    await stream.handle(headers_msg())
    reply = parsed(await stream.handle(body_msg(chat())))
    assert reply.immediate_response.status.code == 503
    await stream.close("internal")
    assert list(stream.metrics.in_flight.values.values()) == [0]
    assert await store.in_flight("acme") == 0


async def test_disconnect_releases_exactly_once():
    stream, store = new_stream()
    await stream.handle(headers_msg())
    await stream.handle(body_msg(chat(stream=True)))
    assert await store.in_flight("acme") == 1
    await stream.close("cancelled")
    await stream.close("cancelled")
    assert await store.in_flight("acme") == 0


async def test_models_are_listed_by_kvgate_for_every_pool():
    config = make_config(requests_per_second=1, request_burst=2)
    config.pools.append(config.pools[0].model_copy(update={
        "name": "other", "models": [config.pools[0].models[0].model_copy(
            update={"name": "other-model"})]}))
    stream, store = new_stream(config)
    reply = parsed(await stream.handle(headers_msg(path="/v1/models", end_of_stream=True)))
    answer = reply.immediate_response
    assert answer.status.code == 200
    listed = orjson.loads(answer.body)
    assert listed["object"] == "list"
    assert [(m["id"], m["owned_by"]) for m in listed["data"]] == [
        (config.pools[0].models[0].name, config.pools[0].name), ("other-model", "other")]
    headers = header_dict(answer.headers)
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"  # charged one request
    assert await store.in_flight("acme") == 0  # and holds nothing


async def test_get_is_decided_on_headers_alone():
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(path="/health", end_of_stream=True)))
    assert reply.WhichOneof("response") == "request_headers"
    assert reply.mode_override.request_body_mode == 0  # NONE
    assert header_dict(reply.request_headers.response.header_mutation)["x-kvgate-tenant"] == "acme"
    await stream.close(None)
    assert await store.in_flight("acme") == 0


async def test_spent_quota_is_429_do_not_retry_with_its_reset():
    stream, _ = new_stream(make_config(daily_token_quota=150))
    await stream.handle(headers_msg())
    assert parsed(await stream.handle(body_msg(chat(max_tokens=100)))).HasField("request_body")
    second = RequestStream(stream.director, stream.metrics, stream.settings, stream.desk)
    await second.handle(headers_msg())
    reply = (await second.handle(body_msg(chat(max_tokens=100)))).immediate_response
    assert reply.status.code == 429
    headers = header_dict(reply.headers)
    assert headers["x-should-retry"] == "false"
    assert headers["x-ratelimit-limit-quota"] == "150"
    assert headers["x-ratelimit-reset-quota"].endswith("s")
    assert orjson.loads(reply.body)["error"]["code"] == "insufficient_quota"
    usage = await stream.director.usage("acme")
    assert usage["quotas"]["daily"]["limit"] == 150


# -- paths: normalised, then default-deny --------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat%2Fcompletions", "/v1/chat%2fcompletions",
                                  "/v1//chat/completions", "/v1/chat/completions/",
                                  "/v1/./chat/completions?x=1"])
async def test_an_encoded_or_unnormalised_inference_path_is_metered(path):
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(path=path)))
    assert not reply.HasField("immediate_response")
    assert reply.mode_override.request_body_mode == ProcessingMode.BUFFERED  # body comes next
    reply = parsed(await stream.handle(body_msg(chat(priority=-100))))
    assert orjson.loads(reply.request_body.response.body_mutation.body)["priority"] == 0
    assert await store.in_flight("acme") == 1


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/score", "/score", "/pooling",
                                  "/classify", "/invocations", "/v1/rerank", "/rerank",
                                  "/v2/rerank", "/v1/audio/transcriptions", "/tokenize",
                                  "/detokenize", "/debug/requests", "/metrics", "/", "/v1",
                                  "/v1/chat%252Fcompletions", "/docs", "/openapi.json"])
async def test_paths_kvgate_cannot_meter_are_404_from_kvgate(method, path):
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(path=path, **{":method": method})))
    answer = reply.immediate_response
    assert answer.status.code == 404
    headers = header_dict(answer.headers)
    assert headers["x-kvgate-reject"] == "unknown_url"
    assert headers["content-type"] == "application/json"
    assert orjson.loads(answer.body)["error"]["type"] == "invalid_request_error"
    assert stream.done and not stream.holds_admission
    assert await store.in_flight("acme") == 0


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/embeddings", "POST"),
    ("POST", "/v1/models", "GET, HEAD"), ("DELETE", "/health", "GET, HEAD"),
])
async def test_a_wrong_method_on_a_known_path_is_405(method, path, allow):
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(path=path, **{":method": method})))
    answer = reply.immediate_response
    assert answer.status.code == 405
    headers = header_dict(answer.headers)
    assert headers["allow"] == allow and headers["x-kvgate-reject"] == "method_not_allowed"
    assert await store.in_flight("acme") == 0


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/?x", "//v1/./models"])
async def test_model_list_paths_are_answered_by_kvgate(path):
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(path=path, end_of_stream=True,
                                                   **{":method": "GET"})))
    assert reply.immediate_response.status.code == 200
    assert await store.in_flight("acme") == 0


@pytest.mark.parametrize("path", ["/health", "//health"])
async def test_harmless_gets_are_admitted_as_one_request(path):
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(path=path, end_of_stream=True,
                                                   **{":method": "GET"})))
    assert reply.WhichOneof("response") == "request_headers"
    assert reply.mode_override.request_body_mode == ProcessingMode.NONE
    await stream.close(None)
    assert await store.in_flight("acme") == 0


async def test_an_inference_path_without_a_body_is_400():
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(end_of_stream=True, **{":method": "POST"})))
    assert reply.immediate_response.status.code == 400
    assert await store.in_flight("acme") == 0


# -- the tenant's API key stays at the gateway ---------------------------------------------


def with_upstream_key(reference):
    config = make_config()
    data = config.model_dump(mode="json")
    data["pools"][0]["upstream_api_key"] = reference
    return parse_config(data)


async def test_the_tenants_key_is_removed_before_anything_goes_upstream():
    stream, _ = new_stream()
    reply = parsed(await stream.handle(headers_msg()))
    assert "authorization" in reply.request_headers.response.header_mutation.remove_headers
    reply = parsed(await stream.handle(body_msg(chat())))
    assert "authorization" not in header_dict(reply.request_body.response.header_mutation)
    get = RequestStream(stream.director, stream.metrics, stream.settings, stream.desk)
    reply = parsed(await get.handle(headers_msg(path="/health", end_of_stream=True)))
    mutation = reply.request_headers.response.header_mutation
    assert "authorization" in mutation.remove_headers
    assert "authorization" not in header_dict(mutation)


async def test_a_pools_upstream_key_replaces_the_tenants(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGATE_TEST_POOL_KEY", "pool-secret")
    for reference in ({"env": "KVGATE_TEST_POOL_KEY"}, {"file": str(tmp_path / "key")}):
        (tmp_path / "key").write_text("pool-secret\n")
        stream, _ = new_stream(with_upstream_key(reference))
        await stream.handle(headers_msg())
        reply = parsed(await stream.handle(body_msg(chat())))
        headers = header_dict(reply.request_body.response.header_mutation)
        assert headers["authorization"] == "Bearer pool-secret"
        get = RequestStream(stream.director, stream.metrics, stream.settings, stream.desk)
        reply = parsed(await get.handle(headers_msg(path="/health", end_of_stream=True)))
        mutation = reply.request_headers.response.header_mutation
        assert header_dict(mutation)["authorization"] == "Bearer pool-secret"


def test_a_missing_upstream_key_fails_at_startup(monkeypatch):
    from extproc.config import ConfigError

    monkeypatch.delenv("KVGATE_TEST_POOL_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"pools\[0\].upstream_api_key.*KVGATE_TEST_POOL_KEY"):
        new_stream(with_upstream_key({"env": "KVGATE_TEST_POOL_KEY"}))
    with pytest.raises(ConfigError, match="exactly one of env, file"):
        with_upstream_key({"env": "A", "file": "/x"})


# -- kvgate's own failures: unavailable limits are not a bug --------------------------------


async def test_an_in_memory_release_runs_to_its_end_without_waiting():
    """Why the server awaits it in place, without a task (server._release): with nothing
    to wait for, nothing can cancel it part way."""
    stream, store = new_stream()
    await stream.handle(headers_msg())
    await stream.handle(body_msg(chat()))
    assert stream.admission is not None
    assert not stream.director.release_waits(stream.admission)
    closing = stream.close("cancelled")
    with pytest.raises(StopIteration):
        closing.send(None)  # done on its first step
    assert not stream.holds_admission and await store.in_flight("acme") == 0


async def test_only_a_queued_request_may_wait_to_release_with_fair_counters_in_redis():
    """The limits store's part never waits (``release_soon``); correcting a queued
    request's charge in fair-order counters shared through Redis does: that release is a
    task of its own (server._release), which the client going away cannot cut short."""
    from extproc.wiring import build_store

    stream, _store = new_stream()
    await stream.handle(headers_msg())
    await stream.handle(body_msg(chat()))
    admission = stream.admission
    assert admission is not None and admission.charged is None
    queued = dataclasses.replace(admission, charged=100)
    assert not stream.director.release_waits(queued)  # counters in this process
    data = make_config().model_dump(mode="json")
    data["redis"] = {"url": "redis://127.0.0.1:1/0"}
    config = parse_config(data)
    shared = build_director(config, build_store(config, Metrics()))
    assert not shared.release_waits(admission)
    assert shared.release_waits(queued)
    await stream.close(None)


async def test_fail_closed_without_redis_is_503_gateway_unavailable():
    from extproc.wiring import build_store
    from tests.conftest import free_port

    data = make_config(requests_per_second=5).model_dump(mode="json")
    data["redis"] = {"url": f"redis://127.0.0.1:{free_port()}/0", "timeout_ms": 50,
                     "failure_policy": "fail_closed"}
    config = parse_config(data)
    stream = RequestStream(build_director(config, build_store(config, Metrics())), Metrics(),
                           config.server, ReportDesk())
    await stream.handle(headers_msg())  # the headers precheck only reuses known refusals
    answer = parsed(await stream.handle(body_msg(chat()))).immediate_response
    assert answer.status.code == 503
    headers = header_dict(answer.headers)
    assert headers["x-kvgate-reject"] == "gateway_unavailable"
    assert headers["retry-after"] == "1"
    assert orjson.loads(answer.body)["error"]["code"] == "gateway_unavailable"


async def test_a_kvgate_bug_is_503_internal_error():
    class Broken(MemoryStore):
        async def admit(self, *args, **kwargs):
            raise RuntimeError("a bug")

    config = make_config()
    stream = RequestStream(build_director(config, Broken()), Metrics(), config.server, ReportDesk())
    await stream.handle(headers_msg())
    answer = parsed(await stream.handle(body_msg(chat()))).immediate_response
    assert answer.status.code == 503
    assert header_dict(answer.headers)["x-kvgate-reject"] == "internal_error"
    assert orjson.loads(answer.body)["error"]["code"] == "internal_error"



async def test_n_and_best_of_multiply_the_reserved_output():
    stream, _ = new_stream()
    await stream.handle(headers_msg())
    await stream.handle(body_msg(chat(max_tokens=10, n=2, best_of=3)))
    assert stream.admission.cost.max_output_tokens == 30
    plain = RequestStream(stream.director, stream.metrics, stream.settings, stream.desk)
    await plain.handle(headers_msg())
    await plain.handle(body_msg(chat(n=None, stream=None)))
    assert plain.admission.cost.max_output_tokens == 10


@pytest.mark.parametrize("length", ["²", "٩٩٩٩٩٩٩٩", "99999999999999999999999999", "-5", "1e9"])
async def test_an_absurd_content_length_is_never_a_kvgate_failure(length):
    stream, _ = new_stream()
    reply = parsed(await stream.handle(headers_msg(**{"content-length": length})))
    if reply.HasField("immediate_response"):
        assert reply.immediate_response.status.code == 413
    else:
        assert reply.WhichOneof("response") == "request_headers"


async def test_a_request_without_an_id_gets_one_sent_upstream():
    """Envoy's own id goes on as it is; a request with none (or one unfit for a log line)
    gets kvgate's, on the same headers reply (no extra message), and a refusal shows it."""
    stream, _ = new_stream()
    reply = parsed(await stream.handle(headers_msg(**{"x-request-id": "envoy-id-1"})))
    assert "x-request-id" not in header_dict(reply.request_headers.response.header_mutation)
    assert stream.request_id == "envoy-id-1"
    for sent in ({}, {"x-request-id": "has spaces"}):
        stream, _ = new_stream()
        reply = parsed(await stream.handle(headers_msg(**sent)))
        mutation = reply.request_headers.response.header_mutation
        assert header_dict(mutation)["x-request-id"] == stream.request_id
        assert len(stream.request_id) == 32
        assert "authorization" in mutation.remove_headers  # the rest of the reply is intact
        assert reply.mode_override.request_body_mode == ProcessingMode.BUFFERED
    stream, _ = new_stream()
    reply = parsed(await stream.handle(headers_msg(key="sk-nope")))
    answer = reply.immediate_response
    assert header_dict(answer.headers)["x-request-id"] == stream.request_id


def attributes_msg(body, path="/v1/chat/completions", key=KEY, method="POST", **headers):
    """A body message carrying the request's headers as ext_proc attributes (the headers
    phase skipped: ``envoy.request_attributes``)."""
    message = body_msg(body)
    fields = message.attributes["envoy.filters.http.ext_proc"].fields
    fields["request.path"].string_value = path
    fields["request.method"].string_value = method
    if key is not None:
        fields["request.headers['authorization']"].string_value = f"Bearer {key}"
    for name, value in headers.items():
        fields[f"request.headers['{name}']"].string_value = value
    return message


async def test_headers_as_attributes_admit_in_one_message_with_upstream_headers_as_metadata():
    stream, store = new_stream()
    reply = parsed(await stream.handle(attributes_msg(chat(), **{"x-request-class": "batch"})))
    assert not stream.done  # routed: the stream stays open for the response
    sent = orjson.loads(reply.request_body.response.body_mutation.body)
    upstream = reply.dynamic_metadata.fields["kvgate.headers"].struct_value.fields
    assert upstream["x-kvgate-tenant"].string_value == "acme"
    assert upstream["x-kvgate-class"].string_value == "batch"  # the class header was read
    assert upstream["x-kvgate-priority"].string_value == str(sent["priority"])
    assert "authorization" not in upstream  # no pool key: the route drops the client's
    assert reply.dynamic_metadata.fields["kvgate"].struct_value.fields["pool"].string_value == "p"
    assert await store.in_flight("acme") == 1
    await stream.close(None)
    assert await store.in_flight("acme") == 0


async def test_headers_as_attributes_refuse_as_the_headers_phase_would():
    stream, _ = new_stream()
    assert parsed(await stream.handle(attributes_msg(chat(), key="sk-wrong"))
                  ).immediate_response.status.code == 401
    stream, _ = new_stream()
    assert parsed(await stream.handle(attributes_msg(chat(), method="GET"))
                  ).immediate_response.status.code == 405
    stream, _ = new_stream()  # no attributes and no headers before: a broken filter config
    assert parsed(await stream.handle(body_msg(chat()))).immediate_response.status.code == 400
    stream, _ = new_stream(make_config(requests_per_second=1, request_burst=1))
    assert not parsed(await stream.handle(attributes_msg(chat()))).HasField("immediate_response")
    late = RequestStream(stream.director, Metrics(), stream.settings, ReportDesk())
    refused = parsed(await late.handle(attributes_msg(b"not json")))  # refused before parsing
    assert refused.immediate_response.status.code == 429


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip", " GZIP "])
async def test_an_encoded_request_body_is_415_in_either_mode(encoding):
    """kvgate meters the body it reads; an engine that decoded it would run another one."""
    stream, store = new_stream()
    reply = parsed(await stream.handle(headers_msg(**{"content-encoding": encoding})))
    assert reply.immediate_response.status.code == 415
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert header_dict(reply.immediate_response.headers)["x-should-retry"] == "false"
    stream, _ = new_stream()
    reply = parsed(await stream.handle(attributes_msg(chat(), **{"content-encoding": encoding})))
    assert reply.immediate_response.status.code == 415
    assert await store.in_flight("acme") == 0


@pytest.mark.parametrize("encoding", ["identity", "Identity", ""])
async def test_an_identity_encoded_request_body_is_metered(encoding):
    stream, _ = new_stream()
    reply = parsed(await stream.handle(attributes_msg(chat(), **{"content-encoding": encoding})))
    assert not reply.HasField("immediate_response")


def test_a_long_prompt_of_cjk_or_emoji_estimated_without_a_tokenizer_is_charged_in_full():
    """The estimate counts four characters a token; 10,000 CJK characters may be 30,000
    tokens for a byte-level tokenizer (three bytes each). The bound allows 16× the estimate
    (at most four bytes a character, at least one a token), so real usage is never cut."""
    from extproc.accounting import ResponseRecord
    from limiter import Cost

    record = ResponseRecord(stream=False)
    record.finish(Usage(30_000, 100), 0, True)
    assert record.settle(Cost(2_500, 100)) == (30_100, 100, "usage")
    record.finish(Usage(40_001, 100), 0, True)  # past 16× 2,500: not a real prompt
    assert record.settle(Cost(2_500, 100)) == (40_100, 100, "usage_bounded")
