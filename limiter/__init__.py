"""kvgate's sans-IO admission core: exact integer bucket math behind an injected clock.

Nothing here opens a socket, starts a thread or imports asyncio; every time is an ``int`` of
milliseconds passed in as ``now_ms``, which makes the whole core deterministic and
property-testable.
"""

from limiter.buckets import LeakyBucket, SlidingWindow, TokenBucket, ceil_div
from limiter.clock import monotonic_ms
from limiter.decision import (
    Admit,
    Cost,
    Reason,
    Reject,
    Remaining,
    TenantLimiter,
    TenantPolicy,
)
from limiter.memory import MemoryStore
from limiter.rates import Rate, format_duration
from limiter.store import LimiterStore

__all__ = [
    "Admit",
    "Cost",
    "LeakyBucket",
    "LimiterStore",
    "MemoryStore",
    "Rate",
    "Reason",
    "Reject",
    "Remaining",
    "SlidingWindow",
    "TenantLimiter",
    "TenantPolicy",
    "TokenBucket",
    "ceil_div",
    "format_duration",
    "monotonic_ms",
]
