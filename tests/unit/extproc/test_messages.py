"""Reply building: the admit reply spliced from cached bytes equals one built field by field."""

from __future__ import annotations

import pytest
from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import messages
from extproc.headers import DESTINATION_HEADER


def reference(key: tuple, body: bytes | None, lease: str,
              authorization: str | None = None) -> pb.ProcessingResponse:
    """The admit reply built the plain way, one field after another."""
    tenant, request_class, endpoint_list, priority, pool, in_body_phase = key
    endpoints = ",".join(endpoint_list)
    reply = pb.ProcessingResponse()
    common = (reply.request_body if in_body_phase else reply.request_headers).response
    common.clear_route_cache = True
    headers = [("x-kvgate-tenant", tenant), ("x-kvgate-class", request_class),
               (DESTINATION_HEADER, endpoints)]
    if priority is not None:
        headers.append(("x-kvgate-priority", str(priority)))
    if body is not None:
        common.body_mutation.body = body
        headers.append(("content-length", str(len(body))))
    if authorization is not None:
        headers.append(("authorization", authorization))
    for name, value in headers:
        option = common.header_mutation.set_headers.add()
        option.header.key = name
        option.header.raw_value = value.encode()
        option.append_action = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    dynamic = reply.dynamic_metadata.fields
    # the whole list: Envoy's override_host policy takes the next one on a retry
    dynamic["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value = endpoints
    ours = dynamic["kvgate"].struct_value.fields
    ours["tenant"].string_value = tenant
    ours["pool"].string_value = pool
    ours["lease"].string_value = lease
    return reply


KEYS = [  # (tenant, class, endpoints, priority, pool, in the body phase)
    ("acme", "interactive", ["10.0.0.1:8000", "10.0.0.2:8000"], 0, "p", True),
    ("acme", "batch", ["10.0.0.2:8000"], None, "p", True),
    ("a" * 200, "c" * 130, [f"10.0.{i}.1:8000" for i in range(20)], -7, "pool-é", True),
    ("acme", "interactive", ["10.0.0.1:8000"], 3, "p", False),
    ("", "", [""], None, "", True),
]
# sizes around the varint boundaries of every nested length prefix
BODY_SIZES = [0, 1, 9, 10, 99, 100, 110, 127, 128, 200, 16_383, 16_384, 70_000, 2_100_000]
LEASES = ["1", "cafebabe0001-0", "cafebabe0001-7fffffff", "é" * 50, "x" * 300]


@pytest.mark.parametrize("key", KEYS)
def test_route_reply_with_the_pools_upstream_key(key):
    for authorization in ("Bearer k", "Bearer " + "s" * 300):
        body = None if not key[5] else b"{}"
        reply = pb.ProcessingResponse.FromString(
            messages.route_request(*key[:5], "lease", body, key[5], authorization))
        assert reply == reference(key, body, "lease", authorization)


@pytest.mark.parametrize("key", KEYS)
def test_route_reply_equals_the_field_by_field_one(key):
    for size in BODY_SIZES:
        for lease in LEASES:
            body = None if not key[5] else b"b" * size
            reply = pb.ProcessingResponse.FromString(
                messages.route_request(*key[:5], lease, body, key[5]))
            expected = reference(key, body, lease)
            assert reply == expected
            # maps (the metadata Structs) serialize in an order that varies with the process
            # and with how the message was built: compare the canonical bytes
            assert reply.SerializeToString(deterministic=True) == expected.SerializeToString(
                deterministic=True)


def test_route_replies_go_to_grpc_serialized_and_carry_their_own_lease():
    first = messages.route_request(*KEYS[0][:5], "lease-1", b"{}", True)
    second = messages.route_request(*KEYS[0][:5], "lease-2", b"{}", True)
    assert messages.serialize_reply(first) is first  # bytes pass through as they are
    leases = [pb.ProcessingResponse.FromString(r).dynamic_metadata.fields["kvgate"]
              .struct_value.fields["lease"].string_value for r in (first, second)]
    assert leases == ["lease-1", "lease-2"]
    message = pb.ProcessingResponse.FromString(first)
    assert messages.serialize_reply(message) == message.SerializeToString()


@pytest.mark.parametrize("bound", ["1:1", "4096:100", "123456789:99999999"])
def test_route_reply_carries_the_usage_bound_in_its_own_namespace(bound):
    key = KEYS[0]
    reply = pb.ProcessingResponse.FromString(
        messages.route_request(*key[:5], "lease", b"{}", True, None, "json", "r", "k", bound))
    fields = reply.dynamic_metadata.fields
    assert fields["kvgate.bound"].struct_value.fields["usage"].string_value == bound
    assert fields["kvgate"].struct_value.fields["meter"].string_value == "json"
    del fields["kvgate.bound"]
    expected = pb.ProcessingResponse.FromString(
        messages.route_request(*key[:5], "lease", b"{}", True, None, "json", "r", "k"))
    assert reply == expected


def test_route_parts_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(messages, "MAX_PARTS", 3)
    monkeypatch.setattr(messages, "_header_parts", {})
    monkeypatch.setattr(messages, "_routing_parts", {})
    monkeypatch.setattr(messages, "_body_parts", {})
    for i in range(10):
        key = (f"t{i}", "interactive", ["e:1"], 0, "p", True)
        reply = messages.route_request(*key[:5], "l", b"{}", True)
        assert pb.ProcessingResponse.FromString(reply) == reference(key, b"{}", "l")
        assert len(messages._header_parts) <= 3 and len(messages._routing_parts) <= 3
        assert len(messages._body_parts) <= 3


def test_continue_request_headers_strips_and_is_shared():
    reply = messages.continue_request_headers((DESTINATION_HEADER, "x-kvgate-foo"))
    removed = reply.request_headers.response.header_mutation.remove_headers
    assert list(removed) == [DESTINATION_HEADER, "x-kvgate-foo"]
    assert messages.continue_request_headers((DESTINATION_HEADER, "x-kvgate-foo")) is reply


# -- parsing Envoy's messages -----------------------------------------------------------------


def attributes_message(class_value: str, body: bytes = b'{"model": "m"}') -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    fields = message.attributes[messages.ATTRIBUTES_NAMESPACE].fields
    fields["request.headers['x-request-class']"].string_value = class_value
    fields["request.headers['authorization']"].string_value = "Bearer sk-ok"
    message.request_body.body = body
    message.request_body.end_of_stream = True
    message.metadata_context.filter_metadata["kvgate"].fields["n"].number_value = 7
    return message


def with_bad_utf8(message: pb.ProcessingRequest, marker: str) -> bytes:
    """``message`` serialized with ``marker`` (ASCII, same length) swapped for invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), b"\xff\xfe" + b"x" * (len(marker) - 2))


def test_a_message_that_parses_is_read_as_it_is():
    message = attributes_message("batch")
    assert messages.parse_request(message.SerializeToString()) == message


def test_invalid_utf8_in_an_attribute_is_replaced_and_the_rest_kept():
    message = attributes_message("ZZZZ", body=b"\xff not text is fine in bytes")
    data = with_bad_utf8(message, "ZZZZ")
    with pytest.raises(Exception, match="UTF-8"):
        pb.ProcessingRequest.FromString(data)
    parsed = messages.parse_request(data)
    expected = attributes_message("\ufffd\ufffdxx", body=b"\xff not text is fine in bytes")
    assert parsed == expected
    assert messages.attribute_map(parsed, "x-request-class")["x-request-class"] == "\ufffd\ufffdxx"


def test_invalid_utf8_in_a_header_value_string_is_replaced():
    message = pb.ProcessingRequest()
    header = message.request_headers.headers.headers.add()
    header.key, header.value = "x-request-class", "QQQQQQ"
    parsed = messages.parse_request(with_bad_utf8(message, "QQQQQQ"))
    assert parsed.request_headers.headers.headers[0].value == "\ufffd\ufffdxxxx"


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    length, size = bytearray(), len(payload)
    while size > 0x7F:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    return bytes([number << 3 | 2]) + bytes(length + bytes([size])) + payload


def _nested_metadata(levels: int) -> bytes:
    """A ``ProcessingRequest`` whose ``metadata_context`` holds a ``Struct`` nested ``levels``
    deep around one string that is not UTF-8 (so the repair walks all of it)."""
    value = _field(3, b"\xff")  # Value.string_value
    for _ in range(levels):  # Value.struct_value → Struct.fields entry (key, value)
        value = _field(5, _field(1, _field(1, b"k") + _field(2, value)))
    entry = _field(1, b"ns") + _field(2, _field(1, _field(1, b"k") + _field(2, value)))
    return _field(8, _field(1, entry))  # metadata_context.filter_metadata


@pytest.mark.parametrize("data", [b"\x12\xff", b"\x12\x05ab", b"\x12\x02\xff\xff", b"\xff" * 12,
                                  b"\x0b" * 1000 + b"\x0c" * 1000, _nested_metadata(600)],
                         ids=["length", "truncated", "string", "varint", "groups", "nested"])
def test_a_message_that_cannot_be_parsed_at_all_is_undecodable(data):
    """Never an exception (gRPC's UNKNOWN, and a traceback in kvgate's log for each)."""
    assert messages.parse_request(data) is messages.UNDECODABLE
