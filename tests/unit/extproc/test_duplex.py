"""The full-duplex state machine (an Inference Extension gateway's EPP protocol), driven with
real ext_proc messages but no Envoy."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import duplex
from extproc.duplex import CHUNK_BYTES, DuplexStream, streamed_bodies
from extproc.metrics import Metrics
from extproc.reports import ReportDesk
from extproc.server import ExternalProcessor, KvgateServer
from extproc.wiring import build_director
from limiter.stores import MemoryStore
from tests.unit.extproc.test_stream import (
    body_msg,
    chat,
    header_dict,
    headers_msg,
    make_config,
    parsed,
)

USAGE = {"prompt_tokens": 13, "completion_tokens": 4, "total_tokens": 17}


def new_stream(config=None):
    config = config or make_config(requests_per_second=100, max_concurrency=5)
    director = build_director(config, MemoryStore())
    return DuplexStream(director, Metrics(), config.server, ReportDesk())


def first(message, response_mode=ProcessingMode.FULL_DUPLEX_STREAMED):
    message.protocol_config.request_body_mode = ProcessingMode.FULL_DUPLEX_STREAMED
    message.protocol_config.response_body_mode = response_mode
    return message


def response_headers(content_type="application/json", end_of_stream=False, **more):
    values = {":status": "200", "content-type": content_type,
              **{k.replace("_", "-"): v for k, v in more.items()}}
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                   for k, v in values.items()]),
        end_of_stream=end_of_stream))


def response_body(data: bytes, end_of_stream=False):
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def streamed(reply, phase="request_body"):
    return getattr(parsed(reply), phase).response.body_mutation.streamed_response


def sse(events):
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def admitted(stream, body, chunk=7):
    """Headers, then the body in ``chunk``-byte pieces: the replies to the last piece."""
    assert await stream.exchange(first(headers_msg())) == []
    raw = orjson.dumps(body)
    for at in range(0, len(raw) - chunk, chunk):
        assert await stream.exchange(body_msg(raw[at : at + chunk], end_of_stream=False)) == []
    tail = len(raw) - (len(raw) - 1) % chunk - 1
    return await stream.exchange(body_msg(raw[tail:], end_of_stream=True))


def test_requested_reads_the_first_messages_protocol_config():
    assert duplex.requested(first(headers_msg()))
    buffered = headers_msg()
    buffered.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    assert not duplex.requested(buffered)
    assert not duplex.requested(headers_msg())  # no protocol_config: not a duplex gateway


def test_streamed_bodies_split_at_the_chunk_size():
    body = b"x" * (2 * CHUNK_BYTES + 5)
    replies = streamed_bodies("request_body", body, True)
    parts = [streamed(r) for r in replies]
    assert [len(p.body) for p in parts] == [CHUNK_BYTES, CHUNK_BYTES, 5]
    assert [p.end_of_stream for p in parts] == [False, False, True]
    assert b"".join(p.body for p in parts) == body
    empty = streamed_bodies("response_body", b"", True)
    assert len(empty) == 1 and streamed(empty[0], "response_body").end_of_stream
    exact = streamed_bodies("request_body", b"y" * CHUNK_BYTES, False)
    assert len(exact) == 1 and not streamed(exact[0]).end_of_stream


async def test_headers_are_answered_after_the_body_then_the_body_in_chunks():
    stream = new_stream()
    replies = await admitted(stream, chat(priority=-5))
    headers, *bodies = replies
    reply = parsed(headers)
    assert not reply.HasField("mode_override")
    common = reply.request_headers.response
    assert common.clear_route_cache
    set_headers = header_dict(common.header_mutation)
    endpoint = set_headers["x-gateway-destination-endpoint"]
    assert endpoint in ("127.0.0.1:7001", "127.0.0.1:7002")  # one endpoint: no fallbacks
    assert "content-length" not in set_headers  # Envoy streams the body: no length
    assert "authorization" in common.header_mutation.remove_headers
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == endpoint
    assert len(bodies) == 1 and streamed(bodies[0]).end_of_stream
    sent = orjson.loads(streamed(bodies[0]).body)
    assert sent["priority"] == 0 and sent["messages"] == chat()["messages"]
    assert stream.holds_admission and not stream.done
    assert stream.metrics.messages.values[("request_body",)] > 1  # every chunk counted


async def test_a_large_body_goes_back_in_several_chunks():
    stream = new_stream()
    body = chat(messages=[{"role": "user", "content": "word " * 30_000}])
    _, *bodies = await admitted(stream, body, chunk=16_384)
    assert len(bodies) == 3
    assert [streamed(b).end_of_stream for b in bodies] == [False, False, True]
    assert orjson.loads(b"".join(streamed(b).body for b in bodies))["messages"] == body["messages"]


async def test_trailers_end_the_body_and_are_answered_last():
    stream = new_stream()
    assert await stream.exchange(first(headers_msg())) == []
    assert await stream.exchange(body_msg(orjson.dumps(chat()), end_of_stream=False)) == []
    replies = await stream.exchange(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert parsed(replies[0]).HasField("request_headers")
    assert not streamed(replies[1]).end_of_stream  # the trailers end the request
    assert parsed(replies[-1]).HasField("request_trailers")


async def test_a_refusal_is_one_immediate_response():
    stream = new_stream()
    replies = await admitted(stream, {"model": "nope", "messages": []})
    assert len(replies) == 1 and parsed(replies[0]).immediate_response.status.code == 400
    assert stream.done and not stream.holds_admission
    stream = new_stream()
    replies = await stream.exchange(first(headers_msg(key="sk-wrong")))
    assert parsed(replies[0]).immediate_response.status.code == 401 and stream.done


async def test_a_body_over_the_limit_is_413_before_its_end():
    config = make_config(requests_per_second=100)
    config = config.model_copy(update={
        "server": config.server.model_copy(update={"max_body_bytes": 1000})})
    stream = new_stream(config)
    assert await stream.exchange(first(headers_msg())) == []
    replies = await stream.exchange(body_msg(b"x" * 1001, end_of_stream=False))
    assert parsed(replies[0]).immediate_response.status.code == 413 and stream.done


async def test_a_body_in_too_many_pieces_is_400_before_its_end(monkeypatch):
    """Each piece is a gRPC message for kvgate to read, and the client picks them: a body
    of 1-byte HTTP/2 frames cost ~30 µs of kvgate's CPU per byte."""
    from extproc import duplex

    monkeypatch.setattr(duplex, "MAX_BODY_PIECES", 5)
    stream = new_stream()
    assert await stream.exchange(first(headers_msg())) == []
    for _ in range(5):
        assert await stream.exchange(body_msg(b"{", end_of_stream=False)) == []
    replies = await stream.exchange(body_msg(b" ", end_of_stream=False))
    answer = parsed(replies[0]).immediate_response
    assert answer.status.code == 400 and stream.done and not stream.holds_admission
    assert orjson.loads(answer.body)["error"]["code"] == "body_too_fragmented"


