"""A token-quota counter for one calendar period kind (daily or monthly).

The counter only counts; the limit lives in the policy, so a config change (or a quota
switched off and on again within the period) keeps what the tenant has already used: a
typo in a config reload must not wipe a month of billing usage.
"""

from __future__ import annotations

from dataclasses import dataclass

from limiter.calendar import Period, period_bounds
from limiter.rates import require_int


@dataclass(frozen=True)
class QuotaView:
    """A quota as seen at one instant: what ``Remaining``, rejections and ``usage`` report."""

    period: Period
    limit: int
    used: int
    reset_ms: int
    start_ms: int

    @property
    def remaining(self) -> int:
        """Tokens still allowed this period (never negative, even after an overshoot)."""
        return max(0, self.limit - self.used)

    def fits(self, tokens: int) -> bool:
        """used + tokens ≤ limit: the admission rule."""
        return self.used + tokens <= self.limit


class QuotaCounter:
    """Tokens used in the current period. A clock step back into an earlier period keeps
    the later period's count (like the buckets, a step back is no elapsed time)."""

    __slots__ = ("period", "start_ms", "used")

    def __init__(self, period: Period) -> None:
        self.period = period
        self.start_ms: int | None = None
        self.used = 0

    def _roll(self, now_ms: int) -> int:
        start = period_bounds(now_ms, self.period)[0]
        if self.start_ms is None or start > self.start_ms:
            self.start_ms, self.used = start, 0
        return self.start_ms

    def view(self, limit: int, now_ms: int) -> QuotaView:
        """The quota under ``limit`` at ``now_ms``; reset is when the counted period ends."""
        start = self._roll(now_ms)
        end = period_bounds(start, self.period)[1]
        return QuotaView(self.period, limit, self.used, end - now_ms, start)

    def consume(self, tokens: int, now_ms: int) -> None:
        """Count an admitted reservation."""
        self._roll(now_ms)
        self.used += require_int("tokens", tokens, 0)

    def reconcile(self, delta: int, now_ms: int) -> None:
        """Apply reserved − used on release: refund (never below 0) or charge the overshoot.

        A lease that outlived its period reconciles against the current one; the floor at
        0 keeps such a refund from turning into a bonus beyond a fresh period's budget.
        """
        self._roll(now_ms)
        self.used = max(0, self.used - delta)
