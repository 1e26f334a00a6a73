"""One replica's share of a tenant's limits, for when the shared store is unreachable.

With N replicas each enforcing 1/N of every limit locally, the fleet as a whole stays near
the configured limit without talking to each other. Quotas are not shared out: a replica
cannot know how much of a day's quota the fleet has used, so they are not enforced locally.
"""

from __future__ import annotations

import dataclasses
import math

from limiter.decision import TenantPolicy
from limiter.rates import Rate


def scale_policy(policy: TenantPolicy, replicas: int) -> TenantPolicy:
    """``policy`` with every rate, burst and concurrency divided by ``replicas`` (≥ 1 each;
    a shaper's backlog rounded up, so 0 stays 0)."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if replicas == 1:
        return _without_quotas(policy)

    def share(value: int | None) -> int | None:
        return None if value is None else max(1, math.ceil(value / replicas))

    return _without_quotas(
        dataclasses.replace(
            policy,
            request_rate=_slower(policy.request_rate, replicas),
            request_burst=share(policy.request_burst),
            token_rate=_slower(policy.token_rate, replicas),
            token_burst=share(policy.token_burst),
            max_concurrency=share(policy.max_concurrency),
            window_limit=share(policy.window_limit),
            shaping_rate=_slower(policy.shaping_rate, replicas),
            shaping_backlog=None if policy.shaping_backlog is None
            else math.ceil(policy.shaping_backlog / replicas),
        )
    )


def _slower(rate: Rate | None, replicas: int) -> Rate | None:
    return None if rate is None else Rate(rate.amount, rate.period_ms * replicas)


def _without_quotas(policy: TenantPolicy) -> TenantPolicy:
    quota_fields = {f.name for f in dataclasses.fields(policy) if f.name.endswith("_quota")}
    return dataclasses.replace(policy, **dict.fromkeys(quota_fields))
