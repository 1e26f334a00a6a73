"""Unit tests for the multi-dimension admission decision and the in-memory store."""

from __future__ import annotations

import pytest

from limiter import Admit, Cost, Rate, Reason, Reject, Remaining, TenantLimiter, TenantPolicy
from limiter.calendar import Period
from limiter.stores import LimiterStore, MemoryStore
from tests.limiter_support import admit_ok, admit_rejected

TOKENS = TenantPolicy(token_rate=Rate(1, 1), token_burst=1000)  # 1 token/ms, 1000 burst




def test_policy_validation() -> None:
    TenantPolicy()  # everything unlimited
    with pytest.raises(ValueError, match="set together"):
        TenantPolicy(request_rate=Rate(1, 1000))
    with pytest.raises(ValueError, match="set together"):
        TenantPolicy(window_limit=5)
    with pytest.raises(ValueError):
        TenantPolicy(max_concurrency=0)
    with pytest.raises(ValueError):
        TenantPolicy(concurrency_retry_ms=0)


def test_cost_tokens_is_the_reservation() -> None:
    assert Cost(100, 28).tokens == 128
    with pytest.raises(ValueError):
        Cost(-1, 0)


def test_unlimited_policy_admits_everything() -> None:
    limiter = TenantLimiter(TenantPolicy(), now_ms=0)
    result = admit_ok(limiter, Cost(10**6, 10**6), "a", 0)
    assert result.remaining == Remaining(None, None, None, None, None, None)
    assert limiter.in_flight == 1
    assert limiter.check_requests(0) is None


def test_admit_reports_remaining_after_consumption() -> None:
    policy = TenantPolicy(
        request_rate=Rate.per_second(1), request_burst=2, token_rate=Rate(1, 1), token_burst=1000
    )
    limiter = TenantLimiter(policy, now_ms=0)
    result = admit_ok(limiter, Cost(300, 100), "a", 0)
    assert result.remaining == Remaining(2, 1, 1000, 1000, 600, 400)


def test_token_rejection_has_exact_retry_and_message() -> None:
    limiter = TenantLimiter(TOKENS, now_ms=0)
    admit_ok(limiter, Cost(900, 0), "a", 0)
    rejected = admit_rejected(limiter, Cost(1000, 234), "b", 0)
    assert rejected.reason is Reason.TOO_LARGE
    assert rejected.retry_after_ms is None
    rejected = admit_rejected(limiter, Cost(1000, 0), "b", 0)
    assert rejected.reason is Reason.TOKENS
    assert rejected.retry_after_ms == 900
    assert rejected.message == "tenant over its token rate limit; retry after 0.900 s"
    assert rejected.remaining.tokens_remaining == 100
    assert isinstance(limiter.admit(Cost(1000, 0), "b", 899), Reject)
    admit_ok(limiter, Cost(1000, 0), "b", 900)


def test_rejection_consumes_nothing_all_or_nothing() -> None:
    policy = TenantPolicy(
        request_rate=Rate(1, 1000), request_burst=5, token_rate=Rate(1, 10), token_burst=100
    )
    limiter = TenantLimiter(policy, now_ms=0)
    admit_ok(limiter, Cost(90, 0), "a", 0)
    before = limiter.remaining(0)
    admit_rejected(limiter, Cost(50, 0), "b", 0)  # requests fit, tokens do not
    assert limiter.remaining(0) == before
    assert limiter.in_flight == 1


def test_max_of_waits_and_combined_message() -> None:
    policy = TenantPolicy(
        request_rate=Rate(1, 1000), request_burst=1, token_rate=Rate(1, 10), token_burst=100
    )
    limiter = TenantLimiter(policy, now_ms=0)
    admit_ok(limiter, Cost(100, 0), "a", 0)
    rejected = admit_rejected(limiter, Cost(50, 0), "b", 0)
    assert rejected.reason is Reason.REQUESTS  # 1000 ms beats the 500 ms token wait
    assert rejected.retry_after_ms == 1000
    assert "request rate and token rate limits" in rejected.message


def test_context_limit_is_not_retryable() -> None:
    limiter = TenantLimiter(TenantPolicy(max_context_tokens=4096), now_ms=0)
    rejected = admit_rejected(limiter, Cost(5000, 10), "a", 0)
    assert rejected.reason is Reason.CONTEXT
    assert rejected.retry_after_ms is None
    assert "5000" in rejected.message and "4096" in rejected.message
    admit_ok(limiter, Cost(4096, 10_000), "a", 0)


