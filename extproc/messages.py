"""Building ext_proc replies (xds-protos / upb messages) — the only module that knows their shape.

REFERENCE.md facts honoured here: header values go in ``raw_value`` (setting ``value`` too
makes Envoy fail the request); a JSON immediate response carries its content-type; routing
metadata lives under the ``envoy.lb`` namespace.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy_config import DESTINATION_HEADER, KVGATE_HEADER_PREFIX

OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

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
        elif key.startswith(KVGATE_HEADER_PREFIX):
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
    """Go on to the body, stripping ``remove``. The reply is shared: never mutate it."""
    return _continue_headers(tuple(remove))


@functools.lru_cache(maxsize=256)
def _continue_headers(remove: tuple[str, ...]) -> pb.ProcessingResponse:
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
    set_headers: tuple[tuple[str, str], ...],
    endpoint: str,
    body: bytes | None,
    in_body_phase: bool,
    metadata: tuple[tuple[str, str], ...],
    lease: str,
) -> pb.ProcessingResponse:
    """Admit: set headers (and the mutated body + its content-length), pick the endpoint.

    Everything but the body and the lease repeats across requests of one tenant, class and
    endpoint: that part is built once and parsed back from bytes (~1 µs, against ~8 µs to
    fill it field by field)."""
    reply = pb.ProcessingResponse.FromString(
        _route_template(set_headers, endpoint, in_body_phase, metadata))
    common = (reply.request_body if in_body_phase else reply.request_headers).response
    if body is not None:
        common.body_mutation.body = body
        fill_mutation(common.header_mutation, {"content-length": str(len(body))})
    reply.dynamic_metadata.fields["kvgate"].struct_value.fields["lease"].string_value = lease
    return reply


@functools.lru_cache(maxsize=4096)
def _route_template(
    set_headers: tuple[tuple[str, str], ...], endpoint: str, in_body_phase: bool,
    metadata: tuple[tuple[str, str], ...],
) -> bytes:
    reply = pb.ProcessingResponse()
    common = (reply.request_body if in_body_phase else reply.request_headers).response
    common.clear_route_cache = True
    fill_mutation(common.header_mutation, dict(set_headers))
    dynamic = reply.dynamic_metadata.fields
    dynamic["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value = endpoint
    ours = dynamic["kvgate"].struct_value.fields
    for key, value in metadata:
        ours[key].string_value = value
    return reply.SerializeToString()


def immediate(status: int, body: bytes, headers: Headers, details: str) -> pb.ProcessingResponse:
    """Answer the client directly (401/400/413/429/503): the request never goes upstream."""
    reply = pb.ProcessingResponse()
    answer = reply.immediate_response
    answer.status.code = status
    fill_mutation(answer.headers, {"content-type": "application/json", **headers})
    answer.body = body
    answer.details = details
    return reply
