"""The shared store's circuit breaker and the per-replica share of limits (sans-IO)."""

from __future__ import annotations

from limiter import Rate, TenantPolicy
from limiter.breaker import BreakerState, CircuitBreaker, Transition
from limiter.share import scale_policy


def test_opens_after_consecutive_failures_and_probes_once_per_period():
    breaker = CircuitBreaker(failure_threshold=3, open_ms=500)
    assert breaker.allow(0) == (True, None)
    assert breaker.failure(0) is None and breaker.failure(1) is None
    transition = breaker.failure(2)
    assert (transition.old, transition.new) == (BreakerState.CLOSED, BreakerState.OPEN)
    assert breaker.allow(501)[0] is False  # 499 ms after opening
    allowed, transition = breaker.allow(502)
    assert allowed and transition.new is BreakerState.HALF_OPEN
    assert breaker.allow(503)[0] is False  # one probe at a time
    assert breaker.failure(503).new is BreakerState.OPEN  # failed probe: a full period again
    assert breaker.allow(1002)[0] is False
    assert breaker.allow(1003)[0] is True
    assert breaker.success().new is BreakerState.CLOSED
    assert breaker.allow(1004) == (True, None)


def test_a_probe_never_heard_of_again_is_retried_after_the_open_period():
    """A probe whose caller was cancelled reports neither success nor failure: the breaker
    must not stay half-open for good, skipping the store with nothing left to close it."""
    breaker = CircuitBreaker(failure_threshold=1, open_ms=500)
    breaker.failure(0)
    assert breaker.allow(500) == (True, Transition(BreakerState.OPEN, BreakerState.HALF_OPEN))
    assert breaker.allow(999) == (False, None)  # the probe may still answer
    assert breaker.allow(1000) == (True, None)  # lost: one more probe, still half-open
    assert breaker.allow(1001) == (False, None)
    assert breaker.success().new is BreakerState.CLOSED


def test_a_success_resets_the_failure_count():
    breaker = CircuitBreaker(failure_threshold=2, open_ms=10)
    breaker.failure(0)
    breaker.success()
    assert breaker.failure(1) is None
    assert breaker.state is BreakerState.CLOSED


def test_each_replica_gets_its_share_of_every_limit():
    policy = TenantPolicy(
        request_rate=Rate.per_second(10), request_burst=5, token_rate=Rate.per_minute(600),
        token_burst=100, max_concurrency=3, window_limit=7, window_ms=1000,
        daily_token_quota=1000,
    )
    half = scale_policy(policy, 2)
    assert half.request_rate.per_ms() == policy.request_rate.per_ms() / 2
    assert half.token_rate.per_ms() == policy.token_rate.per_ms() / 2
    assert (half.request_burst, half.token_burst, half.max_concurrency, half.window_limit) == (
        3, 50, 2, 4)
    assert half.daily_token_quota is None  # the fleet's usage is unknowable locally
    assert scale_policy(policy, 1).request_burst == 5
    shaped = TenantPolicy(shaping_rate=Rate.per_second(4), shaping_backlog=5)
    third = scale_policy(shaped, 3)
    assert third.shaping_rate.per_ms() == shaped.shaping_rate.per_ms() / 3
    assert third.shaping_backlog == 2
    assert scale_policy(TenantPolicy(shaping_rate=Rate(1, 1), shaping_backlog=0),
                        2).shaping_backlog == 0
