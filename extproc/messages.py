"""Building ext_proc replies (xds-protos / upb messages) — the only module that knows their shape.

REFERENCE.md facts honoured here: header values go in ``raw_value`` (setting ``value`` too
makes Envoy fail the request); a JSON immediate response carries its content-type; routing
metadata lives under the ``envoy.lb`` namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

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


def header_mutation(
    set_headers: Headers | None = None, remove: Iterable[str] = ()
) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE
            )
            for k, v in (set_headers or {}).items()
        ],
        remove_headers=list(remove),
    )


def continue_request_headers(remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    common = pb.CommonResponse(header_mutation=header_mutation(remove=remove))
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))


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
    headers = dict(set_headers)
    common = pb.CommonResponse(clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
        headers["content-length"] = str(len(body))
    common.header_mutation.CopyFrom(header_mutation(headers))
    dynamic = Struct()  # filled field by field: Struct.update() walks values in Python
    dynamic.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value = endpoint
    ours = dynamic.fields["kvgate"].struct_value.fields
    for key, value in metadata.items():
        ours[key].string_value = value
    if in_body_phase:
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=dynamic
        )
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=dynamic
    )


def immediate(status: int, body: bytes, headers: Headers, details: str) -> pb.ProcessingResponse:
    """Answer the client directly (401/400/413/429/503): the request never goes upstream."""
    all_headers = {"content-type": "application/json", **headers}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),
            headers=header_mutation(all_headers),
            body=body,
            details=details,
        )
    )
