"""kvgate's sans-IO admission core: exact integer bucket math behind an injected clock.

Nothing here opens a socket, starts a thread or imports asyncio; every time is an ``int`` of
wall-clock epoch milliseconds passed in as ``now_ms``, which makes the whole core
deterministic and property-testable. The Redis store (``limiter.redis_store.RedisStore``,
also reachable as ``limiter.RedisStore``) is imported lazily so the core needs no client.
"""

import kvgate_native

kvgate_native.activate(__name__, __path__)  # compiled modules, when built (make native)

from typing import Any

from limiter.buckets import LeakyBucket, SlidingWindow, TokenBucket, ceil_div
from limiter.calendar import DAY_MS, Period, period_bounds
from limiter.clock import monotonic_ms, wall_ms
from limiter.decision import Cost, TenantLimiter, TenantPolicy, never_fits
from limiter.fairness import Fairness, MemoryFairness, RedisFairness
from limiter.fairqueue import FairQueue, QueuedRequest
from limiter.memory import MemoryStore
from limiter.outcome import (
    Admit,
    BucketView,
    Reason,
    Reject,
    Remaining,
    Snapshot,
    WindowView,
)
from limiter.quota import QuotaCounter, QuotaView
from limiter.rates import Rate, format_duration
from limiter.store import LimiterStore, StoreUnavailable

__all__ = [
    "DAY_MS",
    "Admit",
    "BucketView",
    "Cost",
    "FairQueue",
    "Fairness",
    "LeakyBucket",
    "LimiterStore",
    "MemoryFairness",
    "MemoryStore",
    "Period",
    "QueuedRequest",
    "QuotaCounter",
    "QuotaView",
    "Rate",
    "Reason",
    "RedisFairness",
    "RedisStore",
    "Reject",
    "Remaining",
    "SlidingWindow",
    "Snapshot",
    "StoreUnavailable",
    "TenantLimiter",
    "TenantPolicy",
    "TokenBucket",
    "WindowView",
    "ceil_div",
    "format_duration",
    "monotonic_ms",
    "never_fits",
    "period_bounds",
    "wall_ms",
]


def __getattr__(name: str) -> Any:
    """``limiter.RedisStore`` without importing redis for users of the in-memory store."""
    if name == "RedisStore":
        from limiter.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module 'limiter' has no attribute {name!r}")
