"""The one place kvgate reads the wall: everything in ``limiter`` takes ``now_ms`` instead."""

from __future__ import annotations

import time


def monotonic_ms() -> int:
    """Integer milliseconds from a clock that never jumps (NTP steps must not refill buckets)."""
    return time.monotonic_ns() // 1_000_000