def test_request_count_above_burst_is_too_large() -> None:
    policy = TenantPolicy(window_limit=2, window_ms=1000)
    limiter = TenantLimiter(policy, now_ms=0)
    rejected = admit_rejected(limiter, Cost(1, 1, requests=3), "a", 0)
    assert rejected.reason is Reason.TOO_LARGE
    assert rejected.retry_after_ms is None


def test_concurrency_slot_and_retry_hint() -> None:
    policy = TenantPolicy(max_concurrency=1, concurrency_retry_ms=250)
    limiter = TenantLimiter(policy, now_ms=0)
    admit_ok(limiter, Cost(1, 1), "a", 0)
    blocked = limiter.check_requests(0)
    assert blocked is not None
    # no request has finished yet: the hint is the expected duration, plus half and 10 ms
    assert (blocked.reason, blocked.retry_after_ms) == (Reason.CONCURRENCY, 385)
    assert admit_rejected(limiter, Cost(1, 1), "b", 0).reason is Reason.CONCURRENCY
    assert limiter.release("a", 2, 5)
    assert limiter.in_flight == 0
    assert limiter.check_requests(5) is None
    admit_ok(limiter, Cost(1, 1), "b", 5)


def test_check_requests_peeks_only() -> None:
    policy = TenantPolicy(
        request_rate=Rate(1, 1000), request_burst=1, window_limit=1, window_ms=500
    )
    limiter = TenantLimiter(policy, now_ms=0)
    for _ in range(3):
        assert limiter.check_requests(0) is None
    admit_ok(limiter, Cost(0, 0), "a", 0)
    rejected = limiter.check_requests(0)
    assert rejected is not None
    assert (rejected.reason, rejected.retry_after_ms) == (Reason.REQUESTS, 1000)
    assert limiter.check_requests(1000) is None


def test_release_exactly_once_refunds_unused() -> None:
    limiter = TenantLimiter(TOKENS, now_ms=0)
    admit_ok(limiter, Cost(100, 500), "a", 0)
    assert limiter.remaining(0).tokens_remaining == 400
    assert limiter.release("a", 150, 0) is True
    assert limiter.remaining(0).tokens_remaining == 850
    assert limiter.release("a", 0, 0) is False
    assert limiter.remaining(0).tokens_remaining == 850
    assert limiter.release("never-admitted", 0, 0) is False


def test_release_refund_never_exceeds_capacity() -> None:
    limiter = TenantLimiter(TOKENS, now_ms=0)
    admit_ok(limiter, Cost(0, 1000), "a", 0)
    limiter.release("a", 0, 5000)  # bucket refilled meanwhile: the refund is capped
    assert limiter.remaining(5000).tokens_remaining == 1000


def test_release_charges_overshoot_and_unknown_usage() -> None:
    limiter = TenantLimiter(TOKENS, now_ms=0)
    admit_ok(limiter, Cost(100, 100), "a", 0)
    limiter.release("a", 1500, 0)  # 1300 over the reservation
    assert limiter.token_bucket is not None
    assert limiter.token_bucket.available(0) == -500
    assert limiter.remaining(0).tokens_remaining == 0
    rejected = admit_rejected(limiter, Cost(1, 0), "b", 0)
    assert rejected.retry_after_ms == 501
    admit_ok(limiter, Cost(10, 10), "c", 1000)
    limiter.release("c", None, 1000)  # unknown usage: the reservation counts as used
    assert limiter.token_bucket.available(1000) == 480


def test_duplicate_lease_is_a_bug() -> None:
    limiter = TenantLimiter(TenantPolicy(), now_ms=0)
    admit_ok(limiter, Cost(1, 1), "a", 0)
    with pytest.raises(ValueError):
        limiter.admit(Cost(1, 1), "a", 0)


def test_update_policy_keeps_levels_and_leases() -> None:
    limiter = TenantLimiter(TOKENS, now_ms=0)
    admit_ok(limiter, Cost(700, 0), "a", 0)
    tighter = TenantPolicy(token_rate=Rate(1, 2), token_burst=200, max_concurrency=1)
    limiter.update_policy(tighter, 0)
    assert limiter.remaining(0).tokens_remaining == 200
    assert limiter.in_flight == 1
    assert admit_rejected(limiter, Cost(1, 0), "b", 0).reason is Reason.CONCURRENCY
    limiter.update_policy(TenantPolicy(), 0)
    assert limiter.token_bucket is None
    assert limiter.release("a", 0, 0) is True


def test_time_going_backwards_does_not_break_admission() -> None:
    policy = TenantPolicy(
        request_rate=Rate(1, 100), request_burst=1, window_limit=5, window_ms=1000
    )
    limiter = TenantLimiter(policy, now_ms=10_000)
    admit_ok(limiter, Cost(1, 1), "a", 10_000)
    rejected = admit_rejected(limiter, Cost(1, 1), "b", 9_000)
    assert rejected.retry_after_ms == 100
    admit_ok(limiter, Cost(1, 1), "b", 10_100)


