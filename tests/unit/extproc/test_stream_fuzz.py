"""Adversarial ext_proc conversations: whatever Envoy (or a hand-written config, or a hostile
client behind it) sends, every reply is a 4xx immediate response or a continue of the
message's own kind, nothing raises, and after ``close`` nothing admitted is held."""

from __future__ import annotations

import asyncio
import json

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.metrics import Metrics
from extproc.reports import ReportDesk
from extproc.stream import RequestStream
from extproc.wiring import build_director
from limiter.stores import MemoryStore
from tests.unit.extproc.test_stream import KEY, make_config, parsed

CONFIG = make_config(requests_per_second=1000, max_concurrency=50, max_context_tokens=100_000)

HOSTILE_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
                 "/health", "/v1/chat%2Fcompletions", "//v1//completions/", "/v1/responses",
                 "/debug/requests", "/v1/../v1/embeddings", "/%zz", "/%ff%fe", "", "?",
                 "/v1/chat/completions?" + "q" * 300, "/" + "a/" * 500]
absurd_ints = st.one_of(st.integers(-3, 3), st.integers(-2**70, 2**70),
                        st.sampled_from([2**31 - 1, 2**31, 2**63, -2**63]))
maybe = st.one_of(st.none(), absurd_ints, st.booleans(), st.floats(allow_nan=True),
                  st.text(max_size=5), st.just([]), st.just({}))
header_values = st.one_of(st.text(max_size=40), st.binary(max_size=40),
                          st.sampled_from(["99999999999999999999999", "-1", "١٢", "²", " 5",
                                           "\x00", "batch", "interactive", "x" * 5000]))


@st.composite
def request_headers(draw, plausible=False):
    """Anything, or (``plausible``) an authenticated POST to an inference path, so that the
    hostile parts after it get looked at."""
    if plausible:
        method, key = "POST", f"Bearer {KEY}"
        path = draw(st.sampled_from(HOSTILE_PATHS[:3] + HOSTILE_PATHS[5:7]))
    else:
        method = draw(st.sampled_from(["POST", "GET", "HEAD", "PUT", "post", "", "CONNECT"]))
        path = draw(st.one_of(st.sampled_from(HOSTILE_PATHS), st.text(max_size=30)))
        key = draw(st.sampled_from([f"Bearer {KEY}", "Bearer nope", "", "bearer " + KEY,
                                    f"Bearer  {KEY} ", None]))
    values: list[tuple[str, bytes]] = [(":method", method.encode()), (":path", path.encode())]
    if key is not None:
        values.append(("authorization", key.encode()))
    for name in draw(st.lists(st.sampled_from(["content-length", "x-request-class",
                                               "x-kvgate-tenant", "x-gateway-destination-endpoint",
                                               ":path", "authorization"]), max_size=3)):
        value = draw(header_values)
        values.append((name, value if isinstance(value, bytes) else value.encode()))
    headers = [HeaderValue(key=k, raw_value=v) for k, v in values]
    end = not plausible and draw(st.booleans())
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=HeaderMap(headers=headers), end_of_stream=end))


@st.composite
def json_bodies(draw):
    chat = [{"role": "user", "content": "hi " * 20}]
    body = {"model": draw(st.sampled_from(["m", "m", "m", "nope", "", 5, None])),
            "messages": draw(st.sampled_from([chat, chat, chat, [], "hi", [3],
                                              [{"content": ["x", {"text": 1}]}]])),
            "prompt": draw(st.sampled_from(["hi", [1, 2, 3], [[]], [], None])),
            "input": draw(st.sampled_from(["hi", ["a", "b"], 7])),
            "stream_options": draw(st.sampled_from([None, {}, {"include_usage": True},
                                                    {"continuous_usage_stats": True}, 3]))}
    for name in ("max_tokens", "max_completion_tokens", "n", "best_of", "priority"):
        if draw(st.booleans()):  # mostly sane, so that admission and metering get exercised
            body[name] = draw(st.one_of(st.integers(1, 64), st.integers(1, 64), maybe))
    if draw(st.booleans()):
        body["stream"] = draw(st.one_of(st.booleans(), st.booleans(), maybe))
    return json.dumps(body).encode()  # big ints and NaN too, which orjson will not write


