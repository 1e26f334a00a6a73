"""Building ext_proc replies (xds-protos / upb messages) — the only module that knows their shape.

REFERENCE.md facts honoured here: header values go in ``raw_value`` (setting ``value`` too
makes Envoy fail the request); a JSON immediate response carries its content-type; routing
metadata lives under the ``envoy.lb`` namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
DESTINATION = "x-gateway-destination-endpoint"

Headers = Mapping[str, str]


def header_map(headers: pb.HttpHeaders, wanted: frozenset[str]) -> tuple[dict[str, str], list[str]]:
    """The ``wanted`` request headers (lower-case names; values arrive in raw_value), and the
    names of any ``x-kvgate-*`` headers the client sent. Only wanted values are decoded:
    this runs for every request."""
    values: dict[str, str] = {}
    ours: list[str] = []
    for header in headers.headers.headers:
        key = header.key.lower()
        if key in wanted:
            raw = header.raw_value
            values[key] = raw.decode("utf-8", "replace") if raw else header.value
        elif key.startswith("x-kvgate-"):
            ours.append(key)
    return values, ours


def fill_mutation(
    mutation: pb.HeaderMutation, set_headers: Headers | None = None, remove: Iterable[str] = ()
) -> None:
    """Fill a reply's header mutation in place (building it apart and copying it in costs
    a copy per message)."""
    for key, value in (set_headers or {}).items():
        option = mutation.set_headers.add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = OVERWRITE
    mutation.remove_headers.extend(remove)


def continue_request_headers(remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    fill_mutation(reply.request_headers.response.header_mutation, remove=remove)
    return reply


_RESPONSE_CHUNK_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())


def continue_body(*, response_phase: bool, body: bytes | None = None) -> pb.ProcessingResponse:
    if response_phase and body is None:
        return _RESPONSE_CHUNK_CONTINUE  # the common case, built once (never mutated)
    common = pb.CommonResponse()
    if body is not None:
        common.body_mutation.body = body
    reply = pb.BodyResponse(response=common)
    if response_phase:
        return pb.ProcessingResponse(response_body=reply)
    return pb.ProcessingResponse(request_body=reply)


def route_request(
    *,
    set_headers: Headers,
    endpoint: str,
    body: bytes | None,
    in_body_phase: bool,
    metadata: Mapping[str, str],
) -> pb.ProcessingResponse:
    """Admit: set headers (and the mutated body + its content-length), pick the endpoint."""
    reply = pb.ProcessingResponse()  # filled in place, field by field: no copies
    common = (reply.request_body if in_body_phase else reply.request_headers).response
    common.clear_route_cache = True
    headers = dict(set_headers)
    if body is not None:
        common.body_mutation.body = body
        headers["content-length"] = str(len(body))
    fill_mutation(common.header_mutation, headers)
    dynamic = reply.dynamic_metadata.fields
    dynamic["envoy.lb"].struct_value.fields[DESTINATION].string_value = endpoint
    ours = dynamic["kvgate"].struct_value.fields
    for key, value in metadata.items():
        ours[key].string_value = value
    return reply


def immediate(status: int, body: bytes, headers: Headers, details: str) -> pb.ProcessingResponse:
    """Answer the client directly (401/400/413/429/503): the request never goes upstream."""
    reply = pb.ProcessingResponse()
    answer = reply.immediate_response
    answer.status.code = status
    fill_mutation(answer.headers, {"content-type": "application/json", **headers})
    answer.body = body
    answer.details = details
    return reply
