"""Rate Limit Service requests as Envoy builds them, for the RLS tests."""

from __future__ import annotations

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from google.protobuf.wrappers_pb2 import UInt64Value

from limiter.ratelimit import (
    Counter,
    Hit,
    Promise,
    Verdict,
    admitted,
    charged,
    decide,
    new_counter,
    refund,
)


def descriptor(
    *pairs: tuple[str, str], hits: int | None = None
) -> ratelimit_pb2.RateLimitDescriptor:
    """One descriptor of ``key, value`` entries; ``hits``: its own hits_addend (0 = check)."""
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in pairs])
    if hits is not None:
        d.hits_addend.CopyFrom(UInt64Value(value=hits))
    return d


class InProcess:
    """RLS counters in this process (:func:`limiter.ratelimit.decide` over a dict) at a clock
    the test moves, with the Redis store's cancel: what each call charged is kept by its id
    and given back (:func:`limiter.ratelimit.refund`). ``MemoryRateCounters`` keeps no such
    record (a call in the process always completes): this is the model the Redis cancel is
    held to."""

    def __init__(self, now_ms: int) -> None:
        self.now = now_ms
        self.held: dict[str, tuple[Counter, Promise]] = {}
        self.charges: dict[str, list[tuple[Hit, int]]] = {}  # call id → (hit, charged at)

    def state(self, hit: Hit) -> tuple[Counter, Promise]:
        return self.held.setdefault(hit.key, (new_counter(hit.limit, self.now), Promise()))

    def call(self, call_id: str, *hits: Hit) -> list[Verdict]:
        verdicts = decide(hits, self.state, self.now)
        passed = admitted(hits, [v.fits for v in verdicts])
        self.charges[call_id] = [(hit, self.now) for hit, v in zip(hits, verdicts, strict=True)
                                 if hit.cost and charged(hit, v.fits, passed)]
        return verdicts

    def cancel(self, call_id: str) -> None:
        for hit, at in self.charges.pop(call_id, []):
            refund(*self.state(hit), hit.cost, at, self.now)