raw_bodies = st.one_of(json_bodies(), json_bodies(), st.binary(max_size=200),
                       st.sampled_from([b"", b"null", b"[1]", b'{"model": "m"', b"\xff\xfe{}",
                                        b'{"model": "m", "messages": [{"content": "a"}], '
                                        b'"max_tokens": 1' + b"0" * 40 + b"}",
                                        b"[" * 5000 + b"]" * 5000]))
sse_chunks = st.sampled_from([
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
    b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":-9,"completion_tokens":"x"}}\n\n',
    b"data: [DONE]\n\n", b'{"usage": {"prompt_tokens": 1}}', b"data: {\n\n", b"\xff" * 10,
])


def body(raw_or_strategy, kind):
    return st.builds(lambda raw, end: pb.ProcessingRequest(**{kind: pb.HttpBody(
        body=raw, end_of_stream=end)}), raw_or_strategy, st.booleans())


messages = st.one_of(
    request_headers(),
    body(raw_bodies, "request_body"),
    body(st.one_of(sse_chunks, st.binary(max_size=100)), "response_body"),
    st.just(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())),
    st.just(pb.ProcessingRequest(response_headers=pb.HttpHeaders())),
    st.just(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())),
    st.just(pb.ProcessingRequest()),  # no phase at all
)
# the usual order, with hostile contents: most conversations should get past the headers
conversations = st.one_of(
    st.lists(messages, min_size=1, max_size=6),
    st.tuples(request_headers(plausible=True), body(raw_bodies, "request_body"),
              st.lists(body(sse_chunks, "response_body"), max_size=4))
    .map(lambda t: [t[0], t[1], *t[2]]),
)


def check_immediate(answer: pb.ImmediateResponse) -> None:
    """kvgate's own model list is a 200; any other answer kvgate gives itself is a 4xx
    with an OpenAI-style error."""
    if answer.details == "kvgate_models":
        assert answer.status.code == 200
        assert orjson.loads(answer.body)["object"] == "list"
    else:
        assert 400 <= answer.status.code < 500, (answer.status.code, answer.body)
        assert "error" in orjson.loads(answer.body)


async def close_holding_nothing(stream: RequestStream, director, store: MemoryStore) -> None:
    """Envoy ends the stream: nothing admitted is left held anywhere."""
    await stream.close("envoy_closed")
    assert director.active == {}
    assert all(not s.reservations for s in director.schedulers.values())
    assert await store.in_flight("acme") == 0


async def converse(conversation: list[pb.ProcessingRequest]) -> None:
    store = MemoryStore()
    director = build_director(CONFIG, store)
    stream = RequestStream(director, Metrics(), CONFIG.server, ReportDesk())
    for message in conversation:
        reply = parsed(await stream.handle(message))
        kind = message.WhichOneof("request")
        if reply.HasField("immediate_response"):
            check_immediate(reply.immediate_response)
        else:
            assert reply.WhichOneof("response") == kind
        if stream.done:
            break
    await close_holding_nothing(stream, director, store)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations)
def test_any_conversation_is_answered_safely_and_holds_nothing(conversation):
    asyncio.run(converse(conversation))


def test_the_model_list_is_the_one_immediate_answer_that_is_not_an_error():
    """A case hypothesis found: kvgate answers ``GET /v1/models`` itself, with a 200."""
    values = {":method": b"GET", ":path": b"/v1/models", "authorization": f"Bearer {KEY}".encode()}
    asyncio.run(converse([pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v) for k, v in values.items()])))]))


def test_a_body_before_its_headers_is_400():
    asyncio.run(converse([pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}"))]))
