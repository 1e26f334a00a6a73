"""The one place kvgate reads the wall: everything in ``limiter`` takes ``now_ms`` instead.

The limiter's clock is **wall-clock epoch milliseconds** (UTC): token quotas reset at
calendar boundaries (00:00 UTC, the 1st of the month), and the Redis store uses Redis
``TIME``, so the in-process clock must count on the same scale. Wall clocks can step
backwards (NTP); every bucket treats a step back as no elapsed time, never as negative
refill, so that is safe.
"""

from __future__ import annotations

import time


def wall_ms() -> int:
    """Integer epoch milliseconds (UTC): the limiter's default clock."""
    return time.time_ns() // 1_000_000


def monotonic_ms() -> int:
    """Integer milliseconds from a clock that never jumps, for measuring durations only
    (it has no epoch, so it cannot place a request in a calendar day)."""
    return time.monotonic_ns() // 1_000_000
