"""One ext_proc stream = one HTTP request: the protocol state machine.

Envoy sends request headers, then the request body (BUFFERED, one message) for the requests
kvgate meters — or, with ``envoy.request_attributes``, the body alone with the headers kvgate
reads as attributes (``_on_attributes_and_body``); each message gets exactly one reply, and
any other order (only a hand-edited filter config sends one) is a 400. kvgate reads no
response over ext_proc — a streamed answer would cost one message per chunk — but keeps the
stream open (the bootstrap asks for response trailers, which an engine never sends, so no
message comes) until Envoy ends it with the response. Envoy's Lua meter reports the response
meanwhile (``reports.py``): the first token of a stream, then the usage at its end.
Whatever ends the stream — completion, an error, the client going away — ``close`` releases
what the request held, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from logging import DEBUG
from time import perf_counter

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import messages
from extproc.accounting import ResponseRecord, usage_ceiling
from extproc.config import Server, Tenant
from extproc.director import Admission, Director, Watch
from extproc.headers import DESTINATION_HEADER, EXT_PROC_HEADERS, REQUEST_ID_HEADER
from extproc.logs import new_request_id, usable_request_id
from extproc.metrics import Metrics
from extproc.openai import (
    MODELS_PATH,
    BadRequest,
    InferenceRequest,
    Usage,
    check_encoding,
    check_route,
    model_list,
    mutate_body,
    parse_body,
    prompt_field,
    route_path,
)
from extproc.rejections import (
    admitted_ratelimit_headers,
    client_error,
    internal_error,
    rejection,
    unavailable,
)
from extproc.reports import ReportDesk
from limiter import Cost, Reject
from limiter.stores import StoreUnavailable

log = logging.getLogger(__name__)

# Never sent upstream: a client's routing header (and every x-kvgate-* header it sent), and
# the tenant's API key — the routing reply sets the pool's own key where it has one.
STRIPPED_HEADERS = (DESTINATION_HEADER, "authorization")


def _usage_bound(cost: Cost) -> str:
    """kvgate.bound's usage for the Lua meter: ``prompt_max:output_max`` (what the request can
    have used; the usage it publishes is held to it), then ``:prompt:output``, the
    reservation, which it publishes until the real usage comes: a client that left
    mid-answer was charged nothing by the Rate Limit Service's stream-done charge."""
    return "{}:{}:{}:{}".format(*usage_ceiling(cost), cost.prompt_tokens, cost.max_output_tokens)


def _meter_mode(request: InferenceRequest, inject_usage: bool) -> str:
    """How Envoy's Lua meter reads the response: ``json``; ``sse``; ``sse-strip`` (it also
    removes the usage event kvgate asked for); ``sse-final`` for several choices (``n`` > 1),
    where only the usage-only event's usage is the whole: with ``continuous_usage_stats`` a
    chunk's running usage counts its own choice, and a stream cut before the usage-only
    event (vLLM's, after an error mid-answer) was charged one choice's count."""
    if not request.stream:
        return "json"
    if inject_usage:
        return "sse-strip"  # the engine was asked for no running usage (mutate_body)
    return "sse-final" if request.choices > 1 else "sse"


@functools.cache
def _wanted(class_header: str) -> frozenset[str]:
    return frozenset((*EXT_PROC_HEADERS, class_header))


