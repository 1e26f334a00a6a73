"""What the limiter tests share: assertions, and the one Hypothesis strategy for policies."""

from __future__ import annotations

from hypothesis import strategies as st

from limiter import Admit, Cost, Rate, Reject, TenantLimiter, TenantPolicy

slow_rates = st.builds(Rate, st.integers(1, 5), st.integers(50, 5000))
token_rates = st.one_of(
    st.builds(Rate, st.integers(1, 50), st.integers(1, 5000)),
    st.builds(Rate.per_minute, st.integers(1, 10**6)),
)
small_windows = st.tuples(st.integers(1, 5), st.integers(1, 3000))


@st.composite
def policies(
    draw: st.DrawFn, *, concurrency: bool | None = None, quotas: bool = False
) -> TenantPolicy:
    """Every dimension optional; ``concurrency`` True/False forces a concurrency limit on or
    off; ``quotas`` adds daily/monthly token quotas small enough to be spent in one example."""
    request = draw(st.one_of(st.none(), st.tuples(slow_rates, st.integers(1, 5))))
    token = draw(st.one_of(st.none(), st.tuples(token_rates, st.integers(1, 3000))))
    window = draw(st.one_of(st.none(), small_windows))
    budget = token[1] if token else 3000
    quota = (st.one_of(st.none(), st.integers(budget, 4 * budget), st.integers(1, 20_000))
             if quotas else st.none())
    if concurrency is None:
        max_concurrency = draw(st.one_of(st.none(), st.integers(1, 4)))
    else:
        max_concurrency = draw(st.integers(1, 4)) if concurrency else None
    return TenantPolicy(
        request_rate=request and request[0],
        request_burst=request and request[1],
        token_rate=token and token[0],
        token_burst=token and token[1],
        window_limit=window and window[0],
        window_ms=window and window[1],
        max_concurrency=max_concurrency,
        max_context_tokens=draw(st.one_of(st.none(), st.none(), st.integers(1, 3000))),
        concurrency_retry_ms=draw(st.integers(1, 2000)),
        daily_token_quota=draw(quota),
        monthly_token_quota=draw(quota),
    )


def admit_ok(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> Admit:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Admit), result
    return result


def admit_rejected(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> Reject:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Reject), result
    return result
