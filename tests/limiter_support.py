"""Assertions the limiter tests share."""

from __future__ import annotations

from limiter import Admit, Cost, Reject, TenantLimiter


def admit_ok(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> Admit:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Admit), result
    return result


def admit_rejected(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> Reject:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Reject), result
    return result
