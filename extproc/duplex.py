"""kvgate as a Gateway API Inference Extension endpoint picker: the full-duplex protocol.

Gateways that implement the Inference Extension (Envoy Gateway, kgateway, Istio, GKE)
configure the picker's ext_proc filter themselves, and not as kvgate's own bootstrap does:
request and response bodies ``FULL_DUPLEX_STREAMED``, response headers and trailers sent,
no Lua meter. kvgate tells the two apart on a stream's first message, where Envoy states
its body modes (``protocol_config``): ``FULL_DUPLEX_STREAMED`` request bodies get a
:class:`DuplexStream`, anything else the usual ``stream.RequestStream`` at its usual cost.

In this mode Envoy sends the request headers, then the body in chunks without waiting
(``end_of_stream`` on the last; trailers may follow instead), and forwards nothing upstream
until the processor has answered the headers. kvgate reads the whole body, decides as
usual, and then answers, in order: the headers (the routing header
``x-gateway-destination-endpoint``, its ``envoy.lb`` metadata, ``clear_route_cache``), the
possibly rewritten body as ``streamed_response`` chunks of at most :data:`CHUNK_BYTES`
(the last with ``end_of_stream``), and the trailers if any. A refusal is one
ImmediateResponse, as in kvgate's own mode. On the way back every response chunk is sent
back as it came (with kvgate's injected usage event removed), read on the way by
``meter.ResponseMeter``: a stream's first token, the usage, the end — after which
kvgate ends the RPC and releases the request (or when Envoy ends the stream first: the
client left).

It costs more gRPC messages than kvgate's own configuration (2 per request whatever the
answer's length): a message per request body chunk, the response headers, and one per
response chunk each way — a streamed answer costs a message per chunk the engine sends.
"""

from __future__ import annotations

import logging

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import messages
from extproc.director import Admission
from extproc.headers import ENGINE_CONTROL_HEADERS
from extproc.meter import ResponseMeter
from extproc.openai import BadRequest
from extproc.rejections import admitted_ratelimit_headers, client_error, overloaded
from extproc.stream import STRIPPED_HEADERS, RequestStream

log = logging.getLogger(__name__)

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
# The Inference Extension's own chunk size: some Envoy builds cap a streamed chunk at 64 KiB.
CHUNK_BYTES = 62_000
MAX_BODY_PIECES = 4096
"""The most pieces a request body may arrive in. Each is one gRPC message from Envoy (~30 µs
of kvgate's CPU), and a client picks its pieces: an HTTP/2 body in 1-byte DATA frames cost
~2 s of CPU per 60,000, shared with every tenant's admissions. Envoy passes a body on as it
reads it (16 KiB and up from a client that sends whole frames): a 1 MiB body is ~64."""
HELD_BODIES = 64
"""How many bodies of ``server.max_body_bytes`` the process's full-duplex streams may hold
together while they gather them (:class:`HeldBodies`)."""
_RESPONSE_HEADERS = frozenset((":status", "content-type", "content-encoding"))


def _metered_target(target: str, path: str) -> str:
    """The request target to send upstream: the ``path`` kvgate metered (``route_path``:
    decoded, slashes merged, dot segments resolved, no trailing slash) with the client's
    query string. kvgate's own bootstrap has Envoy normalise the path the same way; a
    gateway's route may not, and an engine then routed the raw path elsewhere: vLLM answers
    ``/v1/chat/completions/`` with a redirect, which the client follows into a second
    admission, and ``/v1/x/../chat/completions`` with a 404 (both admitted and charged)."""
    _, mark, query = target.partition("?")
    return path + mark + query


class HeldBodies:
    """The request-body bytes the process's full-duplex streams hold while they gather
    them, at most ``limit`` together. In this mode kvgate, not Envoy, buffers a body until
    it is whole, and a client that sends most of a body and stalls keeps it there until the
    gateway's stream timeout: without a bound, many such clients took kvgate's memory
    without limit (each up to ``server.max_body_bytes``). A body that would pass the bound
    is refused with a retryable 503 and what it held is let go."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.held = 0
        self.limit = limit

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


def requested(first: pb.ProcessingRequest) -> bool:
    """Does Envoy stream this request's body full duplex? (It states its body modes on a
    stream's first message.)"""
    return first.protocol_config.request_body_mode == FULL_DUPLEX