# --- the in-memory store -----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def test_memory_store_satisfies_the_protocol() -> None:
    assert isinstance(MemoryStore(), LimiterStore)


async def test_memory_store_per_tenant_state_and_policy_reload() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    policy = TenantPolicy(request_rate=Rate(1, 1000), request_burst=1, max_concurrency=5)
    assert await store.check_requests("acme", policy) is None
    assert isinstance(await store.admit("acme", policy, Cost(1, 1), "l1"), Admit)
    assert isinstance(await store.admit("globex", policy, Cost(1, 1), "l2"), Admit)
    rejected = await store.admit("acme", policy, Cost(1, 1), "l3")
    assert isinstance(rejected, Reject)
    assert rejected.retry_after_ms == 1000
    assert await store.in_flight("acme") == 1
    assert await store.in_flight("nobody") == 0
    looser = TenantPolicy(request_rate=Rate(1, 10), request_burst=1, max_concurrency=5)
    clock.now = 10
    rejected = await store.admit("acme", looser, Cost(1, 1), "l3")
    assert isinstance(rejected, Reject)
    assert rejected.retry_after_ms == 10  # the reload applied the new 1-per-10-ms rate
    clock.now = 20
    assert isinstance(await store.admit("acme", looser, Cost(1, 1), "l3"), Admit)
    assert await store.release("acme", looser, "l1", 1) is True
    assert await store.release("acme", looser, "l1", 1) is False
    assert await store.in_flight("acme") == 1


def test_message_lists_every_dimension_that_said_no() -> None:
    policy = TenantPolicy(
        request_rate=Rate(1, 1000),
        request_burst=1,
        token_rate=Rate(1, 10),
        token_burst=100,
        max_concurrency=1,
        concurrency_retry_ms=2000,
    )
    limiter = TenantLimiter(policy, now_ms=0)
    admit_ok(limiter, Cost(100, 0), "a", 0)
    rejected = admit_rejected(limiter, Cost(1, 0), "b", 0)
    assert (rejected.reason, rejected.retry_after_ms) == (Reason.CONCURRENCY, 3010)
    assert rejected.message == (
        "tenant over its request rate, token rate and concurrency limits; retry after 3.010 s"
    )


# --- the shaper as a dimension ------------------------------------------------------------

SHAPED = TenantPolicy(shaping_rate=Rate(1, 100), shaping_backlog=1, token_rate=Rate(1, 1),
                      token_burst=1000)


def test_shaping_policy_validation() -> None:
    with pytest.raises(ValueError, match="set together"):
        TenantPolicy(shaping_rate=Rate(1, 100))
    with pytest.raises(ValueError):
        TenantPolicy(shaping_rate=Rate(1, 100), shaping_backlog=-1)
    TenantPolicy(shaping_rate=Rate(1, 100), shaping_backlog=0)  # spacing only


def test_shaper_holds_then_refuses_with_its_exact_wait_all_or_nothing() -> None:
    limiter = TenantLimiter(SHAPED, now_ms=0)
    assert admit_ok(limiter, Cost(10, 10), "a", 0).hold_ms == 0
    assert admit_ok(limiter, Cost(10, 10), "b", 0).hold_ms == 100
    tokens = limiter.token_bucket.level_at(0)
    full = admit_rejected(limiter, Cost(10, 10), "c", 0)
    assert (full.reason, full.retry_after_ms, full.status) == (Reason.SHAPING, 100, 429)
    assert "shaping backlog" in full.message
    assert limiter.token_bucket.level_at(0) == tokens  # the refusal took nothing
    peek = limiter.check_requests(0)  # the headers-phase peek sees it too, and, as the
    assert peek is not None and peek.reason is Reason.SHAPING  # next refused client of a
    assert peek.retry_after_ms == 100 + 100  # herd, gets the slot one interval later
    assert limiter.check_requests(100) is None


def test_release_of_a_held_request_gives_its_slot_back() -> None:
    limiter = TenantLimiter(SHAPED, now_ms=0)
    admit_ok(limiter, Cost(10, 10), "a", 0)
    admit_ok(limiter, Cost(10, 10), "b", 0)  # held until 100
    assert limiter.release("b", 0, 40)  # its client left at 40
    assert admit_ok(limiter, Cost(10, 10), "c", 40).hold_ms == 60  # the same slot
    assert limiter.release("a", 5, 50)  # already sent: nothing to give back
    assert admit_rejected(limiter, Cost(10, 10), "d", 50).retry_after_ms == 50


