"""kvgate's sans-IO admission core: exact integer bucket math behind an injected clock.

Nothing in this package's top level opens a socket, starts a thread or imports asyncio;
every time is an ``int`` of milliseconds passed in as ``now_ms``, which makes the whole core
deterministic and property-testable. Where the state lives (this process, or Redis) is the
business of the I/O adapters in :mod:`limiter.stores`, which answer with the core's types.
"""

import kvgate_native

kvgate_native.activate(__name__, __path__)  # compiled modules, when built (make native)

from limiter.buckets import Shaper, SlidingWindow, TokenBucket, ceil_div
from limiter.calendar import DAY_MS, Period, period_bounds
from limiter.clock import monotonic_ms, wall_ms
from limiter.decision import TenantLimiter, TenantPolicy, never_fits
from limiter.fairness import VirtualCounters
from limiter.fairqueue import FairQueue, QueuedRequest
from limiter.outcome import (
    NO_REMAINING,
    QUEUEABLE,
    Admit,
    BucketView,
    Cost,
    Reason,
    Reject,
    Remaining,
    Snapshot,
    WindowView,
    refuse,
)
from limiter.quota import QuotaCounter, QuotaView
from limiter.rates import Rate, format_duration

__all__ = [
    "DAY_MS",
    "NO_REMAINING",
    "QUEUEABLE",
    "Admit",
    "BucketView",
    "Cost",
    "FairQueue",
    "Period",
    "QueuedRequest",
    "QuotaCounter",
    "QuotaView",
    "Rate",
    "Reason",
    "Reject",
    "Remaining",
    "Shaper",
    "SlidingWindow",
    "Snapshot",
    "TenantLimiter",
    "TenantPolicy",
    "TokenBucket",
    "VirtualCounters",
    "WindowView",
    "ceil_div",
    "format_duration",
    "monotonic_ms",
    "never_fits",
    "period_bounds",
    "refuse",
    "wall_ms",
]
