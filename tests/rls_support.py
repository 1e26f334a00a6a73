"""Rate Limit Service requests as Envoy builds them, for the RLS tests."""

from __future__ import annotations

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from google.protobuf.wrappers_pb2 import UInt64Value


def descriptor(
    *pairs: tuple[str, str], hits: int | None = None
) -> ratelimit_pb2.RateLimitDescriptor:
    """One descriptor of ``key, value`` entries; ``hits``: its own hits_addend (0 = check)."""
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in pairs])
    if hits is not None:
        d.hits_addend.CopyFrom(UInt64Value(value=hits))
    return d