class RequestStream:
    # Envoy's Lua meter reports this stream's response (DuplexStream reads its own)
    METERED_BY_LUA = True
    # removed from every request before it goes upstream (kvgate's rendered route removes
    # the engine-control headers itself; a gateway's route to an InferencePool does not)
    REMOVED_HEADERS = STRIPPED_HEADERS

    __slots__ = ("_released", "_report", "admission", "desk", "director", "done", "metrics", "path",
                 "request", "request_id", "requested_class", "response", "settings", "tenant",
                 "unsent", "watch")

    def __init__(self, director: Director, metrics: Metrics, settings: Server, desk: ReportDesk,
                 watch: Watch = contextlib.nullcontext):
        self.director = director
        self.metrics = metrics
        self.settings = settings
        self.desk = desk
        self.watch = watch  # while queued: notices the client leaving (server.Incoming)
        self.done = False  # the last reply this stream owes Envoy has been produced
        self.path = ""
        self.tenant: Tenant | None = None
        self.requested_class: str | None = None
        self.request: InferenceRequest | None = None
        self.admission: Admission | None = None
        self.response: ResponseRecord | None = None  # a metered response, once admitted
        # the routing reply never left kvgate (set by the server: gRPC could not write it,
        # Envoy had given up on the stream), so the request never went upstream
        self.unsent = False
        self.request_id = ""  # Envoy's x-request-id, or one kvgate made (log lines)
        self._released = False
        self._report: asyncio.Future[None] | None = None  # set by the done report, if awaited

    async def handle(self, message: pb.ProcessingRequest) -> messages.Reply:
        kind = message.WhichOneof("request")
        if kind is None:  # not one of the phases: nothing Envoy sends
            what = ("a message that does not parse" if message is messages.UNDECODABLE
                    else "a message of no phase")
            return self._answer(*client_error(_out_of_order(what)),
                                details="kvgate_protocol_error")
        self.metrics.messages.add((kind,))
        try:
            if kind == "request_headers":
                return await self._on_request_headers(message.request_headers)
            if kind == "request_body":
                if self.tenant is None and self.request is None:  # no headers phase
                    return await self._on_attributes_and_body(message)
                return await self._on_request_body(message.request_body)
            if kind == "request_trailers" and self.request is None and self.admission is None:
                raise self._no_body()
            return _continue_other(kind)
        except BadRequest as error:
            self._count("invalid", error.code or "bad_request")
            return self._answer(*client_error(error), details=error.code or "bad_request")
        except StoreUnavailable:
            self.metrics.stream_errors.add(("store_unavailable",))
            self._count("shed", "store_unavailable")
            return self._answer(*unavailable("admission limits are unavailable; retry later"),
                                details="kvgate_store_unavailable")
        except Exception:
            log.exception("ext_proc %s failed", kind, extra=self._context())
            self.metrics.stream_errors.add(("internal",))
            if kind.startswith("response"):
                return _continue_other(kind)
            self._count("error", "internal")
            return self._answer(*internal_error("kvgate could not process the request"),
                                details="kvgate_internal")

    # -- request path ----------------------------------------------------------------------

    async def _on_request_headers(self, headers: pb.HttpHeaders) -> messages.Reply:
        if self.tenant is not None:
            raise _out_of_order("request headers a second time")
        class_header = self.director.config.classification.header
        values, spoofed = messages.header_map(headers, _wanted(class_header))
        made_id, metered = self._read_headers(values)
        reply = await self._admit_headers(headers, values, spoofed, metered)
        if made_id and not self.done:  # the engine gets the id the log lines carry
            return (messages.serialize_reply(reply)
                    + messages.set_request_header(REQUEST_ID_HEADER, self.request_id))
        return reply

    def _read_headers(self, values: dict[str, str]) -> tuple[bool, bool]:
        """The request's id, class, path and tenant from its headers (or the attributes that
        carry them); whether kvgate made the id, and whether the path is metered."""
        request_id = values.get(REQUEST_ID_HEADER) or ""
        made_id = not usable_request_id(request_id)
        self.request_id = new_request_id() if made_id else request_id
        self.requested_class = values.get(self.director.config.classification.header)
        self.path = path = route_path(values.get(":path", "/"))
        self.tenant = self.director.authenticate(values.get("authorization"))
        metered = check_route(values.get(":method", ""), path)
        if metered:
            check_encoding(values.get("content-encoding"))
        return made_id, metered

    async def _admit_headers(self, headers: pb.HttpHeaders, values: dict[str, str],
                             spoofed: list[str], metered: bool) -> messages.Reply:
        director = self.director
        tenant = self.tenant
        assert tenant is not None
        remove = (*self.REMOVED_HEADERS, *spoofed) if spoofed else self.REMOVED_HEADERS
        length = values.get("content-length")
        if (length is not None and length.isascii() and length.isdigit()
                and int(length) > self.settings.max_body_bytes):
            raise _too_large(self.settings.max_body_bytes)
        reject = await director.precheck(tenant)
        if reject is not None:
            return self._refuse(reject)
        if not metered:
            return await self._admit_without_body(remove)
        if headers.end_of_stream:
            raise self._no_body()
        return messages.continue_request_headers(remove)

    async def _on_attributes_and_body(self, message: pb.ProcessingRequest) -> messages.Reply:
        """Headers phase skipped (``envoy.request_attributes``): the request headers kvgate
        reads came as attributes with the body; then as the two phases would."""
        director = self.director
        values = messages.attribute_map(message, director.config.classification.header)
        if not values:
            raise _out_of_order("a request body before its headers, or a second one")
        _made_id, metered = self._read_headers(values)  # Envoy's x-request-id goes upstream
        if not metered:
            raise _out_of_order(f"a request body for {self.path}, which is decided on headers")
        assert self.tenant is not None
        reject = await director.precheck(self.tenant, body_here=True)  # before it is parsed
        if reject is not None:
            return self._refuse(reject)
        reply = await self._on_request_body(message.request_body)
        if self.done:
            return reply
        admission = self.admission
        assert admission is not None
        return messages.serialize_reply(reply) + messages.upstream_headers(
            admission.tenant.name, admission.request_class, admission.priority,
            director.upstream_authorization.get(admission.pool))

    def _no_body(self) -> BadRequest:
        """An inference request's trailers came before any body: an HTTP/2 request of
        headers and trailers, no DATA, which Envoy has no body message for. (With request
        attributes this is the stream's first message, and Envoy sends no attributes with
        trailers: the path may be unknown.)"""
        return BadRequest(f"{self.path or 'an inference request'} needs a JSON request body")

    async def _admit_without_body(self, remove: tuple[str, ...]) -> messages.Reply:
        """The harmless GETs: one request's worth, decided on headers alone."""
        assert self.tenant is not None
        if self.path == MODELS_PATH:
            return await self._list_models()
        decision = await self.director.admit_request_only(
            self.tenant, self.path, self.requested_class, watch=self.watch
        )
        if not isinstance(decision, Admission):
            return self._refuse(decision)
        self._hold(decision)
        reply = self._route(decision, body=None, in_body_phase=False)
        return reply + messages.headers_only(remove)  # serialized messages merge

    async def _list_models(self) -> messages.Reply:
        """Every pool's models, answered by kvgate (an engine knows only its own pool's)."""
        assert self.tenant is not None
        listed = await self.director.list_models(self.tenant, watch=self.watch)
        if isinstance(listed, Reject):
            return self._refuse(listed)
        models, admit = listed
        self._count("admitted", "none")
        return self._answer(200, model_list(models, self.director.started_s),
                            admitted_ratelimit_headers(admit.remaining), details="kvgate_models")

    async def _on_request_body(self, body: pb.HttpBody) -> messages.Reply:
        if self.tenant is None or self.request is not None or self.admission is not None:
            raise _out_of_order("a request body before its headers, or a second one")
        raw = body.body  # each read of a bytes field copies it out of the message
        if len(raw) > self.settings.max_body_bytes:
            raise _too_large(self.settings.max_body_bytes)
        self.request = request = parse_body(self.path, raw)
        started = perf_counter()
        decision = await self.director.admit(self.tenant, request, self.requested_class,
                                             watch=self.watch)
        self.metrics.decision_seconds.observe(perf_counter() - started)
        if not isinstance(decision, Admission):
            return self._refuse(decision)
        self._hold(decision)
        inject_usage = request.stream and not request.wants_usage_chunk
        salt = decision.scheduler.config.cache_salt(decision.tenant.name,
                                                    request.body.get("cache_salt"))
        new_body = mutate_body(request, priority=decision.priority, inject_usage=inject_usage,
                               overrides=decision.body_overrides, cache_salt=salt)
        self.response = ResponseRecord(stream=request.stream)
        self.desk.expect(decision.lease_id, self)
        meter = _meter_mode(request, inject_usage)
        return self._route(decision, body=new_body, in_body_phase=True, meter=meter)

    def _hold(self, admission: Admission) -> None:
        """From here on, close() releases the admission whatever happens — and counts it out
        of ``kvgate_in_flight_requests``, so it is counted in here, in the same step."""
        self.admission = admission
        self.metrics.admitted(admission.tenant.name, self._model(), admission.request_class,
                              admission.cost.tokens)

    def _route(self, admission: Admission, *, body: bytes | None, in_body_phase: bool,
               meter: str = "") -> bytes:
        return messages.route_request(
            admission.tenant.name, admission.request_class, admission.endpoints, admission.priority,
            admission.pool, admission.lease_id, body, in_body_phase,
            self.director.upstream_authorization.get(admission.pool),
            meter, self.desk.address, self.desk.key,
            _usage_bound(admission.cost) if meter else "",
        ) + messages.ratelimit_metadata(admitted_ratelimit_headers(admission.admit.remaining))

    # -- the response, as Envoy's Lua meter reports it --------------------------------------

    def first_reported(self) -> None:
        """A stream's first token has passed: prefill is done."""
        record, admission = self.response, self.admission
        if record is None or admission is None or record.started or self._released:
            return
        record.started = True
        self.director.first_token(admission)

    def done_reported(self, usage: Usage | None, events: int, answered: bool) -> None:
        """The response has ended; Envoy ends the stream (and kvgate releases) next. The
        engine is done with it already: for the scheduler it has started (a non-streamed
        response gives no earlier sign), so the endpoint's next request need not wait for
        Envoy to end this stream."""
        record = self.response
        if record is None or self._released or record.done:  # the first report stands
            return
        record.finish(usage, events, answered)
        self.first_reported()
        if self._report is not None and not self._report.done():
            self._report.set_result(None)

    @property
    def report_pending(self) -> bool:
        """Envoy ended the stream before the meter's done report came: the meter sends it
        without waiting for an answer, so it may still be on its way (``wait_for_report``)."""
        record = self.response
        return (self.METERED_BY_LUA and record is not None and not record.done
                and not self._released and not self.unsent)

    async def wait_for_report(self, timeout_s: float) -> bool:
        """Whether the done report arrived within ``timeout_s``."""
        if not self.report_pending:
            return True
        self._report = report = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(report, timeout_s)
        return report.done() and not report.cancelled()

    # -- endings ---------------------------------------------------------------------------

    def _refuse(self, reject: Reject) -> pb.ProcessingResponse:
        self._count("shed" if reject.status == 503 else "rejected", reject.reason.value)
        return self._answer(*rejection(reject, prompt_field(self.path)),
                            details=f"kvgate_{reject.reason.value}")

    def departed(self) -> None:
        """The client left while its request queued: no answer, nothing held; counted."""
        if not self.done and self.admission is None:
            self._count("cancelled", "client_gone")

    def _count(self, decision: str, reason: str) -> None:
        """The request's one entry in ``kvgate_requests_total`` (admissions: ``_route``)."""
        request = self.request
        self.metrics.decided(None if self.tenant is None else self.tenant.name, self._model(),
                             None if request is None else request.request_class,
                             decision, reason)
        if log.isEnabledFor(DEBUG):
            log.debug("request %s %s (%s)", self.path, decision, reason, extra=self._context())

    def _context(self) -> dict[str, str]:
        """What a log line about this request carries (never its key or body)."""
        context = {"request_id": self.request_id or "-"}
        if self.tenant is not None:
            context["tenant"] = self.tenant.name
        return context

    def _model(self) -> str | None:
        """The model the request is served by (a degraded one: its fallback), if it named one."""
        request, admission = self.request, self.admission
        if request is None:
            return None
        if admission is not None:
            return admission.body_overrides.get("model", request.model)
        return request.model

    def _answer(
        self, status: int, body: bytes, headers: dict[str, str], *, details: str
    ) -> pb.ProcessingResponse:
        self.done = True
        if status >= 400:
            tenant = None if self.tenant is None else self.tenant.name
            self.director.rejections.add(status, headers.get("x-kvgate-reject", details), tenant)
        if self.request_id:  # the client can quote it
            headers = {**headers, REQUEST_ID_HEADER: self.request_id}
        return messages.immediate(status, body, headers, details)

    @property
    def holds_admission(self) -> bool:
        return self.admission is not None and not self._released

    async def close(self, abnormal: str | None) -> None:
        """Release the admission's lease and reconcile its tokens. Safe to call repeatedly.
        A request whose routing reply never left kvgate (``unsent``) never ran: it is
        charged nothing (its tokens and quotas given back in full, as for a request that
        left the queue) and its KV reservation is freed as one that never ran."""
        admission = self.admission
        if admission is None or self._released:
            return
        self._released = True
        metrics = self.metrics
        if abnormal:
            metrics.stream_errors.add((abnormal,))
        self.desk.forget(admission.lease_id)
        record = self.response
        if self.unsent:
            used, output, basis = 0, 0, "not_sent"
        elif record is None:
            used, output, basis = 0, 0, "no_response"
        else:
            silent = False
            if self.METERED_BY_LUA and not record.started and not record.done:
                self.desk.unreported()  # no report of it at all: is the meter reporting?
                silent = self.desk.silent
            used, output, basis = record.settle(admission.cost, meter_silent=silent)
        metrics.finished(admission.tenant.name, self._model(), admission.cost.tokens, used,
                         output, basis)
        if log.isEnabledFor(DEBUG):
            log.debug("request %s ended%s: %d tokens used of %d reserved", self.path,
                      f" ({abnormal})" if abnormal else "", used, admission.cost.tokens,
                      extra=self._context())
        if self.unsent:
            await self.director.release(admission, 0, 0, sent=False)
        else:
            await self.director.release(admission, used, output,
                                        measured=basis in ("usage", "usage_bounded"))


def _too_large(limit: int) -> BadRequest:
    return BadRequest(
        f"request body is larger than this gateway's limit of {limit} bytes",
        status=413, code="request_too_large",
    )


def _out_of_order(what: str) -> BadRequest:
    """Envoy sends headers, then at most one buffered body: anything else is a broken (or
    hand-written) filter config, answered 400 rather than guessed at."""
    return BadRequest(f"ext_proc protocol: {what}", code="protocol_error")


def _continue_other(kind: str) -> pb.ProcessingResponse:
    """Phases kvgate does not act on (enabled by a hand-edited Envoy config): pass through."""
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