def test_requests_that_count_no_request_are_not_shaped() -> None:
    limiter = TenantLimiter(SHAPED, now_ms=0)
    for n in range(3):
        assert admit_ok(limiter, Cost(1, 1, requests=0), f"l{n}", 0).hold_ms == 0
    assert limiter.shaper is not None and limiter.shaper.held(0) == 0


# --- forgetting a tenant no longer configured ---------------------------------------------

DAY_MS = 86_400_000
FORGET = TenantPolicy(request_rate=Rate(1, 1000), request_burst=2, daily_token_quota=1000,
                      max_concurrency=3)


def test_a_limiter_is_idle_once_back_to_a_new_ones_state() -> None:
    limiter = TenantLimiter(FORGET, 0)
    assert limiter.idle_in_ms(0) == 0
    admit_ok(limiter, Cost(10, 0), "a", 0)
    assert limiter.idle_in_ms(0) is None  # a lease is held
    limiter.release("a", 10, 0)
    assert limiter.idle_in_ms(0) == 1000  # one request to refill at 1/s
    assert limiter.idle_in_ms(1000) == 0
    assert limiter.quota_usage(1000) == [(Period.DAY, 0, 10)]
    assert limiter.quota_usage(DAY_MS) == []  # that day is over


async def test_a_forgotten_tenant_keeps_its_limits_until_they_are_back_to_a_new_ones() -> None:
    """In memory as in Redis (whose keys expire once back to their default): removing a
    tenant and configuring it again within a second does not refill its request bucket,
    nor within the day reset its daily quota; and once nothing is left to remember, the
    store holds nothing of it."""
    clock = FakeClock()
    store = MemoryStore(clock)
    for lease in ("a", "b"):
        assert isinstance(await store.admit("acme", FORGET, Cost(300, 0), lease), Admit)
        await store.release("acme", FORGET, lease, 300)
    assert store.forget(["acme", "never-seen"]) == ["acme", "never-seen"]
    clock.now = 500  # configured again: its bucket is still empty
    refused = await store.admit("acme", FORGET, Cost(1, 0), "c")
    assert isinstance(refused, Reject) and refused.reason is Reason.REQUESTS
    assert store.forget(["acme"]) == ["acme"]
    # back to full (the client refused at 500 ms takes a request at its slot, 1 s: full
    # again at 3 s): dropped, and its quota count is all that is kept
    clock.now = 3000
    assert store.forget([]) == []
    assert "acme" not in store._tenants and list(store._quotas_left) == ["acme"]
    admitted = await store.admit("acme", FORGET, Cost(300, 0), "d")
    assert isinstance(admitted, Admit)
    refused = await store.admit("acme", FORGET, Cost(300, 0), "e")  # 900 of 1000 used
    assert isinstance(refused, Reject) and refused.reason is Reason.QUOTA
    await store.release("acme", FORGET, "d", 300)
    clock.now = 4000
    store.forget(["acme"])
    clock.now = DAY_MS + 1  # the day is over: nothing is left at all
    store.forget([])
    assert store._tenants == {} and store._quotas_left == {} and store._fading == {}


async def test_a_tenant_holding_a_lease_is_not_forgotten() -> None:
    store = MemoryStore(FakeClock())
    assert isinstance(await store.admit("acme", FORGET, Cost(1, 0), "a"), Admit)
    assert store.forget(["acme"]) == []
    await store.release("acme", FORGET, "a", 1)
    assert store.forget(["acme"]) == ["acme"]


def test_a_lease_released_after_it_expired_settles_its_reservation_for_one_ttl():
    """As the Redis store does (its ``gone`` record): an expired lease frees no slot twice,
    but a release that comes within a lease TTL of the expiry being seen still settles the
    reservation against what was used; past that, nothing changes. The parity test found
    the memory store keeping the whole reservation charged where Redis refunded it."""
    policy = TenantPolicy(daily_token_quota=3000)
    limiter = TenantLimiter(policy, now_ms=0, lease_ttl_ms=700)
    for lease_id in ("a", "b"):
        assert isinstance(limiter.admit(Cost(0, 3), lease_id, 0), Admit)
    assert limiter.expire_leases(1000) == 0  # both expired, seen at 1000
    assert limiter.release("a", 1, 1500) is False  # within a TTL of 1000: settled
    assert limiter.remaining(1500).quota_remaining == 3000 - 1 - 3
    assert limiter.release("b", 0, 1700) is False  # 1000 + 700: its record is gone
    assert limiter.remaining(1700).quota_remaining == 3000 - 1 - 3