async def test_bodies_gathered_together_are_bounded_and_let_go_on_every_end():
    """In this mode kvgate gathers each body itself, and clients that send most of a body
    and stall kept it in kvgate's memory, without a bound over all of them."""
    bodies = duplex.HeldBodies(limit=1000)
    config = make_config(requests_per_second=100, max_concurrency=5)

    def stream():
        director = build_director(config, MemoryStore())
        return DuplexStream(director, Metrics(), config.server, ReportDesk(), bodies=bodies)

    stalled = stream()
    assert await stalled.exchange(first(headers_msg())) == []
    assert await stalled.exchange(body_msg(b"x" * 800, end_of_stream=False)) == []
    late = stream()
    assert await late.exchange(first(headers_msg())) == []
    replies = await late.exchange(body_msg(b"{" * 300, end_of_stream=False))
    answer = parsed(replies[0]).immediate_response
    assert answer.status.code == 503 and late.done and bodies.held == 800
    assert orjson.loads(answer.body)["error"]["code"] == "gateway_overloaded"
    assert header_dict(answer.headers)["retry-after"] == "1"
    stalled.let_go()  # its stream ended (the server lets go of what it still gathered)
    assert bodies.held == 0
    whole = stream()
    replies = await admitted(whole, chat(), chunk=40)
    assert parsed(replies[0]).HasField("request_headers") and bodies.held == 0


async def test_the_server_lets_go_of_a_body_whose_stream_ended_before_its_end():
    handler, *_ = handler_for(first(headers_msg()), body_msg(b"x" * 50, end_of_stream=False),
                              body_mode="full_duplex", then_end=True)
    processor = handler.ag_frame.f_locals["self"]  # the ExternalProcessor it belongs to
    assert [reply async for reply in handler] == []
    assert processor.bodies.held == 0


