"""Calendar periods in UTC for token quotas: pure integer functions of epoch milliseconds.

Why UTC and epoch ms: quotas are billed per calendar day/month, and every replica (and the
Redis Lua script, which re-implements :func:`period_bounds` with the same integer
arithmetic) must agree on where a period starts, whatever its local timezone.
"""

from __future__ import annotations

from datetime import date, timedelta
from enum import StrEnum

DAY_MS = 86_400_000
_EPOCH = date(1970, 1, 1)


class Period(StrEnum):
    """A quota period; the value names it in messages and in the admin ``usage`` snapshot."""

    DAY = "daily"
    MONTH = "monthly"


def _day_start_ms(day: date) -> int:
    return (day - _EPOCH).days * DAY_MS


def period_bounds(now_ms: int, period: Period) -> tuple[int, int]:
    """``(start_ms, end_ms)`` of the UTC period containing ``now_ms``; end is exclusive."""
    day = now_ms // DAY_MS  # floor: instants before 1970 still land in the right day
    if period is Period.DAY:
        return day * DAY_MS, (day + 1) * DAY_MS
    first = (_EPOCH + timedelta(days=day)).replace(day=1)
    following = (first + timedelta(days=32)).replace(day=1)
    return _day_start_ms(first), _day_start_ms(following)
