"""Token quotas (UTC days and months), lease TTLs, the usage snapshot and the wall clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from limiter import (
    DAY_MS,
    Admit,
    Cost,
    Period,
    QuotaCounter,
    Rate,
    Reason,
    Reject,
    SlidingWindow,
    TenantLimiter,
    TenantPolicy,
    TokenBucket,
    period_bounds,
    wall_ms,
)
from limiter.stores import MemoryStore
from tests.limiter_support import admit_ok, admit_rejected

FAST = settings(max_examples=250, deadline=None)


def _ms(*args: int) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)  # type: ignore[misc]




# --- calendar ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "period", "start", "end"),
    [
        (_ms(2024, 2, 29, 12), Period.DAY, _ms(2024, 2, 29), _ms(2024, 3, 1)),
        (_ms(2024, 2, 29, 12), Period.MONTH, _ms(2024, 2, 1), _ms(2024, 3, 1)),
        (_ms(2023, 2, 28, 23, 59, 59), Period.MONTH, _ms(2023, 2, 1), _ms(2023, 3, 1)),
        (_ms(2025, 12, 31, 23, 59, 59) + 999, Period.MONTH, _ms(2025, 12, 1), _ms(2026, 1, 1)),
        (_ms(2026, 1, 1), Period.MONTH, _ms(2026, 1, 1), _ms(2026, 2, 1)),
        (_ms(2026, 1, 1), Period.DAY, _ms(2026, 1, 1), _ms(2026, 1, 2)),
        (-1, Period.DAY, -DAY_MS, 0),
        (-1, Period.MONTH, _ms(1969, 12, 1), 0),
    ],
)
def test_period_bounds_examples(now: int, period: Period, start: int, end: int) -> None:
    assert period_bounds(now, period) == (start, end)


@FAST
@given(st.integers(-(10**13), 10**13), st.sampled_from(list(Period)))
def test_period_bounds_are_utc_calendar_periods(now: int, period: Period) -> None:
    start, end = period_bounds(now, period)
    assert start <= now < end
    first = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=start)
    assert (first.hour, first.minute, first.second, first.microsecond) == (0, 0, 0, 0)
    if period is Period.DAY:
        assert end - start == DAY_MS
    else:
        assert first.day == 1
        assert end - start in {28 * DAY_MS, 29 * DAY_MS, 30 * DAY_MS, 31 * DAY_MS}
    assert period_bounds(end - 1, period) == (start, end)
    assert period_bounds(end, period)[0] == end


def test_quota_counter_rolls_forward_and_ignores_steps_back() -> None:
    counter = QuotaCounter(Period.DAY)
    day2 = _ms(2026, 3, 2)
    counter.consume(100, day2 + 5)
    assert counter.view(1000, day2 - 10).used == 100  # a step back into yesterday: kept
    assert counter.view(1000, day2 - 10).reset_ms == DAY_MS + 10
    counter.reconcile(300, day2 + 6)  # refund more than used: floored at 0
    assert counter.view(1000, day2 + 7).used == 0
    counter.reconcile(-50, day2 + 8)  # an overshoot is charged
    assert counter.view(1000, day2 + DAY_MS - 1).used == 50
    assert counter.view(1000, day2 + DAY_MS).used == 0


# --- quotas in the limiter ---------------------------------------------------------------

DAILY = TenantPolicy(daily_token_quota=1000)


def test_policy_validates_quotas() -> None:
    with pytest.raises(ValueError):
        TenantPolicy(daily_token_quota=0)
    with pytest.raises(TypeError):
        TenantPolicy(monthly_token_quota=1.5)  # type: ignore[arg-type]
    policy = TenantPolicy(monthly_token_quota=5, daily_token_quota=3)
    assert policy.quotas() == ((Period.DAY, 3), (Period.MONTH, 5))


def test_daily_quota_rejects_until_midnight_utc() -> None:
    now = _ms(2026, 5, 17, 23, 0)
    limiter = TenantLimiter(DAILY, now)
    admit_ok(limiter, Cost(500, 400), "a", now)
    rejected = admit_rejected(limiter, Cost(50, 51), "b", now)
    assert rejected.reason is Reason.QUOTA
    assert rejected.retry_after_ms is None
    assert rejected.reset_ms == 3_600_000
    assert rejected.remaining.quota_limit == 1000
    assert rejected.remaining.quota_remaining == 100
    assert rejected.remaining.quota_reset_ms == 3_600_000
    assert rejected.message == (
        "tenant over its daily token quota (900 of 1000 used); this request reserves 101 "
        "tokens; the quota resets in 1h0m0s"
    )
    admit_ok(limiter, Cost(50, 50), "b", now)  # exactly up to the quota is fine
    assert isinstance(limiter.admit(Cost(0, 1), "c", _ms(2026, 5, 18) - 1), Reject)
    admit_ok(limiter, Cost(0, 1000), "c", _ms(2026, 5, 18))


def test_request_larger_than_the_quota_is_too_large() -> None:
    limiter = TenantLimiter(TenantPolicy(daily_token_quota=100, monthly_token_quota=50), 0)
    rejected = admit_rejected(limiter, Cost(40, 20), "a", 0)
    assert (rejected.reason, rejected.retry_after_ms) == (Reason.TOO_LARGE, None)
    assert "monthly token quota is 50" in rejected.message


def test_monthly_quota_outlives_days_and_both_failing_report_the_later_reset() -> None:
    now = _ms(2026, 2, 27, 12)
    policy = TenantPolicy(daily_token_quota=600, monthly_token_quota=1000)
    limiter = TenantLimiter(policy, now)
    admit_ok(limiter, Cost(600, 0), "a", now)
    rejected = admit_rejected(limiter, Cost(1, 0), "b", now)
    assert rejected.reset_ms == _ms(2026, 2, 28) - now  # only the daily one is spent
    admit_ok(limiter, Cost(400, 0), "b", _ms(2026, 2, 28))
    rejected = admit_rejected(limiter, Cost(600, 0), "c", _ms(2026, 2, 28, 1))
    assert "daily token quota (400 of 600 used) and monthly token quota" in rejected.message
    assert rejected.reset_ms == _ms(2026, 3, 1) - _ms(2026, 2, 28, 1)
    assert rejected.remaining.quota_remaining == 0  # the monthly one binds
    admit_ok(limiter, Cost(600, 0), "c", _ms(2026, 3, 1))


def test_tightest_quota_on_a_tie_is_the_later_reset() -> None:
    policy = TenantPolicy(daily_token_quota=100, monthly_token_quota=100)
    now = _ms(2026, 7, 10)
    admitted = admit_ok(TenantLimiter(policy, now), Cost(100, 0), "a", now)
    assert admitted.remaining.quota_reset_ms == _ms(2026, 8, 1) - now


def test_quota_reconciliation_refunds_and_charges() -> None:
    now = _ms(2026, 4, 1, 8)
    limiter = TenantLimiter(TenantPolicy(daily_token_quota=1000, token_rate=Rate(1, 1),
                                         token_burst=1000), now)
    admit_ok(limiter, Cost(100, 500), "a", now)
    assert limiter.release("a", 150, now)
    assert limiter.usage(now)["quotas"]["daily"]["used"] == 150
    admit_ok(limiter, Cost(100, 100), "b", now)
    assert limiter.release("b", 700, now)  # 500 over the reservation: charged
    assert limiter.usage(now)["quotas"]["daily"]["used"] == 850
    admit_ok(limiter, Cost(100, 0), "c", now)
    assert limiter.release("c", None, now)  # unknown usage: the reservation counts
    assert limiter.usage(now)["quotas"]["daily"]["used"] == 950
    admit_ok(limiter, Cost(0, 50), "d", now)
    assert limiter.release("d", 0, now + DAY_MS)  # a lease across midnight: floored at 0
    assert limiter.usage(now + DAY_MS)["quotas"]["daily"]["used"] == 0


def test_quota_usage_survives_a_policy_toggle() -> None:
    now = _ms(2026, 4, 1, 8)
    limiter = TenantLimiter(DAILY, now)
    admit_ok(limiter, Cost(700, 0), "a", now)
    limiter.update_policy(TenantPolicy(), now)
    admit_ok(limiter, Cost(700, 0), "b", now)  # no quota: not counted
    limiter.update_policy(DAILY, now)
    assert admit_rejected(limiter, Cost(301, 0), "c", now).reason is Reason.QUOTA
    assert limiter.release("b", 0, now)  # b was never charged to the quota
    assert limiter.usage(now)["quotas"]["daily"]["used"] == 700


@st.composite
def quota_histories(draw: st.DrawFn) -> tuple[TenantPolicy, list[tuple[str, int, int]], int]:
    policy = TenantPolicy(
        daily_token_quota=draw(st.one_of(st.none(), st.integers(1, 5000))),
        monthly_token_quota=draw(st.one_of(st.none(), st.integers(1, 20_000))),
    )
    steps = st.tuples(
        st.sampled_from(["admit", "admit", "release", "advance"]),
        st.one_of(st.integers(0, 3000), st.integers(1500, 3000)),
        st.sampled_from([0, 1, 1000, 3_600_000, DAY_MS // 3, 7 * DAY_MS]),
    )
    month = draw(st.tuples(st.integers(2020, 2035), st.integers(1, 12)))
    start = _ms(month[0], month[1], 1) - draw(st.integers(0, 2 * DAY_MS))
    return policy, draw(st.lists(steps, min_size=4, max_size=50)), start


@FAST
@given(quota_histories())
def test_quota_never_exceeded_and_reset_is_exact(
    history: tuple[TenantPolicy, list[tuple[str, int, int]], int],
) -> None:
    """Without overshoot no UTC period's count passes its quota; a QUOTA rejection's reset
    is the end of the (latest) spent period, and the request fits exactly then."""
    policy, steps, now = history
    limiter, held = TenantLimiter(policy, now), {}
    for n, (kind, amount, gap) in enumerate(steps):
        if kind == "advance":
            now += gap
        elif kind == "release" and held:
            lease = sorted(held)[amount % len(held)]
            assert limiter.release(lease, held.pop(lease) * amount // 3000, now)
        elif kind == "admit":
            amount = amount * min(limit for _, limit in policy.quotas() or [(0, 3000)]) // 2000
            result = limiter.admit(Cost(amount, 0), f"l{n}", now)
            if isinstance(result, Admit):
                held[result.lease_id] = amount
            elif result.reason is Reason.QUOTA:
                _check_quota_reset(limiter, policy, result, amount, now)
        for view in limiter.snapshot(now).quotas:
            assert view.used <= view.limit


def _check_quota_reset(
    limiter: TenantLimiter, policy: TenantPolicy, result: Reject, tokens: int, now: int
) -> None:
    ends = {period_bounds(now, period)[1] - now: period for period, _ in policy.quotas()}
    assert result.reset_ms in ends
    event(f"quota reset at the {ends[result.reset_ms]} boundary")
    at = now + result.reset_ms
    probe = TenantLimiter(policy, now)
    probe._quotas = limiter._quotas  # same counters, no leases: the quota alone decides
    assert isinstance(probe.admit(Cost(tokens, 0), "probe", at - 1), Reject)
    probe._quotas = {p: _copy_counter(c) for p, c in limiter._quotas.items()}
    assert isinstance(probe.admit(Cost(tokens, 0), "probe", at), Admit)


def _copy_counter(counter: QuotaCounter) -> QuotaCounter:
    copy = QuotaCounter(counter.period)
    copy.start_ms, copy.used = counter.start_ms, counter.used
    return copy


# --- lease TTL, usage, clock, reconfigure -------------------------------------------------


def test_lease_ttl_frees_slots_and_renew_extends() -> None:
    policy = TenantPolicy(max_concurrency=2)
    limiter = TenantLimiter(policy, 0, lease_ttl_ms=100)
    admit_ok(limiter, Cost(1, 1), "a", 0)
    admit_ok(limiter, Cost(1, 1), "b", 50)
    assert admit_rejected(limiter, Cost(1, 1), "c", 99).reason is Reason.CONCURRENCY
    assert limiter.renew(["a", "zzz"], 99) == 1
    assert limiter.expire_leases(150) == 1  # b expired at 150; a lives until 199
    assert limiter.release("b", 0, 150) is False
    admit_ok(limiter, Cost(1, 1), "c", 150)
    assert limiter.expire_leases(199) == 1
    assert limiter.release("a", 0, 199) is False


def test_usage_snapshot_is_json_friendly() -> None:
    now = _ms(2026, 6, 15, 12)
    policy = TenantPolicy(
        request_rate=Rate(1, 1000), request_burst=2, token_rate=Rate(1, 10), token_burst=100,
        window_limit=5, window_ms=1000, max_concurrency=3, monthly_token_quota=10_000,
        shaping_rate=Rate(1, 100), shaping_backlog=4,
    )
    limiter = TenantLimiter(policy, now)
    admit_ok(limiter, Cost(30, 20), "a", now)
    assert limiter.usage(now) == {
        "in_flight": 1,
        "max_concurrency": 3,
        "requests": {"limit": 2, "available": 1, "reset_ms": 1000},
        "tokens": {"limit": 100, "available": 50, "reset_ms": 500},
        "window": {"limit": 5, "window_ms": 1000, "used": 1, "reset_ms": 1000},
        "quotas": {"monthly": {"limit": 10_000, "used": 50, "remaining": 9950,
                               "reset_ms": _ms(2026, 7, 1) - now,
                               "period_start_ms": _ms(2026, 6, 1)}},
        "shaping": {"backlog": 4, "held": 0, "drain_ms": 100},
    }
    admit_ok(limiter, Cost(1, 1), "b", now)
    assert limiter.usage(now)["shaping"] == {"backlog": 4, "held": 1, "drain_ms": 200}
    assert TenantLimiter(TenantPolicy(), now).usage(now)["tokens"] is None


async def test_memory_store_runs_on_the_wall_clock() -> None:
    store = MemoryStore()
    before = wall_ms()
    usage = await store.usage("acme", DAILY)
    starts = {period_bounds(t, Period.DAY)[0] for t in (before, wall_ms())}
    assert usage["quotas"]["daily"]["period_start_ms"] in starts
    await store.renew("acme", ["nothing"])
    await store.close()


async def test_memory_store_lease_ttl() -> None:
    now = [0]
    store = MemoryStore(lambda: now[0], lease_ttl_ms=10)
    assert isinstance(await store.admit("acme", DAILY, Cost(1, 1), "a"), Admit)
    now[0] = 9
    await store.renew("acme", ["a"])
    now[0] = 18
    assert await store.in_flight("acme") == 1
    now[0] = 19
    assert await store.in_flight("acme") == 0


def test_full_bucket_stays_full_on_reconfigure() -> None:
    bucket = TokenBucket(Rate(1, 1000), capacity=10, now_ms=0)
    bucket.reconfigure(Rate(1, 10), 50, 5)
    assert bucket.available(5) == 50
    bucket.consume(1, 5)
    bucket.reconfigure(Rate(1, 10), 100, 5)  # not full: the level is kept
    assert bucket.available(5) == 49


def test_window_reconfigure_does_not_resurrect_expired_entries() -> None:
    window = SlidingWindow(limit=2, window_ms=100)
    window.consume(2, 0)
    window.reconfigure(2, 10_000, 500)  # expired at 100 under the old window
    assert window.used(500) == 0


def test_a_quota_refusal_reports_the_reset_that_admits_the_request() -> None:
    """Both quotas refuse and the daily one has fewer tokens left: the ``-quota`` headers
    named the daily reset (in 12 h), where the monthly quota still refused until the 1st of
    the month; they describe the refusing quota that resets last."""
    now = _ms(2026, 3, 6, 12)
    limiter = TenantLimiter(TenantPolicy(daily_token_quota=1000, monthly_token_quota=5000), now)
    limiter.restore_quotas([(Period.DAY, _ms(2026, 3, 6), 990),  # 10 left today
                            (Period.MONTH, _ms(2026, 3, 1), 4950)])  # 50 this month
    rejected = admit_rejected(limiter, Cost(60, 0), "big", now)
    assert rejected.reset_ms == _ms(2026, 4, 1) - now
    quota = rejected.remaining
    assert (quota.quota_limit, quota.quota_remaining, quota.quota_reset_ms) == (
        5000, 50, rejected.reset_ms)
    assert isinstance(limiter.admit(Cost(60, 0), "big", _ms(2026, 3, 7)), Reject)  # daily reset
    admit_ok(limiter, Cost(60, 0), "big", _ms(2026, 4, 1))