async def test_out_of_order_messages_get_a_clear_400():
    stream = new_stream()  # a body before any headers
    replies = await stream.exchange(first(body_msg(orjson.dumps(chat()))))
    reply = parsed(replies[0]).immediate_response
    assert reply.status.code == 400 and b"protocol_error" in reply.body and stream.done
    stream = new_stream()  # trailers before any headers
    replies = await stream.exchange(first(pb.ProcessingRequest(
        request_trailers=pb.HttpTrailers())))
    assert parsed(replies[0]).immediate_response.status.code == 400
    stream = new_stream()  # headers twice
    await stream.exchange(first(headers_msg()))
    replies = await stream.exchange(headers_msg())
    assert parsed(replies[0]).immediate_response.status.code == 400
    stream = new_stream()  # a message of no phase
    replies = await stream.exchange(first(pb.ProcessingRequest()))
    assert parsed(replies[0]).immediate_response.status.code == 400
    stream = new_stream()  # a second body after the admission
    await admitted(stream, chat())
    replies = await stream.exchange(body_msg(b"{}"))
    assert parsed(replies[0]).immediate_response.status.code == 400


@pytest.mark.parametrize("content_type", ["text/event-stream", "Text/Event-Stream"])
async def test_a_streamed_response_is_echoed_metered_and_ends_the_stream(content_type):
    stream = new_stream()
    await admitted(stream, chat(stream=True))
    reply = parsed((await stream.exchange(response_headers(content_type)))[0])
    added = header_dict(reply.response_headers.response.header_mutation)
    assert "x-ratelimit-remaining-requests" in added
    events = [{"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(3)]
    body = sse([*events, {"choices": [], "usage": USAGE}])
    passed = []
    for at in range(0, len(body), 11):
        assert not stream.done
        piece = body[at : at + 11]
        replies = await stream.exchange(response_body(piece, end_of_stream=at + 11 >= len(body)))
        assert len(replies) == 1
        passed.append(streamed(replies[0], "response_body").body)
        assert stream.response.started  # the first chunk: prefill is done
    assert streamed(replies[0], "response_body").end_of_stream and stream.done
    assert b"".join(passed) == sse(events)  # kvgate's usage event, and only it, removed
    assert stream.response.usage.total == 17 and stream.response.events == 3


async def test_keep_alive_comments_before_the_first_token_do_not_end_prefill():
    """A ping (an SSE comment) before the first token used to count as the first chunk:
    the scheduler took prefill for done. The first data line does; an unterminated last
    usage event is read at the body's end."""
    stream = new_stream()
    await admitted(stream, chat(stream=True))
    await stream.exchange(response_headers("text/event-stream"))
    for ping in (b": ping\n\n", b"event: message\n", b"da"):
        await stream.exchange(response_body(ping))
        assert not stream.response.started or ping == b"da"
    assert stream.response.started  # the chunk in which the data line began
    await stream.exchange(response_body(
        b'ta: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: '
        + orjson.dumps({"choices": [], "usage": USAGE}), end_of_stream=True))
    assert stream.done and stream.response.usage.total == 17


async def test_a_byte_order_mark_and_fields_before_the_data_are_read_through():
    """A stream that opens with a UTF-8 byte order mark, and whose events put an event:
    line before their data: the first token is its first data line, and each event counts
    (the estimate an error answer is charged)."""
    stream = new_stream()
    await admitted(stream, chat(stream=True))
    await stream.exchange(response_headers("text/event-stream"))
    await stream.exchange(response_body(b"\xef\xbb"))
    await stream.exchange(response_body(b"\xbf: ping\n\nevent: message\n"))
    assert not stream.response.started
    body = b"".join(b"event: message\ndata: " + orjson.dumps(e) + b"\n\n" for e in (
        {"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]}))
    await stream.exchange(response_body(body[15:]))
    assert stream.response.started
    await stream.exchange(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    assert stream.done and stream.response.usage is None and stream.response.events == 2


async def test_a_compressed_stream_passes_unread_its_first_chunk_the_first_token():
    """As the Lua meter: a compressed answer (a proxy's) cannot be read, so its first chunk
    stands for its first token, and it passes untouched. Since the first token became the
    first data line, such a stream never started: a client that left mid-answer was charged
    its prompt alone, and the scheduler took the request for one still prefilling."""
    import gzip

    stream = new_stream()
    await admitted(stream, chat(stream=True))
    await stream.exchange(response_headers("text/event-stream", content_encoding="gzip"))
    body = gzip.compress(sse([{"choices": [{"delta": {"content": "a"}}]},
                              {"choices": [], "usage": USAGE}]))
    replies = await stream.exchange(response_body(body[:10]))
    assert stream.response.started
    replies += await stream.exchange(response_body(body[10:], end_of_stream=True))
    assert b"".join(streamed(r, "response_body").body for r in replies) == body
    assert stream.done and stream.response.usage is None and stream.response.events == 0


@pytest.mark.parametrize("content_type", ["text/event-stream", "application/json"])
async def test_a_non_streamed_answer_is_read_as_json_whatever_its_type(content_type):
    """As the Lua meter (a meter of "json" reads JSON): an engine that labels a request's
    non-streamed answer text/event-stream was read as SSE, its usage not found (the tenant
    charged its reservation) and its first chunk a first token."""
    stream = new_stream()
    await admitted(stream, chat())
    await stream.exchange(response_headers(content_type))
    body = orjson.dumps({"choices": [{"message": {"content": "data: x"}}], "usage": USAGE})
    replies = await stream.exchange(response_body(b"data: " + body[:20]))
    assert not stream.response.started
    replies += await stream.exchange(response_body(body[20:], end_of_stream=True))
    assert b"".join(streamed(r, "response_body").body for r in replies) == b"data: " + body
    assert stream.done and stream.response.usage.total == 17
    assert stream.response.events == 0  # (the end counts as started: done_reported)


async def test_a_client_asking_for_usage_keeps_it_and_json_usage_is_read():
    stream = new_stream()
    await admitted(stream, chat(stream=True, stream_options={"include_usage": True}))
    await stream.exchange(response_headers("text/event-stream"))
    body = sse([{"choices": [], "usage": USAGE}])
    replies = await stream.exchange(response_body(body, end_of_stream=True))
    assert streamed(replies[0], "response_body").body == body
    stream = new_stream()
    await admitted(stream, chat())
    await stream.exchange(response_headers())
    body = orjson.dumps({"choices": [], "usage": USAGE})
    replies = await stream.exchange(response_body(body[:20]))
    replies += await stream.exchange(response_body(body[20:]))
    replies += await stream.exchange(response_body(b"", end_of_stream=True))
    assert b"".join(streamed(r, "response_body").body for r in replies) == body
    assert stream.done and stream.response.usage.total == 17


async def test_several_choices_take_only_the_usage_only_events_usage():
    """n > 1 with running usage in every chunk (``continuous_usage_stats``): a stream cut
    before its usage-only event has no usage (charged its reservation), not the last
    chunk's count of one choice; the usage-only event's counts both."""
    chunks = [{"choices": [{"index": c, "delta": {"content": "t"}}],
               "usage": {"prompt_tokens": 13, "completion_tokens": 1}} for c in (0, 1)]
    options = {"include_usage": True, "continuous_usage_stats": True}
    for last, total in (({"choices": [], "usage": {"prompt_tokens": 13,
                                                   "completion_tokens": 2}}, 15),
                        ({"error": {"message": "engine failed"}}, None)):
        stream = new_stream()
        await admitted(stream, chat(stream=True, n=2, stream_options=options))
        await stream.exchange(response_headers("text/event-stream"))
        await stream.exchange(response_body(sse([*chunks, last]), end_of_stream=True))
        usage = stream.response.usage
        assert (usage and usage.total) == total


async def test_response_trailers_end_the_response():
    stream = new_stream()
    await admitted(stream, chat())
    await stream.exchange(response_headers())
    await stream.exchange(response_body(b'{"usage": {"prompt_tokens": 1}}'))
    replies = await stream.exchange(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert parsed(replies[-1]).HasField("response_trailers") and stream.done
    assert stream.response.usage.total == 1


async def test_a_streamed_mode_response_is_answered_with_plain_body_mutations():
    stream = new_stream()
    await stream.exchange(first(headers_msg(), response_mode=ProcessingMode.STREAMED))
    raw = orjson.dumps(chat())
    await stream.exchange(body_msg(raw, end_of_stream=True))
    await stream.exchange(response_headers())
    replies = await stream.exchange(response_body(b"{}", end_of_stream=True))
    assert parsed(replies[0]).response_body.response.body_mutation.body == b"{}"


async def test_a_headers_only_request_is_answered_at_once_and_its_response_echoed():
    stream = new_stream()
    replies = await stream.exchange(first(headers_msg(path="/health", end_of_stream=True)))
    assert len(replies) == 1 and stream.holds_admission
    await stream.exchange(response_headers())
    replies = await stream.exchange(response_body(b"ok", end_of_stream=True))
    assert streamed(replies[0], "response_body").body == b"ok" and stream.done


async def test_a_failure_reading_the_response_passes_it_on():
    stream = new_stream()
    await admitted(stream, chat(stream=True))
    await stream.exchange(response_headers("text/event-stream"))

    def broken(chunk):
        raise RuntimeError("boom")

    stream._meter = type("Broken", (), {"sse": True, "feed": staticmethod(broken)})()
    replies = await stream.exchange(response_body(b"data: x\n\n", end_of_stream=True))
    assert streamed(replies[0], "response_body").body == b"data: x\n\n" and stream.done
    assert stream.metrics.stream_errors.values[("internal",)] == 1


# -- through the gRPC server: which streams are full duplex --------------------------------


async def exchange_over_grpc(server_config, with_protocol_config: bool):
    """Headers, then the body in two chunks, to a real server: the replies received."""
    server = KvgateServer(server_config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=pb.ProcessingRequest.SerializeToString,
                response_deserializer=pb.ProcessingResponse.FromString)()
            headers = headers_msg()
            await call.write(first(headers) if with_protocol_config else headers)
            raw = orjson.dumps(chat())
            await call.write(body_msg(raw[:10], end_of_stream=False))
            await call.write(body_msg(raw[10:], end_of_stream=True))
            replies = [await call.read() for _ in range(2)]
            call.cancel()
        return replies
    finally:
        await server.stop(grace=0)


async def test_the_server_speaks_full_duplex_when_envoy_says_so_or_when_told():
    def config(**server):
        base = make_config(requests_per_second=100)
        return base.model_copy(update={"server": base.server.model_copy(
            update={"grpc_port": 0, "admin_port": None, **server})})

    for server_config, said in ((config(), True), (config(body_mode="full_duplex"), False)):
        headers, body = await exchange_over_grpc(server_config, said)
        assert "x-gateway-destination-endpoint" in header_dict(
            headers.request_headers.response.header_mutation)
        assert orjson.loads(body.request_body.response.body_mutation.streamed_response.body)
    # not said, not told: kvgate's own (buffered) protocol answers the headers at once
    headers, body = await exchange_over_grpc(config(), False)
    assert headers.HasField("mode_override")
    assert body.HasField("immediate_response")  # a body in two parts is not that protocol


async def test_a_stream_reset_after_its_last_reply_is_charged_its_usage():
    """Envoy may reset the stream once it has the last response chunk, before kvgate's
    handler resumes from that reply; gRPC then drops the handler there (closing it at its
    yield). The request ended normally and is charged what the engine reported."""
    handler, director, metrics, released = handler_for(
        first(headers_msg()), body_msg(orjson.dumps(chat()), end_of_stream=True),
        response_headers(), response_body(orjson.dumps({"usage": USAGE}), True),
        body_mode="full_duplex")
    replies = [await anext(handler) for _ in range(4)]  # the last: the response's end
    assert streamed(replies[-1], "response_body").end_of_stream
    await handler.aclose()
    assert metrics.stream_errors.values == {} and released == [17]
    assert director.active == {}


@pytest.mark.parametrize("body_mode", ["auto", "full_duplex"])
async def test_a_stream_dropped_at_its_routing_reply_is_released_at_once_and_charged_nothing(
        body_mode):
    """gRPC drops the handler at the routing reply's yield when it cannot write that reply
    (Envoy gave up on the stream — its message timeout, or a reset — as kvgate admitted the
    request): the request never went upstream. Nothing stays admitted (no meter report can
    come) and nothing is charged."""
    messages = ((headers_msg(), body_msg(orjson.dumps(chat()))) if body_mode == "auto" else
                (first(headers_msg()), body_msg(orjson.dumps(chat()), end_of_stream=True)))
    handler, director, metrics, released = handler_for(*messages, body_mode=body_mode)
    if body_mode == "auto":
        await anext(handler)  # the headers' answer
    await anext(handler)  # routed (full duplex: the headers' answer routes)
    assert len(director.active) == 1
    await handler.aclose()
    assert director.active == {} and released == [0]
    assert metrics.stream_errors.values == {("envoy_closed",): 1}
    assert metrics.charges.values == {("not_sent",): 1}


async def test_a_routed_stream_dropped_at_a_later_reply_is_charged_as_cut_off():
    """Full duplex: once gRPC took the routing reply, a stream dropped at a later reply (a
    body chunk) may have reached its engine: charged as cut off, as before."""
    handler, director, metrics, released = handler_for(
        first(headers_msg()), body_msg(orjson.dumps(chat()), end_of_stream=True),
        body_mode="full_duplex")
    await anext(handler)  # routed
    await anext(handler)  # the body's first chunk
    await handler.aclose()
    assert director.active == {} and len(released) == 1 and released[0] > 0
    assert metrics.charges.values == {("cut_off",): 1}


async def test_a_client_that_hangs_up_at_done_is_charged_its_usage():
    """openai-python stops reading at ``[DONE]`` and hangs up: when the engine's end of the
    body had not reached Envoy by then, Envoy ended the stream before kvgate saw the
    response end, and it was charged as cut off (its reservation) with its usage read."""
    body = sse([{"choices": [{"delta": {"content": "t "}}]}, {"choices": [], "usage": USAGE}])
    handler, director, metrics, released = handler_for(
        first(headers_msg()), body_msg(orjson.dumps(chat(stream=True)), end_of_stream=True),
        response_headers("text/event-stream"), response_body(body, False),
        body_mode="full_duplex", then_end=True)
    async for _reply in handler:
        pass
    assert director.active == {} and released == [17]
    assert metrics.charges.values == {("usage",): 1}


@pytest.mark.parametrize("ended", ["closed", "reset"])
async def test_a_meter_report_just_after_the_streams_end_is_charged_as_reported(ended):
    """The meter sends its done report without waiting for the answer: it may reach kvgate
    just after Envoy ended the request's stream (closed it, or reset it: gRPC cancels the
    handler as it waits for Envoy's next message). The release waits for it and charges the
    engine's usage, not the reservation, and the stream ended normally."""
    desk = ReportDesk()
    handler, director, metrics, released = handler_for(
        headers_msg(), body_msg(orjson.dumps(chat())), body_mode="auto", desk=desk,
        then_end=ended == "closed")
    await anext(handler)
    await anext(handler)  # routed: the stream waits for Envoy
    (lease,) = director.active
    if ended == "closed":
        with pytest.raises(StopAsyncIteration):
            await anext(handler)
    else:
        waiting = asyncio.ensure_future(anext(handler))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert len(director.active) == 1 and not released
    body = orjson.dumps({"usage": USAGE, "events": 0})
    assert desk.receive(f"/done/{lease}".encode(), desk.key.encode(), body).startswith(
        b"HTTP/1.1 204")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert director.active == {} and released == [USAGE["total_tokens"]]
    assert metrics.stream_errors.values == {}


def handler_for(*messages, body_mode: str, desk: ReportDesk | None = None,
                then_end: bool = False):
    """``ExternalProcessor.Process`` on Envoy's ``messages`` (then a stream that stays
    open, or with ``then_end`` that Envoy ends), with the releases recorded: (handler,
    director, metrics, tokens released)."""
    config = make_config(requests_per_second=100, max_concurrency=5)
    config = config.model_copy(update={"server": config.server.model_copy(
        update={"body_mode": body_mode})})
    director = build_director(config, MemoryStore())
    released = []
    release = director.release

    async def recorded(admission, used, output=None, **kwargs):
        released.append(used)
        await release(admission, used, output, **kwargs)

    director.release = recorded
    incoming: asyncio.Queue = asyncio.Queue()
    for message in messages:
        incoming.put_nowait(message)

    if then_end:
        incoming.put_nowait(None)

    async def envoy():
        while (message := await incoming.get()) is not None:
            yield message

    metrics = Metrics()
    handler = ExternalProcessor(director, metrics, config, desk or ReportDesk()).Process(
        envoy(), None)
    return handler, director, metrics, released
