"""Rates as exact integer ratios, and OpenAI-style duration strings.

A rate is kept as ``amount`` units per ``period_ms`` milliseconds, both integers, so bucket
arithmetic never rounds: 2.5 requests/s is ``Rate(1, 400)``, not ``0.0025`` per ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

_MAX_DENOMINATOR = 1000


def require_int(name: str, value: object, minimum: int) -> int:
    """Reject bools, floats and out-of-range values early: a float here would break exactness."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Rate:
    """``amount`` units refill every ``period_ms`` milliseconds (both positive integers)."""

    amount: int
    period_ms: int

    def __post_init__(self) -> None:
        require_int("amount", self.amount, 1)
        require_int("period_ms", self.period_ms, 1)

    @classmethod
    def per_second(cls, x: float) -> Rate:
        """``x`` per second; fractional rates are kept exact to 1/1000 (2.5/s → 1 per 400 ms)."""
        return cls._from_float(x, 1000)

    @classmethod
    def per_minute(cls, x: float) -> Rate:
        """``x`` per minute, the unit token limits are usually quoted in."""
        return cls._from_float(x, 60_000)

    @classmethod
    def _from_float(cls, x: float, period_ms: int) -> Rate:
        if isinstance(x, bool) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"rate must be a positive finite number, got {x!r}")
        frac = Fraction(x).limit_denominator(_MAX_DENOMINATOR) / period_ms
        if frac == 0:
            raise ValueError(f"rate {x!r} is too small to represent (below 1/1000 per period)")
        # Fraction is already in lowest terms: small integers keep Redis doubles exact.
        return cls(frac.numerator, frac.denominator)

    def per_ms(self) -> Fraction:
        """The rate as an exact fraction of units per millisecond (for display and tests)."""
        return Fraction(self.amount, self.period_ms)


def format_duration(ms: int) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` style: ``12ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    ms = max(0, ms)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    seconds = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"