def streamed_bodies(phase: str, body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """``body`` as ``streamed_response`` body mutations of the ``phase`` (``request_body`` or
    ``response_body``) in chunks of at most CHUNK_BYTES; ``end_of_stream`` on the last.
    An empty body is one empty chunk: every chunk Envoy sent gets an answer."""
    replies = []
    last = max(len(body) - 1, 0) // CHUNK_BYTES * CHUNK_BYTES
    for at in range(0, last + 1, CHUNK_BYTES):
        reply = pb.ProcessingResponse()
        streamed = getattr(reply, phase).response.body_mutation.streamed_response
        streamed.body = body[at : at + CHUNK_BYTES]
        streamed.end_of_stream = end_of_stream and at == last
        replies.append(reply)
    return replies


def _trailers(phase: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})


class DuplexStream(RequestStream):
    """One ext_proc stream from an Inference Extension gateway. The admission pipeline is
    ``RequestStream``'s: this class gathers the body for it, holds back its headers answer
    until the decision, and answers the response chunks. :meth:`exchange` answers each of
    Envoy's messages with any number of replies (none while the body is still coming)."""

    METERED_BY_LUA = False  # kvgate reads the response itself
    # a gateway's route does not remove the headers an engine obeys (x-vllm-priority jumps
    # vLLM's queue): kvgate does, in its headers answer
    REMOVED_HEADERS = (*STRIPPED_HEADERS, *ENGINE_CONTROL_HEADERS)

    __slots__ = ("_answered", "_bodies", "_chunks", "_final", "_held", "_meter", "_new_body",
                 "_request_ended", "_response_mode", "_size", "_streamed", "_strip", "_target")

    def __init__(self, *args, bodies: HeldBodies | None = None,  # type: ignore[no-untyped-def]
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # shared by the process's streams (the server's); alone: a bound of its own
        self._bodies = bodies or HeldBodies(HELD_BODIES * self.settings.max_body_bytes)
        self._held: messages.Reply | None = None  # the headers answer, until the decision
        self._chunks: list[bytes] = []
        self._size = 0  # of the body gathered so far (held in _bodies until let go)
        self._new_body: bytes | None = None  # the body to send upstream, once admitted
        self._request_ended = False  # the request body (and trailers) have all arrived
        self._meter: ResponseMeter | None = None
        self._answered = False  # the response is the engine's answer (2xx), not an error
        self._strip = False  # remove the usage event kvgate asked the engine for
        self._final = False  # several choices: only the usage-only event's usage counts
        self._streamed = False  # the request asked for a stream (its answer may be SSE)
        self._response_mode = FULL_DUPLEX  # how Envoy sends the response body
        self._target = "/"  # the request's :path as the client sent it

    async def exchange(self, message: pb.ProcessingRequest) -> list[messages.Reply]:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            self._response_mode = message.protocol_config.response_body_mode
        if kind == "request_headers":
            return await self._on_headers(message)
        if kind == "request_body":
            return await self._on_body_chunk(message.request_body)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind is not None and kind.startswith("response"):
            self.metrics.messages.add((kind,))
            try:
                return self._on_response(kind, message)
            except Exception:  # never fail a response kvgate already let through
                log.exception("ext_proc %s failed", kind, extra=self._context())
                self.metrics.stream_errors.add(("internal",))
                self._meter = None
                return self._pass(kind, message)
        return [await self.handle(message)]  # a message of no phase: the usual 400

    # -- the request ----------------------------------------------------------------------

    async def _on_headers(self, message: pb.ProcessingRequest) -> list[messages.Reply]:
        reply = await self.handle(message)
        if self.done or self.admission is not None:  # refused, or decided on headers alone
            self._request_ended = True
            return [reply]
        self._held = reply
        return []

    async def _on_body_chunk(self, body: pb.HttpBody) -> list[messages.Reply]:
        if self._request_ended and self.admission is not None and self.request is None:
            # decided on its headers alone (GET /health with a body, say): in this mode
            # Envoy sends the body anyway, and it goes on as it came
            self.metrics.messages.add(("request_body",))
            return list(streamed_bodies("request_body", body.body, body.end_of_stream))
        if self._held is None or self._request_ended:  # before the headers, or after the end
            return [await self.handle(pb.ProcessingRequest(request_body=body))]
        chunk = body.body
        if not self._bodies.take(len(chunk)):
            self.metrics.messages.add(("request_body",))
            return [self._refuse_overload()]
        self._chunks.append(chunk)
        self._size += len(chunk)
        if not body.end_of_stream and len(self._chunks) > MAX_BODY_PIECES:
            self.metrics.messages.add(("request_body",))
            return [self._refuse_pieces()]
        if not body.end_of_stream and self._size <= self.settings.max_body_bytes:
            self.metrics.messages.add(("request_body",))
            return []  # answered once the whole body is decided
        return await self._decide(end_of_stream=True)

    def let_go(self) -> None:
        """Give back what the body gathered so far holds of the process's bound (the body
        is decided or refused, or the stream ended before its end)."""
        self._bodies.give(self._size)
        self._chunks, self._size = [], 0

    def _refuse_overload(self) -> messages.Reply:
        """The process holds as many gathered bodies as it may: 503, retryable."""
        self._request_ended, self._held = True, None
        self.let_go()
        self._count("shed", "gateway_overloaded")
        return self._answer(*overloaded(
            "the gateway holds as many request bodies as it may; retry later"),
            details="gateway_overloaded")

    def _refuse_pieces(self) -> messages.Reply:
        """A body in more than :data:`MAX_BODY_PIECES` pieces: 400 before reading on."""
        self._request_ended, self._held = True, None
        self.let_go()
        error = BadRequest(f"the request body came in more than {MAX_BODY_PIECES} pieces; "
                           "send it in fewer, larger writes", code="body_too_fragmented")
        self._count("invalid", "body_too_fragmented")
        return self._answer(*client_error(error), details="body_too_fragmented")

    async def _on_request_trailers(self) -> list[messages.Reply]:
        if self._request_ended:  # the body is answered already
            self.metrics.messages.add(("request_trailers",))
            return [_trailers("request_trailers")]
        if self._held is None:  # trailers before any headers: the usual 400
            return [await self.handle(pb.ProcessingRequest(
                request_body=pb.HttpBody(end_of_stream=True)))]
        # the trailers end the body (counted as its one body message): decide, then
        # answer them last
        replies = await self._decide(end_of_stream=False)
        return replies if self.done else [*replies, _trailers("request_trailers")]

    async def _decide(self, *, end_of_stream: bool) -> list[messages.Reply]:
        """The whole body is here (or over the limit): the usual admission, as if Envoy
        had buffered it (counted as the one request_body message of that path)."""
        self._request_ended = True
        whole = b"".join(self._chunks)
        self.let_go()  # (the admission holds it now, as any request's body)
        reply = await self.handle(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=whole, end_of_stream=True)))
        if self.done or self._new_body is None:  # refused
            return [reply]
        held, self._held = self._held, None
        headers = pb.ProcessingResponse.FromString(messages.serialize_reply(held or b""))
        headers.ClearField("mode_override")  # Envoy ignores it in this mode: say nothing
        body, self._new_body = self._new_body, None
        return [headers.SerializeToString() + messages.serialize_reply(reply),
                *streamed_bodies("request_body", body, end_of_stream)]

    def _route(self, admission: Admission, *, body: bytes | None, in_body_phase: bool,
               meter: str = "") -> bytes:
        """Routing goes in the headers answer here; the body follows it in chunks; and no
        Lua meter runs (kvgate reads the response itself). One endpoint, not kvgate's list
        with fallbacks: the protocol allows a list, but a gateway routing on the header
        with an ORIGINAL_DST cluster (Envoy Gateway's way) takes only a single address."""
        self._new_body = body
        self._strip = meter == "sse-strip"
        self._final = meter == "sse-final"
        self._streamed = meter not in ("", "json")
        admission.endpoints = admission.endpoints[:1]
        reply = super()._route(admission, body=None, in_body_phase=False)
        metered = _metered_target(self._target, self.path)
        if metered != self._target:
            reply += messages.set_request_header(":path", metered)
        return reply

    def _read_headers(self, values: dict[str, str]) -> tuple[bool, bool]:
        """As any stream's, keeping the client's :path: ``_route`` sends the metered one
        upstream where they differ (:func:`_metered_target`)."""
        self._target = values.get(":path", "/")
        return super()._read_headers(values)

    # -- the response ---------------------------------------------------------------------

    def _on_response(self, kind: str, message: pb.ProcessingRequest) -> list[messages.Reply]:
        if kind == "response_headers":
            headers = message.response_headers
            values, _ = messages.header_map(headers, _RESPONSE_HEADERS)
            if self.response is not None:
                # as the Lua meter: an answer to a request that asked for no stream is JSON,
                # whatever type it claims (its usage is read, and it starts nothing)
                sse = (self._streamed
                       and "text/event-stream" in values.get("content-type", "").lower())
                # as the Lua meter: a compressed answer (a proxy's) passes unread
                readable = values.get("content-encoding", "identity") == "identity"
                self._meter = ResponseMeter(sse=sse, strip=self._strip, readable=readable,
                                            final=self._final)
                self._answered = values.get(":status", "").startswith("2")
            reply = pb.ProcessingResponse()
            admission = self.admission
            if admission is not None:  # as kvgate's own route adds them
                messages.fill_mutation(reply.response_headers.response.header_mutation,
                                       admitted_ratelimit_headers(admission.admit.remaining))
            else:
                reply.response_headers.SetInParent()
            if headers.end_of_stream:
                self._finish_response()
            return [reply]
        if kind == "response_body":
            body = message.response_body
            chunk = body.body
            meter = self._meter
            if meter is not None:
                started = meter.started
                chunk = meter.feed(chunk)
                if meter.started and not started:  # a data line began: prefill is done
                    self.first_reported()
                if meter.ended:  # [DONE]: its client may hang up before the body's end
                    self.done_reported(meter.usage, meter.events, self._answered)
            if body.end_of_stream:
                chunk += self._finish_response()
            return self._response_chunk(chunk, body.end_of_stream)
        # response trailers: the body ended without end_of_stream
        held = self._finish_response()
        replies: list[messages.Reply] = []
        if held:
            replies += self._response_chunk(held, False)
        return [*replies, _trailers("response_trailers")]

    def _pass(self, kind: str, message: pb.ProcessingRequest) -> list[messages.Reply]:
        """The response message answered unread (after a failure reading it)."""
        if kind == "response_body":
            body = message.response_body
            if body.end_of_stream:
                self._finish_response()
            return self._response_chunk(body.body, body.end_of_stream)
        if kind == "response_trailers" or message.response_headers.end_of_stream:
            self._finish_response()
        return [pb.ProcessingResponse(**{kind: pb.TrailersResponse() if kind.endswith("trailers")
                                         else pb.HeadersResponse()})]

    def _response_chunk(self, chunk: bytes, end_of_stream: bool) -> list[messages.Reply]:
        if self._response_mode == FULL_DUPLEX:
            return list(streamed_bodies("response_body", chunk, end_of_stream))
        reply = pb.ProcessingResponse()  # STREAMED or BUFFERED: replace the chunk's bytes
        reply.response_body.response.body_mutation.body = chunk
        return [reply]

    def _finish_response(self) -> bytes:
        """The response has ended: report it (so the release charges the real usage) and
        end the RPC after this answer. The bytes still held back go on with it."""
        meter, self._meter = self._meter, None
        held = b""
        if meter is not None:
            held = meter.finish()
            self.done_reported(meter.usage, meter.events, self._answered)
        self.done = True
        return held
