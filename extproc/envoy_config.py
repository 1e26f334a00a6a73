"""Render the Envoy bootstrap (gateway mode) from kvgate's config.

The bootstrap is built from typed ``envoy_data_plane`` messages (betterproto2 dataclasses of
the Envoy API), so a misspelt field or a wrong type fails here, in Python, and the real
``envoy --mode validate`` checks the rest in the tests. ``kvgate render-envoy`` writes it to
``envoy/gateway.yaml``.

``envoy_data_plane`` costs ~1 s and ~50 MB to import: it is imported inside the functions
only, so this module stays cheap to import and out of ``kvgate serve``'s way.

Traffic path::

    client ─▶ listener (HCM) ─▶ ext_proc filter ──gRPC/HTTP2──▶ kvgate (cluster kvgate_ext_proc)
                                     │
                                     ├─▶ Lua meter (responses) ──HTTP/1.1──▶ kvgate's report port
                                     │                  (cluster kvgate_report, ORIGINAL_DST)
                                     └─▶ router ─▶ kvgate_upstream (ORIGINAL_DST: the endpoint
                                                   named by x-gateway-destination-endpoint)

Responses go through the Lua meter (``extproc/meter.lua``) on their way back, not through
ext_proc: it reads each one inside Envoy and reports it to kvgate in at most two small calls,
whatever its length (see ``extproc/reports.py``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import ipaddress
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from extproc.headers import (
    DESTINATION_HEADER,
    ENGINE_CONTROL_HEADERS,
    EXT_PROC_HEADERS,
    KVGATE_HEADER_PREFIX,
    LB_NAMESPACE,
    RATELIMIT_HEADERS,
    RATELIMIT_NAMESPACE,
    RECEIVING_NAMESPACES,
    UPSTREAM_HEADERS,
    UPSTREAM_HEADERS_NAMESPACE,
)

if TYPE_CHECKING:
    from extproc.config import Config, ExtProcTls, Pool

GATEWAY_LISTENER = "kvgate_gateway"
EXT_PROC_CLUSTER = "kvgate_ext_proc"
UPSTREAM_CLUSTER = "kvgate_upstream"  # requests kvgate did not route: no host, 503
POOL_CLUSTER_PREFIX = "kvgate_pool_"  # + the pool's name: where kvgate's requests go
# Envoy moves to the next endpoint kvgate listed when the chosen one cannot be reached
# (connection refused or reset before the request was sent: nothing reached the engine).
RETRY_ON = "connect-failure,reset-before-request"
REPORT_CLUSTER = "kvgate_report"  # the name meter.lua calls
METER_FILTER = "envoy.filters.http.lua"
BUFFER_FILTER = "envoy.filters.http.buffer"
REPORT_TIMEOUT = dt.timedelta(seconds=1)
# Envoy closes a report connection quiet this long, well before kvgate closes one
# (reports.IDLE_TIMEOUT_S): kvgate then never closes a connection Envoy may be sending on
REPORT_IDLE_TIMEOUT = dt.timedelta(seconds=60)

# Envoy buffers the whole request body for ext_proc (BUFFERED mode); its limit is the
# connection's buffer limit. It sits above server.max_body_bytes so that kvgate, not Envoy,
# answers 413 (with a JSON error) for every body up to that size, headers included.
BUFFER_HEADROOM_BYTES = 64 * 1024
EXT_PROC_CONNECT_TIMEOUT = dt.timedelta(seconds=1)
# Envoy's own default stream idle timeout; the floor for the route's idle timeout.
MIN_IDLE_TIMEOUT_S = 300.0
# Extra time on top of the longest expected silence, so the more specific timers (the
# ext_proc message timeout, the route timeout) fire first and name the cause.
IDLE_TIMEOUT_MARGIN_S = 30.0
# Envoy's default circuit breakers allow 1024 requests per cluster. kvgate holds one ext_proc
# stream, and the upstream one connection, for the whole LLM call (queueing included), so
# 1024 concurrent generations would overflow them; kvgate is the admission controller.
CIRCUIT_BREAKER_LIMIT = 1_000_000
MAX_DOWNSTREAM_CONNECTIONS = 50_000
HEAP_MONITOR = "envoy.resource_monitors.fixed_heap"
HEAP_SHRINK, HEAP_SHED = 0.90, 0.95  # shares of envoy.max_heap_mb: free memory back; shed
# streams holding at least 2**this many bytes (a 64 KiB body) are tracked, so that past
# HEAP_SHRINK the largest can be reset (HTTP/2 streams: Envoy accounts no HTTP/1 stream)
TRACKED_STREAM_BYTES_LOG2 = 16
CLIENT_HTTP2_STREAMS = 100  # requests at once on one client HTTP/2 connection

RUNTIME_FLAGS = {
    # Envoy resets each ext_proc stream it is done with (kvgate takes that as the normal end
    # once the request has settled). Its graceful close (a half-close, then waiting for
    # kvgate's trailers) crashed Envoy 1.40 (SIGSEGV in the gRPC client, on kvgate's
    # trailers) in every real-vLLM run where kvgate, in the benchmark's process on two busy
    # cores, ran long queues; with resets, no crash in the same runs.
    "envoy.reloadable_features.ext_proc_graceful_grpc_close": False,
}

# Local replies that Envoy makes itself get an OpenAI-style JSON body. Filters that set a
# content-type on their local reply (kvgate's ext_proc ImmediateResponse always does) are
# left untouched: the header mutation of an immediate response is applied *before* the
# local-reply mapper runs, and Envoy's own replies carry no content-type at that point.
_ENVOY_OWN_REPLY = "!('content-type' in response.headers)"
_EXT_PROC_FAILED = "response.code_details.startsWith('ext_proc_error')"
# Envoy's own 4xx (400 malformed, 413 body over the buffer, 431 headers too large, …) cannot
# succeed on a retry; 408 (request timeout) can.
_CLIENT_FAULT = "response.code >= 400 && response.code < 500 && response.code != 408"
# response.code_details of Envoy's refusals of a request it cannot parse: the HTTP/1, HTTP/2
# and HTTP/3 codecs' own, and a path it cannot normalize (an escaped NUL, for one)
_UNPARSABLE = ("(response.code_details.startsWith('http1.') || "
               "response.code_details.startsWith('http2.') || "
               "response.code_details.startsWith('http3.') || "
               "response.code_details == 'path_normalization_failed')")
DO_NOT_RETRY = {"x-should-retry": "false"}
MALFORMED_MESSAGE = ("malformed HTTP request: the gateway could not parse its request line, "
                     "path or headers")
# Envoy's refusals that carry no body (or only a status phrase), by response.code_details:
# (error.code, message)
REFUSALS = {
    "upgrade_failed": ("upgrade_not_supported",
                       "connection upgrades (WebSocket and the like) are not supported: send a "
                       "plain HTTP/1.1 or HTTP/2 request"),
    "low_version": ("unsupported_http_version",
                    "only HTTP/1.1 and HTTP/2 are supported: send one of them"),
    # Envoy answers these with a bare status and no body: say what was wrong
    "absolute_path_rejected": ("invalid_request_target",
                               "the request target must be a path such as "
                               "/v1/chat/completions (not '*' or an absolute URI)"),
    "missing_host_header": ("missing_host_header",
                            "the request has no Host header (HTTP/1.1 requires one)"),
}
# Envoy's HTTP/1 codec answers a transfer-encoding other than chunked with 501 Not
# Implemented: a 5xx (so openai-python retries it, twice) for a request that can never
# succeed. Answered as the client fault it is.
BAD_TRANSFER_ENCODING = ("http1.invalid_transfer_encoding",
                         "transfer-encoding must be chunked (or absent): a compressed or other "
                         "transfer coding is not supported; send the body as plain JSON")
# error.code of Envoy's own replies: a string, as in OpenAI's errors and kvgate's own
# refusals (extproc/rejections.py), never the status again (openai-python keeps it as
# APIStatusError.code). Replies a mapper recognises get their own code (REFUSALS' too); the
# rest one by status, then one for their class.
BAD_TRANSFER_ENCODING_CODE = "unsupported_transfer_encoding"
MALFORMED_CODE = "malformed_request"
EXT_PROC_FAILURE_CODE = "admission_unavailable"
OVERLOAD_CODE = "gateway_overloaded"  # as kvgate's own 503 when it holds too many bodies
RATE_LIMITED_CODE = "rate_limit_exceeded"  # as kvgate's own 429
# Envoy's other 5xx: no healthy upstream or connection refused (503), the engine reset the
# request or broke the protocol (502), no answer within the route timeout (504)
SERVER_ERROR_CODES = {502: "upstream_error", 503: "upstream_unavailable",
                      504: "upstream_timeout"}
SERVER_ERROR_CODE = "gateway_error"
# Envoy's other 4xx that cannot succeed on a retry; 413 as kvgate's own (a body over Envoy's
# buffer is the same fault as one over server.max_body_bytes)
CLIENT_FAULT_CODES = {413: "request_too_large", 431: "request_headers_too_large",
                      404: "unknown_url"}
CLIENT_FAULT_CODE = "invalid_request"
REQUEST_TIMEOUT_CODE = "request_timeout"  # 408: the client sent its request too slowly
OVERLOAD_MESSAGE = "the gateway is short of memory; retry later"
EXT_PROC_FAILURE_MESSAGE = "admission control is unavailable; retry later"
RATE_LIMITED_MESSAGE = "rate limit exceeded; retry after the time in retry-after"


def _seconds(value: float) -> dt.timedelta:
    return dt.timedelta(seconds=value)


def _socket_address(host: str, port: int) -> Any:
    from envoy_data_plane.envoy.config.core.v3 import Address, SocketAddress

    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def client_options(config: Config) -> dict[str, Any]:
    """The HTTP connection manager's settings on the client's side, for every gateway kvgate
    renders. Timers: how long a request may see no bytes either way (:func:`idle_timeout_s`),
    and a client that trickles its request: headers within ``request_headers_timeout_s``, the
    whole request (body included, queueing in kvgate too: up to the ext_proc message
    timeout) within the idle timeout, which outlasts any queueing; a response under way
    disarms it. HTTP/2: at most :data:`CLIENT_HTTP2_STREAMS` requests at once on a
    connection, and flow-control windows of one largest body (Envoy's defaults, 2³¹ streams
    and 256 MiB windows, let one client push far more than Envoy means to buffer; smaller
    windows would make a large prompt wait for round trips)."""
    from envoy_data_plane.envoy.config.core.v3 import Http2ProtocolOptions

    idle = _seconds(idle_timeout_s(config))
    window = min(buffer_limit_bytes(config), 2**31 - 1)  # HTTP/2's largest window
    return {"stream_idle_timeout": idle, "request_timeout": idle,
            "request_headers_timeout": _seconds(config.envoy.request_headers_timeout_s),
            "http2_protocol_options": Http2ProtocolOptions(
                max_concurrent_streams=CLIENT_HTTP2_STREAMS,
                initial_stream_window_size=window, initial_connection_window_size=window)}


def idle_timeout_s(config: Config) -> float:
    """How long a request may see no bytes either way: queueing in kvgate (up to the ext_proc
    message timeout) or a non-streamed generation (up to the route timeout)."""
    env = config.envoy
    return max(MIN_IDLE_TIMEOUT_S, env.message_timeout_s, env.route_timeout_s) + (
        IDLE_TIMEOUT_MARGIN_S
    )


def buffer_limit_bytes(config: Config) -> int:
    return config.server.max_body_bytes + BUFFER_HEADROOM_BYTES


def _ext_proc_filter(config: Config) -> Any:
    from envoy_data_plane.envoy.config.core.v3 import GrpcService, GrpcServiceEnvoyGrpc
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
        MetadataOptions,
        MetadataOptionsMetadataNamespaces,
        ProcessingMode,
        ProcessingModeBodySendMode,
        ProcessingModeHeaderSendMode,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    env = config.envoy
    message_timeout = _seconds(env.message_timeout_s)
    ext_proc = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXT_PROC_CLUSTER)),
        failure_mode_allow=False,
        # kvgate down, failing or silent: 503 (retryable) rather than Envoy's default 500.
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        message_timeout=message_timeout,
        allow_mode_override=True,
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SEND,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            request_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
            response_header_mode=ProcessingModeHeaderSendMode.SKIP,
            # NONE here: kvgate turns the response body on (mode_override) for the requests
            # it meters. Envoy's own local replies (a header too large, an escaped slash, a
            # body over the buffer before kvgate answered) would otherwise go to kvgate on a
            # stream it never answered, and Envoy closes the connection before their body.
            response_body_mode=ProcessingModeBodySendMode.NONE,
            response_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(
                untyped=[*RECEIVING_NAMESPACES,
                         *([UPSTREAM_HEADERS_NAMESPACE] if env.request_attributes else [])]
            )
        ),
        forward_rules=_forwarded_headers(config),
        # sent with a stream's first message only (Envoy evaluates them once); Envoy 1.40
        # ignores them in a route's overrides
        request_attributes=_attributes(config) if env.request_attributes else [],
    )
    return HttpFilter(name="envoy.filters.http.ext_proc", typed_config=AnyMsg.pack(ext_proc))


def _attributes_route(config: Config, action: Any) -> Any:
    """``envoy.request_attributes``: inference POSTs skip the headers phase; the headers
    kvgate reads come as attributes with the buffered body (Envoy sends them with the first
    message of the stream). Only requests with a body: a headers-only request would
    otherwise reach kvgate in no message at all (and get 503, no host); those, and every
    other path, keep the headers phase."""
    from envoy_data_plane.envoy.config.route.v3 import HeaderMatcher, Route, RouteMatch
    from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer, BufferPerRoute
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExtProcOverrides,
        ExtProcPerRoute,
        ProcessingMode,
        ProcessingModeBodySendMode,
        ProcessingModeHeaderSendMode,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher, StringMatcher
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    from extproc.openai import INFERENCE_PATHS

    skip, send = ProcessingModeHeaderSendMode.SKIP, ProcessingModeHeaderSendMode.SEND
    per_route = ExtProcPerRoute(overrides=ExtProcOverrides(
        # as kvgate's headers reply turns on for an inference request (messages.WITH_BODY):
        # response trailers on keep the stream open until the response ends, request
        # trailers on bring kvgate a request of trailers and no body (HTTP/2), else unseen
        processing_mode=ProcessingMode(
            request_header_mode=skip, response_header_mode=skip,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            response_body_mode=ProcessingModeBodySendMode.NONE,
            request_trailer_mode=send, response_trailer_mode=send),
    ))
    paths = "|".join(p.removeprefix("/v1/") for p in INFERENCE_PATHS)
    return Route(
        name="inference",
        match=RouteMatch(
            safe_regex=RegexMatcher(regex=f"/v1/({paths})"),
            headers=[
                HeaderMatcher(name=":method", string_match=StringMatcher(exact="POST")),
                # a body follows: a declared length above 0. Zero written with several
                # digits ("00", valid HTTP) is zero too: matched as "0" alone, such a
                # request came to kvgate in no message and got 503. A request that declares
                # no length (chunked, HTTP/2) fails the match (the header is missing) and
                # keeps the headers phase: it may have no body either
                HeaderMatcher(name="content-length", string_match=StringMatcher(
                    safe_regex=RegexMatcher(regex="0+")), invert_match=True),
            ]),
        route=action,
        typed_per_filter_config={
            "envoy.filters.http.ext_proc": AnyMsg.pack(per_route),
            BUFFER_FILTER: AnyMsg.pack(BufferPerRoute(buffer=Buffer(
                max_request_bytes=buffer_limit_bytes(config)))),
        },
    )


def _attributes(config: Config) -> list[str]:
    from extproc.messages import attribute_names

    return list(attribute_names(config.classification.header))


def _strip_filter() -> Any:
    """``envoy.request_attributes``: Envoy's header_mutation filter before ext_proc drops
    every ``x-kvgate-*`` header a client sent (kvgate sees no header list to strip them
    from when the headers phase is skipped)."""
    from envoy_data_plane.envoy.config.common.mutation_rules.v3 import (
        HeaderMutation,
        HeaderMutationRemoveOnMatch,
    )
    from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import (
        HeaderMutation as HeaderMutationFilter,
    )
    from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import Mutations
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    strip = HeaderMutation(remove_on_match=HeaderMutationRemoveOnMatch(
        key_matcher=StringMatcher(prefix=KVGATE_HEADER_PREFIX)))
    return HttpFilter(name="envoy.filters.http.header_mutation", typed_config=AnyMsg.pack(
        HeaderMutationFilter(mutations=Mutations(request_mutations=[strip]))))


def _hold_filter(config: Config) -> Any:
    """``envoy.request_attributes``: Envoy's buffer filter after ext_proc, off but on the
    attributes route. With the headers phase skipped, ext_proc lets the request headers go
    on at once, and the router would pick the upstream before kvgate decided; this holds
    them until the whole body is in and ext_proc has applied kvgate's reply (route, headers,
    body)."""
    from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    return HttpFilter(name=BUFFER_FILTER, disabled=True, typed_config=AnyMsg.pack(
        Buffer(max_request_bytes=buffer_limit_bytes(config))))


def _forwarded_headers(config: Config) -> Any:
    """Only the request headers kvgate reads go to it: a smaller message to build, send and
    parse on every request (all headers still go upstream)."""
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import HeaderForwardingRules
    from envoy_data_plane.envoy.type.matcher.v3 import ListStringMatcher, StringMatcher

    exact = [*EXT_PROC_HEADERS, config.classification.header]
    return HeaderForwardingRules(allowed_headers=ListStringMatcher(patterns=[
        *(StringMatcher(exact=name) for name in dict.fromkeys(exact)),
        StringMatcher(prefix=KVGATE_HEADER_PREFIX),
    ]))


def _meter_filter() -> Any:
    """Envoy's Lua filter running kvgate's response meter (after ext_proc in the chain, so
    it sees each response before ext_proc and the client do)."""
    from importlib.resources import files

    from envoy_data_plane.envoy.config.core.v3 import DataSource
    from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import Lua
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    source = files("extproc").joinpath("meter.lua").read_text()
    return HttpFilter(name=METER_FILTER, typed_config=AnyMsg.pack(
        Lua(default_source_code=DataSource(inline_string=source))))


USAGE_NAMESPACE = "kvgate.usage"  # set by meter.lua when a response ends
USAGE_HITS = f"%DYNAMIC_METADATA({USAGE_NAMESPACE}:total_tokens)%"
RATELIMIT_TIMEOUT = dt.timedelta(milliseconds=100)


def _ratelimit_filters(config: Config) -> list[Any]:
    """Envoy's ratelimit filter asking kvgate's RLS (``envoy.ratelimit_domain``), if set.

    After ext_proc, so descriptors can name the tenant kvgate derived from the API key (its
    ``kvgate`` metadata), never a client header; after the meter, so the meter sees the
    filter's 429 (and reports that nothing was used). A dead RLS lets requests through
    (``failure_mode_deny: false``): kvgate's own admission still holds.
    """
    domain = config.envoy.ratelimit_domain
    if domain is None:
        return []
    from envoy_data_plane.envoy.config.core.v3 import (
        ApiVersion,
        GrpcService,
        GrpcServiceEnvoyGrpc,
    )
    from envoy_data_plane.envoy.config.ratelimit.v3 import RateLimitServiceConfig
    from envoy_data_plane.envoy.extensions.filters.http.ratelimit.v3 import RateLimit
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    service = RateLimitServiceConfig(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXT_PROC_CLUSTER)),
        transport_api_version=ApiVersion.V3,
    )
    ratelimit = RateLimit(domain=domain, rate_limit_service=service, failure_mode_deny=False,
                          timeout=RATELIMIT_TIMEOUT, rate_limits=_tenant_rate_limits())
    return [HttpFilter(name="envoy.filters.http.ratelimit", typed_config=AnyMsg.pack(ratelimit))]


def _tenant_rate_limits() -> list[Any]:
    """Three descriptors: ``(kind=requests, tenant=T)`` one hit per request; ``(kind=tokens,
    tenant=T)`` checked (0 hits) per request, and charged ``total_tokens`` when the stream
    is done."""
    from envoy_data_plane.envoy.config.route.v3 import (
        RateLimit,
        RateLimitAction,
        RateLimitActionGenericKey,
        RateLimitActionMetaData,
        RateLimitActionMetaDataSource,
        RateLimitHitsAddend,
    )
    from envoy_data_plane.envoy.type.metadata.v3 import MetadataKey, MetadataKeyPathSegment

    tenant = RateLimitAction(metadata=RateLimitActionMetaData(
        descriptor_key="tenant", source=RateLimitActionMetaDataSource.DYNAMIC,
        metadata_key=MetadataKey(key="kvgate", path=[MetadataKeyPathSegment(key="tenant")])))

    def kind(value: str) -> Any:
        return RateLimitAction(generic_key=RateLimitActionGenericKey(
            descriptor_key="kind", descriptor_value=value))

    return [
        RateLimit(actions=[kind("requests"), tenant]),
        RateLimit(actions=[kind("tokens"), tenant], hits_addend=RateLimitHitsAddend(number=0)),
        RateLimit(actions=[kind("tokens"), tenant], apply_on_stream_done=True,
                  hits_addend=RateLimitHitsAddend(format=USAGE_HITS)),
    ]


def _router_filter() -> Any:
    from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    return HttpFilter(name="envoy.filters.http.router", typed_config=AnyMsg.pack(Router()))


def _cel_filter(expression: str) -> Any:
    from envoy_data_plane.envoy.config.accesslog.v3 import AccessLogFilter, ExtensionFilter
    from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    return AccessLogFilter(
        extension_filter=ExtensionFilter(
            name="envoy.access_loggers.extension_filters.cel",
            typed_config=AnyMsg.pack(ExpressionFilter(expression=expression)),
        )
    )


def _json_error_format(error_type: str, code: str) -> Any:
    from envoy_data_plane.envoy.config.core.v3 import SubstitutionFormatString
    from envoy_data_plane.google.protobuf import Struct

    return SubstitutionFormatString(
        json_format=Struct.from_dict(
            {"error": {"message": "%LOCAL_REPLY_BODY%", "type": error_type, "code": code}}
        ),
        content_type="application/json",
    )


def _local_reply_config() -> Any:
    """Envoy's own local replies (413 over the buffer limit, 503 no healthy upstream, 504
    upstream timeout, kvgate unreachable, …) as OpenAI-style JSON errors, each with a string
    ``code`` that says what happened (``error.code`` is a string or null in OpenAI's API).

    No top-level ``body_format``: it would apply to *every* local reply, kvgate's immediate
    responses included. Each mapper carries the "Envoy's own reply" condition instead.
    """
    from envoy_data_plane.envoy.config.core.v3 import DataSource
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        LocalReplyConfig,
        ResponseMapper,
    )

    own = _ENVOY_OWN_REPLY
    do_not_retry = [_header_option(k, v) for k, v in DO_NOT_RETRY.items()]

    def refusal(condition: str, message: str, code: str, status: int | None = None) -> Any:
        """A client fault Envoy answers with no body (or only a status phrase): say it
        (with ``status``: as that status, a 4xx, instead of Envoy's)."""
        return ResponseMapper(filter=_cel_filter(f"{own} && {condition}"),
                              body=DataSource(inline_string=message),
                              body_format_override=_json_error_format("invalid_request_error",
                                                                      code),
                              headers_to_add=do_not_retry,
                              **({} if status is None else {"status_code": status}))

    def by_status(condition: str, error_type: str, codes: dict[int, str], fallback: str,
                  **extra: Any) -> list[Any]:
        """Envoy's replies matching ``condition`` with its own body: one mapper for each
        status in ``codes``, then one for the rest (a mapper's format has one code)."""
        return [
            *(ResponseMapper(filter=_cel_filter(f"{own} && {condition} && "
                                                f"response.code == {status}"),
                             body_format_override=_json_error_format(error_type, code),
                             **extra)
              for status, code in codes.items()),
            ResponseMapper(filter=_cel_filter(f"{own} && {condition}"),
                           body_format_override=_json_error_format(error_type, fallback),
                           **extra),
        ]

    bad_te_details, bad_te_message = BAD_TRANSFER_ENCODING

    return LocalReplyConfig(
        mappers=[
            # before the >= 500 mappers: a client's unknown transfer-encoding is its fault
            refusal(f"response.code_details == '{bad_te_details}'", bad_te_message,
                    BAD_TRANSFER_ENCODING_CODE, 400),
            # ext_proc could not reach kvgate, the stream failed or a message timed out:
            # Envoy's body is empty, so say what happened.
            ResponseMapper(
                filter=_cel_filter(f"{own} && {_EXT_PROC_FAILED}"),
                body=DataSource(inline_string=EXT_PROC_FAILURE_MESSAGE),
                body_format_override=_json_error_format("server_error", EXT_PROC_FAILURE_CODE),
            ),
            # past the heap cap (a 500 when an HTTP/1 connection is cut off mid-request)
            ResponseMapper(
                filter=_cel_filter(f"{own} && response.code_details == 'overload'"),
                status_code=503,
                body=DataSource(inline_string=OVERLOAD_MESSAGE),
                body_format_override=_json_error_format("server_error", OVERLOAD_CODE),
                headers_to_add=[_header_option("retry-after", "1")],
            ),
            *by_status("response.code >= 500", "server_error", SERVER_ERROR_CODES,
                       SERVER_ERROR_CODE),
            # the ratelimit filter's 429 (kvgate's RLS said OVER_LIMIT): retryable, and its
            # retry-after / x-ratelimit-* headers stay
            ResponseMapper(
                filter=_cel_filter(f"{own} && response.code == 429"),
                body=DataSource(inline_string=RATE_LIMITED_MESSAGE),
                body_format_override=_json_error_format("rate_limit_error", RATE_LIMITED_CODE),
            ),
            # Envoy could not parse the request (a header line without a colon, an escaped NUL
            # in the path, …): its body is empty, so say what happened
            refusal(f"response.code == 400 && {_UNPARSABLE}", MALFORMED_MESSAGE, MALFORMED_CODE),
            *(refusal(f"response.code_details == '{details}'", message, code)
              for details, (code, message) in REFUSALS.items()),
            *by_status(_CLIENT_FAULT, "invalid_request_error", CLIENT_FAULT_CODES,
                       CLIENT_FAULT_CODE, headers_to_add=do_not_retry),
            *by_status("response.code >= 400", "invalid_request_error",
                       {408: REQUEST_TIMEOUT_CODE}, CLIENT_FAULT_CODE),
        ]
    )


def _header_option(key: str, value: str) -> Any:
    from envoy_data_plane.envoy.config.core.v3 import (
        HeaderValue,
        HeaderValueOption,
        HeaderValueOptionHeaderAppendAction,
    )

    return HeaderValueOption(
        header=HeaderValue(key=key, value=value),
        append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _ratelimit_headers() -> list[Any]:
    """``x-ratelimit-*`` on every response, from the metadata kvgate returned when it
    admitted the request (``messages.ratelimit_metadata``): no gRPC message of their own.
    A key kvgate did not set (a tenant without that limit) formats as an empty value, and an
    empty value is not added; a header already there (kvgate's own refusal) is kept."""
    from envoy_data_plane.envoy.config.core.v3 import (
        HeaderValue,
        HeaderValueOption,
        HeaderValueOptionHeaderAppendAction,
    )

    return [
        HeaderValueOption(
            header=HeaderValue(key=name,
                               value=f"%DYNAMIC_METADATA({RATELIMIT_NAMESPACE}:{name})%"),
            append_action=HeaderValueOptionHeaderAppendAction.ADD_IF_ABSENT,
        )
        for name in RATELIMIT_HEADERS
    ]


def pool_cluster_name(pool: Pool) -> str:
    return POOL_CLUSTER_PREFIX + pool.name


def _pool_match(pool: Pool) -> Any:
    """A request kvgate routed to ``pool`` (its ``kvgate`` metadata names the pool; the
    route is chosen again after kvgate's reply, which clears the route cache)."""
    from envoy_data_plane.envoy.config.route.v3 import RouteMatch
    from envoy_data_plane.envoy.type.matcher.v3 import (
        MetadataMatcher,
        MetadataMatcherPathSegment,
        StringMatcher,
        ValueMatcher,
    )

    return RouteMatch(prefix="/", dynamic_metadata=[MetadataMatcher(
        filter="kvgate", path=[MetadataMatcherPathSegment(key="pool")],
        value=ValueMatcher(string_match=StringMatcher(exact=pool.name)))])


def _attributes_pool_route(pool: Pool, action: Any) -> Any:
    """A request kvgate admitted on its body alone (``envoy.request_attributes``): Envoy
    applied none of the reply's header mutations, so the headers kvgate sets upstream come
    from its metadata (the endpoint list from ``envoy.lb``, the rest from
    ``kvgate.headers``), and the client's key is dropped (replaced by the pool's own where
    it has one). An empty value (a header kvgate did not set) is not added."""
    from envoy_data_plane.envoy.config.route.v3 import Route
    from envoy_data_plane.envoy.type.matcher.v3 import (
        MetadataMatcher,
        MetadataMatcherPathSegment,
        ValueMatcher,
    )

    match = _pool_match(pool)
    match.dynamic_metadata.append(MetadataMatcher(
        filter=UPSTREAM_HEADERS_NAMESPACE,
        path=[MetadataMatcherPathSegment(key=UPSTREAM_HEADERS[0])],
        value=ValueMatcher(present_match=True)))
    return Route(
        name=f"pool:{pool.name}:attributes", match=match, route=action,
        request_headers_to_remove=["authorization"],
        request_headers_to_add=[
            _header_option(DESTINATION_HEADER,
                           f"%DYNAMIC_METADATA({LB_NAMESPACE}:{DESTINATION_HEADER})%"),
            *(_header_option(name, f"%DYNAMIC_METADATA({UPSTREAM_HEADERS_NAMESPACE}:{name})%")
              for name in UPSTREAM_HEADERS)])


def _canonical_path() -> Any:
    """The path an engine gets is the one kvgate metered: Envoy already merges slashes and
    resolves dot segments; this drops a trailing slash, which kvgate ignores when it routes
    (``openai.route_path``) but an engine's router does not (vLLM answers a redirect)."""
    from envoy_data_plane.envoy.type.matcher.v3 import RegexMatchAndSubstitute, RegexMatcher

    return RegexMatchAndSubstitute(pattern=RegexMatcher(regex="^(.+?)/+$"),
                                   substitution="\\1")


def _fallback_retries() -> Any:
    """Each retry takes the next endpoint of kvgate's list (the override_host policy), and
    only when nothing reached the engine: the chosen one and its two fallbacks."""
    from envoy_data_plane.envoy.config.route.v3 import RetryPolicy

    from extproc.scheduler import FALLBACKS

    return RetryPolicy(retry_on=RETRY_ON, num_retries=FALLBACKS)


def _http_connection_manager(config: Config) -> Any:
    from envoy_data_plane.envoy.config.route.v3 import (
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpConnectionManagerCodecType,
        HttpConnectionManagerPathWithEscapedSlashesAction,
    )

    env = config.envoy
    idle = _seconds(idle_timeout_s(config))

    def action(cluster: str, retry: Any = None, rewrite: Any = None) -> Any:
        # 0 s disables the whole-request timeout (Envoy's default is 15 s, far too short
        # for a long generation).
        return RouteAction(cluster=cluster, timeout=_seconds(env.route_timeout_s),
                           idle_timeout=idle, retry_policy=retry, regex_rewrite=rewrite)

    def pool_action(pool: Pool) -> Any:
        return action(pool_cluster_name(pool), _fallback_retries(), _canonical_path())

    routes = []
    for pool in config.pools:
        if env.request_attributes:
            routes.append(_attributes_pool_route(pool, pool_action(pool)))
        routes.append(Route(name=f"pool:{pool.name}", match=_pool_match(pool),
                            route=pool_action(pool)))
    if env.request_attributes:
        routes.append(_attributes_route(config, action(UPSTREAM_CLUSTER)))
    routes.append(Route(name="all", match=RouteMatch(prefix="/"),
                        route=action(UPSTREAM_CLUSTER)))
    return HttpConnectionManager(
        stat_prefix=GATEWAY_LISTENER,
        codec_type=HttpConnectionManagerCodecType.AUTO,
        # Also covers replies produced before a route is chosen.
        **client_options(config),
        use_remote_address=True,
        # every answer carries the request's id (the one the engine got and kvgate logs),
        # not only kvgate's refusals: a client can quote it for an answer it doubts
        always_set_request_id_in_response=True,
        # The engine decodes the path before routing, so a path must mean one thing to
        # Envoy, kvgate and the engine (kvgate normalises again, for hand-written configs).
        # An escaped slash or backslash (%2F, %5C) is refused (400): no OpenAI client sends
        # one, and a redirect would cost a round trip and a re-sent body.
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action=(
            HttpConnectionManagerPathWithEscapedSlashesAction.REJECT_REQUEST
        ),
        route_config=RouteConfiguration(
            name="kvgate_routes",
            virtual_hosts=[VirtualHost(name="kvgate", domains=["*"], routes=routes,
                                       request_headers_to_remove=list(ENGINE_CONTROL_HEADERS),
                                       response_headers_to_add=_ratelimit_headers())],
        ),
        http_filters=[*([_strip_filter()] if env.request_attributes else []),
                      _ext_proc_filter(config),
                      *([_hold_filter(config)] if env.request_attributes else []),
                      _meter_filter(), *_ratelimit_filters(config),
                      _router_filter()],
        local_reply_config=_local_reply_config(),
    )


def _listener(config: Config) -> Any:
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    env = config.envoy
    return Listener(
        name=GATEWAY_LISTENER,
        address=_socket_address(env.listen_host, env.listen_port),
        per_connection_buffer_limit_bytes=buffer_limit_bytes(config),
        filter_chains=[
            FilterChain(
                filters=[
                    Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=AnyMsg.pack(_http_connection_manager(config)),
                    )
                ]
            )
        ],
    )


def _circuit_breakers() -> Any:
    from envoy_data_plane.envoy.config.cluster.v3 import (
        CircuitBreakers,
        CircuitBreakersThresholds,
    )

    limit = CIRCUIT_BREAKER_LIMIT
    return CircuitBreakers(
        thresholds=[
            CircuitBreakersThresholds(  # retries too: each is a fallback endpoint's turn
                max_connections=limit, max_pending_requests=limit, max_requests=limit,
                max_retries=limit,
            )
        ]
    )


def _upstream_cluster(config: Config) -> Any:
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterLbPolicy,
        ClusterOriginalDstLbConfig,
    )
    from envoy_data_plane.envoy.type.metadata.v3 import MetadataKey, MetadataKeyPathSegment

    return Cluster(
        name=UPSTREAM_CLUSTER,
        # The endpoint is what kvgate put in the request's dynamic metadata
        # (envoy.lb / x-gateway-destination-endpoint, ip:port) — never a client header, so
        # nobody can pick their own GPU. Without it there is no host (the listener does not
        # restore original destinations): a request kvgate did not route gets 503, never a loop.
        type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
        original_dst_lb_config=ClusterOriginalDstLbConfig(
            metadata_key=MetadataKey(
                key=LB_NAMESPACE, path=[MetadataKeyPathSegment(key=DESTINATION_HEADER)]
            )
        ),
        connect_timeout=_seconds(config.envoy.connect_timeout_s),
        circuit_breakers=_circuit_breakers(),
    )


def _pool_cluster(config: Config, pool: Pool) -> Any:
    """A pool's engines, known to Envoy (static addresses, or the pool's DNS name resolved
    as kvgate resolves it), so that Envoy's override_host policy can take the endpoints in
    the order kvgate listed them in ``envoy.lb`` metadata — the chosen one, then the
    fallbacks on retries. Past the list, or for an endpoint Envoy does not know yet, the
    pool's other endpoints in turn (round robin): never another pool's."""
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        LoadBalancingPolicy,
        LoadBalancingPolicyPolicy,
    )
    from envoy_data_plane.envoy.config.core.v3 import TypedExtensionConfig
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.extensions.load_balancing_policies.override_host.v3 import (
        OverrideHost,
        OverrideHostOverrideHostSource,
    )
    from envoy_data_plane.envoy.extensions.load_balancing_policies.round_robin.v3 import (
        RoundRobin,
    )
    from envoy_data_plane.envoy.type.metadata.v3 import MetadataKey, MetadataKeyPathSegment
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    from extproc.config import parse_endpoint

    def policy(name: str, message: Any) -> Any:
        return LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(
            typed_extension_config=TypedExtensionConfig(name=name,
                                                        typed_config=AnyMsg.pack(message)))])

    listed = OverrideHostOverrideHostSource(metadata=MetadataKey(
        key=LB_NAMESPACE, path=[MetadataKeyPathSegment(key=DESTINATION_HEADER)]))
    override = OverrideHost(override_host_sources=[listed], fallback_policy=policy(
        "envoy.load_balancing_policies.round_robin", RoundRobin()))
    if pool.dns is not None:
        addresses = [(pool.dns.hostname, pool.dns.port)]
    else:
        addresses = [parse_endpoint(endpoint) for endpoint in pool.endpoints]
    name = pool_cluster_name(pool)
    return Cluster(
        name=name,
        type=ClusterDiscoveryType.STRICT_DNS,  # IP literals resolve to themselves
        dns_refresh_rate=None if pool.dns is None else _seconds(pool.dns.interval_s),
        load_assignment=ClusterLoadAssignment(cluster_name=name, endpoints=[
            LocalityLbEndpoints(lb_endpoints=[
                LbEndpoint(endpoint=Endpoint(address=_socket_address(host, port)))
                for host, port in addresses])]),
        load_balancing_policy=policy("envoy.load_balancing_policies.override_host", override),
        connect_timeout=_seconds(config.envoy.connect_timeout_s),
        circuit_breakers=_circuit_breakers(),
    )


