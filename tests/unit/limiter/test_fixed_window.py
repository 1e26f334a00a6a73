"""Why kvgate offers no fixed window for protection: a property test that builds one and
shows the 2× burst at a window boundary, which kvgate's token bucket and sliding window do
not let through.

A fixed window (what envoyproxy/ratelimit counts: ``limit`` per aligned ``[k·W, (k+1)·W)``)
forgets everything at each boundary, so ``limit`` requests just before it and ``limit`` just
after are all admitted: twice the limit within 2 ms. The same arrivals through a sliding
window of the same limit and length admit ``limit``, and through a token bucket refilling
``limit`` per window with a burst of ``limit`` at most ``limit`` plus what 1 ms refills.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from limiter import Rate, SlidingWindow, TokenBucket
from limiter.buckets import FixedWindow

PROPERTY = settings(max_examples=200, deadline=None)


def _through(limiter: SlidingWindow | TokenBucket | FixedWindow, times: list[int]
             ) -> list[int]:
    """The arrivals ``limiter`` admits, one request each."""
    take = limiter.charge if isinstance(limiter, FixedWindow) else limiter.consume
    admitted = []
    for now in times:
        if limiter.wait_ms(1, now) == 0:
            take(1, now)
            admitted.append(now)
    return admitted


def _sliding(limit: int, window_ms: int, times: list[int]) -> list[int]:
    return _through(SlidingWindow(limit, window_ms), times)


def _bucket(limit: int, window_ms: int, times: list[int]) -> list[int]:
    return _through(TokenBucket(Rate(limit, window_ms), limit, times[0] if times else 0), times)


def _fixed(limit: int, window_ms: int, times: list[int]) -> list[int]:
    """kvgate's own fixed window (offered by the Rate Limit Service for configurations
    carried over from envoyproxy/ratelimit), one request each."""
    return _through(FixedWindow(limit, window_ms), times)


def _most_within(admitted: list[int], span_ms: int) -> int:
    """The most admissions inside any closed interval of ``span_ms`` ms."""
    return max((sum(1 for t in admitted if start <= t <= start + span_ms) for start in admitted),
               default=0)


@PROPERTY
@given(st.integers(1, 50), st.integers(2, 60_000), st.integers(1, 10**6))
def test_fixed_window_admits_twice_its_limit_across_a_boundary(
    limit: int, window_ms: int, k: int
) -> None:
    boundary = k * window_ms
    times = [boundary - 1] * limit + [boundary] * limit  # a burst straddling the boundary
    assert _most_within(_fixed(limit, window_ms, times), 1) == 2 * limit
    assert len(_sliding(limit, window_ms, times)) == limit
    refill = -(-limit // window_ms)  # what 1 ms refills, rounded up (≤ 1 for W ≥ limit)
    assert len(_bucket(limit, window_ms, times)) <= limit + refill


@PROPERTY
@given(st.integers(1, 20), st.integers(2, 5000),
       st.lists(st.integers(0, 3000), min_size=1, max_size=120))
def test_bounds_over_any_arrivals(limit: int, window_ms: int, gaps: list[int]) -> None:
    """Whatever the arrivals, in any span of one window length: the sliding window admits
    at most ``limit``, the token bucket at most ``2 × limit`` only because its burst plus a
    whole window of refill is that much (in a span of 1 ms: ``limit`` plus one ms's refill),
    and the fixed window up to ``2 × limit`` in a span of 1 ms."""
    times, now = [], 0
    for gap in gaps:
        now += gap
        times.append(now)
    assert _most_within(_sliding(limit, window_ms, times), window_ms - 1) <= limit
    bucket = _bucket(limit, window_ms, times)
    assert _most_within(bucket, 1) <= limit + -(-limit // window_ms)
    assert _most_within(bucket, window_ms - 1) <= 2 * limit
    assert _most_within(_fixed(limit, window_ms, times), window_ms - 1) <= 2 * limit
