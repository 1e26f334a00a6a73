"""Parsing Envoy's protobuf messages when a string field is not UTF-8.

Protobuf strings must be UTF-8 but HTTP header values need not be, and Envoy copies them
into string fields as they came: a header value sent as an ext_proc attribute (a ``Struct``
string) or as a rate-limit descriptor entry. One byte such as 0xff would fail the whole
message: the client's mistake would end as a broken ext_proc stream (a 503), or a rate
limit call that Envoy lets through (``failure_mode_deny: false``), a way around the limit.
Such a message is parsed again with its invalid bytes replaced (U+FFFD) — as the headers
phase's ``raw_value`` bytes are decoded — and the value is then judged like any other.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


def parse_lenient(kind: type[M], data: bytes) -> M | None:
    """``data`` as a ``kind``, invalid UTF-8 in its strings replaced; None when it does not
    parse even so (truncated, a wire type Envoy never sends, nested past what the parser
    or the repair's recursion allows): whoever can reach kvgate's gRPC port gets a clear
    refusal for such bytes, not an exception and a traceback per call."""
    try:
        return kind.FromString(data)
    except DecodeError:
        pass
    try:
        return kind.FromString(_repair_text(data, kind.DESCRIPTOR))
    except (DecodeError, IndexError, ValueError, RecursionError):
        return None


def _repair_text(data: bytes, descriptor: Descriptor) -> bytes:
    """``data`` (a serialized ``descriptor``) with every string field's invalid UTF-8
    replaced, nested messages (maps and ``Struct`` values included) walked the same way;
    everything else is copied as it is."""
    out, at = bytearray(), 0
    while at < len(data):
        key, value_at = _varint(data, at)
        wire_type = key & 7
        if wire_type == 2:  # length-delimited: a string, bytes, or a message
            length, start = _varint(data, value_at)
            end = start + length
            value = data[start:end]
            field = descriptor.fields_by_number.get(key >> 3)
            if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                value = value.decode("utf-8", "replace").encode()
            elif field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                value = _repair_text(value, field.message_type)
            out += data[at:value_at] + _varint_bytes(len(value)) + value
        elif wire_type == 0:
            end = _varint(data, value_at)[1]
            out += data[at:end]
        elif wire_type in (1, 5):
            end = value_at + (8 if wire_type == 1 else 4)
            out += data[at:end]
        else:
            raise ValueError(f"wire type {wire_type}")  # groups: nothing Envoy sends
        if end > len(data):
            raise ValueError("truncated field")
        at = end
    return bytes(out)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``at`` and where the next field starts."""
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