def _report_cluster() -> Any:
    """Where the Lua meter reports: the kvgate process that admitted the request, named by
    the report's ``x-envoy-original-dst-host`` (kvgate's own address, from its metadata)."""
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterLbPolicy,
        ClusterOriginalDstLbConfig,
    )
    from envoy_data_plane.envoy.config.core.v3 import Http1ProtocolOptions
    from envoy_data_plane.envoy.config.core.v3 import HttpProtocolOptions as CommonOptions
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    http1 = HttpProtocolOptions(
        common_http_protocol_options=CommonOptions(idle_timeout=REPORT_IDLE_TIMEOUT),
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http_protocol_options=Http1ProtocolOptions()))
    return Cluster(
        name=REPORT_CLUSTER,
        type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
        original_dst_lb_config=ClusterOriginalDstLbConfig(use_http_header=True),
        connect_timeout=REPORT_TIMEOUT,
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyMsg.pack(http1)
        },
        circuit_breakers=_circuit_breakers(),
    )


def _ext_proc_cluster(config: Config) -> Any:
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterDnsLookupFamily,
    )
    from envoy_data_plane.envoy.config.core.v3 import Http2ProtocolOptions, KeepaliveSettings
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    # gRPC needs HTTP/2 to the processor; without it every request fails with 500.
    http2 = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions(
                # Notice a dead or wedged kvgate on an idle connection.
                connection_keepalive=KeepaliveSettings(
                    interval=dt.timedelta(seconds=30), timeout=dt.timedelta(seconds=5)
                )
            )
        )
    )
    endpoint = LbEndpoint(
        endpoint=Endpoint(
            address=_socket_address(config.envoy.ext_proc_host, config.server.grpc_port)
        )
    )
    by_name = not _is_ip(config.envoy.ext_proc_host)
    return Cluster(
        name=EXT_PROC_CLUSTER,
        # A hostname (a Kubernetes headless Service of kvgate replicas) is resolved and
        # re-resolved by Envoy, which then spreads ext_proc streams over every address;
        # IPv4 first, where kvgate's usual 0.0.0.0 listens.
        type=ClusterDiscoveryType.STRICT_DNS if by_name else ClusterDiscoveryType.STATIC,
        dns_lookup_family=(ClusterDnsLookupFamily.V4_PREFERRED if by_name
                           else ClusterDnsLookupFamily.AUTO),
        connect_timeout=EXT_PROC_CONNECT_TIMEOUT,
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyMsg.pack(http2)
        },
        load_assignment=ClusterLoadAssignment(
            cluster_name=EXT_PROC_CLUSTER,
            endpoints=[LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
        circuit_breakers=_circuit_breakers(),
        transport_socket=_ext_proc_tls(config.envoy.ext_proc_tls),
    )


def _ext_proc_tls(tls: ExtProcTls | None) -> Any:
    """TLS to kvgate's gRPC port (its ``server.tls``), or None: plaintext."""
    if tls is None:
        return None
    from envoy_data_plane.envoy.config.core.v3 import DataSource, TransportSocket
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
        CertificateValidationContext,
        CommonTlsContext,
        SubjectAltNameMatcher,
        SubjectAltNameMatcherSanType,
        TlsCertificate,
        UpstreamTlsContext,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    names = [] if tls.server_name is None else [SubjectAltNameMatcher(
        san_type=SubjectAltNameMatcherSanType.DNS, matcher=StringMatcher(exact=tls.server_name))]
    client = [] if tls.cert_file is None or tls.key_file is None else [TlsCertificate(
        certificate_chain=DataSource(filename=tls.cert_file),
        private_key=DataSource(filename=tls.key_file))]
    context = UpstreamTlsContext(
        sni=tls.server_name or "",
        common_tls_context=CommonTlsContext(
            # gRPC requires ALPN h2 over TLS
            alpn_protocols=["h2"],
            tls_certificates=client,
            validation_context=CertificateValidationContext(
                trusted_ca=DataSource(filename=tls.ca_file),
                match_typed_subject_alt_names=names,
            ),
        ),
    )
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=AnyMsg.pack(context))


def _overload_manager(config: Config) -> Any:
    """An explicit cap on downstream connections (and no start-up warning about its absence),
    and a heap cap. Envoy holds each request's body until kvgate admits it, so many clients
    sending large bodies slowly would otherwise grow its memory until it is killed: past
    :data:`HEAP_SHED` of ``envoy.max_heap_mb`` it refuses new requests (a JSON 503 each, from
    :data:`OVERLOAD_MESSAGE`), cuts off HTTP/1 connections that send more and sends HTTP/2
    ones a GOAWAY; their open streams keep sending after it, so from :data:`HEAP_SHRINK` the
    streams holding the most memory are reset (Envoy accounts HTTP/2 streams only)."""
    from envoy_data_plane.envoy.config.overload.v3 import (
        BufferFactoryConfig,
        LoadShedPoint,
        OverloadAction,
        OverloadManager,
        ResourceMonitor,
        ScaledTrigger,
        ThresholdTrigger,
        Trigger,
    )
    from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import (
        DownstreamConnectionsConfig,
    )
    from envoy_data_plane.envoy.extensions.resource_monitors.fixed_heap.v3 import (
        FixedHeapConfig,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    def past(share: float) -> list[Any]:
        return [Trigger(name=HEAP_MONITOR, threshold=ThresholdTrigger(value=share))]

    return OverloadManager(
        refresh_interval=_seconds(0.25),
        resource_monitors=[
            ResourceMonitor(
                name="envoy.resource_monitors.global_downstream_max_connections",
                typed_config=AnyMsg.pack(
                    DownstreamConnectionsConfig(
                        max_active_downstream_connections=MAX_DOWNSTREAM_CONNECTIONS
                    )
                ),
            ),
            ResourceMonitor(name=HEAP_MONITOR, typed_config=AnyMsg.pack(FixedHeapConfig(
                max_heap_size_bytes=config.envoy.max_heap_mb * 2**20))),
        ],
        actions=[
            OverloadAction(name="envoy.overload_actions.shrink_heap", triggers=past(HEAP_SHRINK)),
            # HTTP/2 streams already open keep sending after a GOAWAY: the largest are reset
            OverloadAction(name="envoy.overload_actions.reset_high_memory_stream", triggers=[
                Trigger(name=HEAP_MONITOR, scaled=ScaledTrigger(
                    scaling_threshold=HEAP_SHRINK, saturation_threshold=HEAP_SHED))]),
        ],
        buffer_factory_config=BufferFactoryConfig(
            minimum_account_to_track_power_of_two=TRACKED_STREAM_BYTES_LOG2),
        loadshed_points=[LoadShedPoint(name=f"envoy.load_shed_points.{point}",
                                       triggers=past(HEAP_SHED))
                         for point in ("http_connection_manager_decode_headers",
                                       "http1_server_abort_dispatch",
                                       "http2_server_go_away_on_dispatch")],
    )


def build_bootstrap(config: Config) -> Any:
    """The typed ``envoy.config.bootstrap.v3.Bootstrap`` message for ``config``."""
    from envoy_data_plane.envoy.config.bootstrap.v3 import (
        Admin,
        Bootstrap,
        BootstrapStaticResources,
        LayeredRuntime,
        RuntimeLayer,
    )
    from envoy_data_plane.google.protobuf import Struct

    return Bootstrap(
        admin=Admin(address=_socket_address("127.0.0.1", config.envoy.admin_port)),
        static_resources=BootstrapStaticResources(
            listeners=[_listener(config)],
            clusters=[*(_pool_cluster(config, pool) for pool in config.pools),
                      _upstream_cluster(config), _ext_proc_cluster(config), _report_cluster()],
        ),
        layered_runtime=LayeredRuntime(
            layers=[RuntimeLayer(name="static", static_layer=Struct.from_dict(RUNTIME_FLAGS))]
        ),
        overload_manager=_overload_manager(config),
    )


def render_bootstrap(config: Config) -> dict[str, Any]:
    """The Envoy bootstrap for ``config`` as proto3 JSON (snake_case keys, ``@type`` on every
    typed_config, durations as ``"60s"``), ready for ``yaml.safe_dump``/``json.dumps``."""
    from betterproto2 import Casing

    rendered = build_bootstrap(config).to_dict(casing=Casing.SNAKE)
    _spell_out_failure_mode(rendered)
    # Proto field order puts admin last; read top-down: admin, resources, runtime, overload.
    order = ["admin", "static_resources", "layered_runtime", "overload_manager"]
    return {key: rendered[key] for key in order if key in rendered} | {
        key: value for key, value in rendered.items() if key not in order
    }


def ext_proc_filter_config(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The ext_proc filter's typed_config inside a rendered bootstrap."""
    listener = bootstrap["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for http_filter in hcm["http_filters"]:
        if http_filter["name"] == "envoy.filters.http.ext_proc":
            return http_filter["typed_config"]
    raise KeyError("no envoy.filters.http.ext_proc filter")


def _spell_out_failure_mode(bootstrap: dict[str, Any]) -> None:
    """proto3 JSON omits fields at their default; ``failure_mode_allow: false`` is a security
    decision (with ``true`` a dead kvgate lets requests through unadmitted, and the routing
    header becomes client-controlled), so the rendered file states it."""
    ext_proc = ext_proc_filter_config(bootstrap)
    items = list(ext_proc.items())
    ext_proc.clear()
    for key, value in items:
        ext_proc[key] = value
        if key == "grpc_service":
            ext_proc["failure_mode_allow"] = False
    ext_proc.setdefault("failure_mode_allow", False)


HEADER = """\
# Envoy bootstrap for kvgate.
# GENERATED by `kvgate render-envoy` from kvgate's config; do not edit by hand. Regenerate with
#   kvgate render-envoy KVGATE_CONFIG -o THIS_FILE
# (the commands for the committed copies: envoy/README.md, deploy/README.md).
"""


def render_yaml(config: Config) -> str:
    body = yaml.safe_dump(
        render_bootstrap(config), sort_keys=False, default_flow_style=False, width=1000
    )
    return HEADER + body


def render_to_file(config: Config, path: str | Path,
                   render: Callable[[Config], str] = render_yaml) -> Path:
    """Write the YAML bootstrap (``render``'s) to ``path`` as :func:`write_output` does;
    returns the path."""
    path = Path(path)
    write_output(path, render(config))
    return path


def write_output(path: Path, text: str) -> None:
    """``text`` into ``path`` as its user means it: a regular file (or a new one, parent
    folders created) replaced in one rename, so Envoy never reads half of one, with the old
    file's permission bits and (where allowed: as root) its owner; through a symlink, its
    target replaced and the link kept; a FIFO or a device (``/dev/stdout``) written into,
    never replaced. Errors name ``path``."""
    try:
        old: os.stat_result | None = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # new (a dangling link: its target)
        old = None
    mode = None if old is None else old.st_mode
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if mode is not None and not stat.S_ISREG(mode):
        with _named(path), open(path, "w", encoding="utf-8") as file:
            file.write(text)
        return
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)  # its error names the folder
    with _named(path):
        _replace(target, text, old)


def _replace(target: Path, text: str, old: os.stat_result | None) -> None:
    """A temporary file beside ``target`` (the umask's bits, or ``old``'s bits and owner),
    renamed over it. The owner is kept where the user may give it (root may; anyone may
    keep their own): a config rendered by root into a file an unprivileged Envoy reads
    must stay that user's."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
            if old is not None:
                with contextlib.suppress(PermissionError):
                    os.fchown(file.fileno(), old.st_uid, old.st_gid)
                os.fchmod(file.fileno(), stat.S_IMODE(old.st_mode))  # after: chown clears setuid
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _named(path: Path) -> Iterator[None]:
    """An OSError as naming ``path``, not the temporary file or a symlink's target."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None or exc.filename == str(path):
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None
