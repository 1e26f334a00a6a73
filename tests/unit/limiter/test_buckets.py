"""Unit tests for the integer bucket math: rates, durations, buckets, window, shaper."""

from __future__ import annotations

import pytest

from limiter import Rate, Shaper, SlidingWindow, TokenBucket, ceil_div, format_duration

# --- rates -------------------------------------------------------------------------------


def test_rate_per_second_is_exact_for_fractions() -> None:
    assert Rate.per_second(2.5) == Rate(1, 400)
    assert Rate.per_second(10) == Rate(1, 100)
    assert Rate.per_second(0.1) == Rate(1, 10_000)
    assert Rate.per_second(1 / 3) == Rate(1, 3000)


def test_rate_per_minute_reduces_to_small_integers() -> None:
    assert Rate.per_minute(100_000) == Rate(5, 3)
    assert Rate.per_minute(60) == Rate(1, 1000)


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("inf"), float("nan"), 1e-9])
def test_rate_rejects_non_positive_or_unrepresentable(bad: float) -> None:
    with pytest.raises(ValueError):
        Rate.per_second(bad)


def test_rate_validates_fields() -> None:
    with pytest.raises(ValueError):
        Rate(0, 1000)
    with pytest.raises(ValueError):
        Rate(1, 0)
    with pytest.raises(TypeError):
        Rate(1.5, 1000)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0ms"),
        (-5, "0ms"),
        (12, "12ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (1234, "1.234s"),
        (1050, "1.05s"),
        (60_000, "1m0s"),
        (360_000, "6m0s"),
        (61_500, "1m1.5s"),
        (3_600_000, "1h0m0s"),
        (3_723_000, "1h2m3s"),
        (7_384_000, "2h3m4s"),
    ],
)
def test_format_duration_openai_style(ms: int, text: str) -> None:
    assert format_duration(ms) == text


def test_ceil_div() -> None:
    assert ceil_div(7, 2) == 4
    assert ceil_div(6, 2) == 3
    assert ceil_div(1, 5) == 1
    assert ceil_div(0, 5) == 0


# --- token bucket --------------------------------------------------------------------------


def test_token_bucket_starts_full_and_refills_exactly() -> None:
    bucket = TokenBucket(Rate.per_second(2.5), capacity=5, now_ms=0)  # 1 token / 400 ms
    assert bucket.available(0) == 5
    bucket.consume(5, 0)
    assert bucket.available(0) == 0
    assert bucket.wait_ms(1, 0) == 400
    assert bucket.available(399) == 0
    assert bucket.available(400) == 1
    assert bucket.reset_ms(0) == 2000
    assert bucket.available(10_000) == 5  # capped at capacity


def test_token_bucket_wait_is_exact_ceiling() -> None:
    bucket = TokenBucket(Rate(3, 1000), capacity=10, now_ms=0)  # 3 tokens per second
    bucket.consume(10, 0)
    # 1 token needs 1000/3 ms → 334 ms (333 gives 999 < 1000 scaled units)
    assert bucket.wait_ms(1, 0) == 334
    assert bucket.wait_ms(1, 333) == 1
    assert bucket.wait_ms(1, 334) == 0


def test_token_bucket_consume_requires_fit() -> None:
    bucket = TokenBucket(Rate(1, 1000), capacity=2, now_ms=0)
    bucket.consume(2, 0)
    with pytest.raises(ValueError):
        bucket.consume(1, 999)
    bucket.consume(1, 1000)


def test_token_bucket_cost_above_capacity_raises() -> None:
    bucket = TokenBucket(Rate(1, 1000), capacity=2, now_ms=0)
    with pytest.raises(ValueError):
        bucket.wait_ms(3, 0)
    with pytest.raises(ValueError):
        bucket.wait_ms(-1, 0)


def test_token_bucket_refund_capped_and_charge_into_debt() -> None:
    bucket = TokenBucket(Rate(1, 10), capacity=100, now_ms=0)
    bucket.consume(30, 0)
    bucket.refund(1000, 0)
    assert bucket.available(0) == 100
    bucket.charge(150, 0)
    assert bucket.available(0) == -50
    assert bucket.wait_ms(0, 0) == 500  # paying off the debt comes first
    assert bucket.wait_ms(10, 0) == 600
    assert bucket.reset_ms(0) == 1500


def test_token_bucket_debt_saturates_where_the_redis_script_does() -> None:
    """An RLS debt rule of 7 an hour charged 2^32-1 hits: the Redis script stops the debt at
    -2^51 scaled units (exact Lua doubles); memory went on, answering a wait 7x longer."""
    from limiter.buckets import MAX_DEBT_SCALED

    bucket = TokenBucket(Rate(7, 3_600_000), capacity=7, now_ms=0)
    bucket.charge(2**32 - 1, 0)
    assert bucket.level_scaled == -MAX_DEBT_SCALED
    assert bucket.wait_ms(1, 0) == ceil_div(MAX_DEBT_SCALED + 3_600_000, 7)
    bucket.reconfigure(Rate(1, 3_600_000), 7, 0)  # a reload keeps it within the bound too
    assert bucket.level_scaled == -MAX_DEBT_SCALED


def test_token_bucket_time_going_backwards_is_no_elapsed_time() -> None:
    bucket = TokenBucket(Rate(1, 100), capacity=10, now_ms=10_000)
    bucket.consume(10, 10_000)
    assert bucket.available(5_000) == 0
    assert bucket.wait_ms(1, 5_000) == 100  # not 5100: no negative refill
    bucket.charge(1, 5_000)
    assert bucket.last_ms == 10_000
    assert bucket.available(10_200) == 1


def test_token_bucket_reconfigure_keeps_level_clamped() -> None:
    bucket = TokenBucket(Rate(1, 1000), capacity=10, now_ms=0)
    bucket.consume(4, 0)
    bucket.reconfigure(Rate(1, 300), 5, 0)
    assert bucket.available(0) == 5
    bucket.consume(5, 0)
    assert bucket.wait_ms(1, 0) == 300
    bucket.reconfigure(Rate(7, 3000), 50, 0)  # rescaled level stays 0, capacity grows
    assert bucket.available(0) == 0


# --- sliding window -----------------------------------------------------------------------


def test_sliding_window_counts_events_inside_the_window() -> None:
    window = SlidingWindow(limit=3, window_ms=1000)
    window.consume(1, 0)
    window.consume(1, 100)
    window.consume(1, 200)
    assert window.remaining(200) == 0
    assert window.wait_ms(1, 200) == 800  # the event at 0 leaves at 1000
    assert window.wait_ms(1, 999) == 1
    assert window.remaining(1000) == 1
    assert window.wait_ms(2, 1000) == 100
    assert window.reset_ms(1000) == 200


def test_sliding_window_has_no_boundary_burst() -> None:
    window = SlidingWindow(limit=2, window_ms=1000)
    window.consume(2, 999)
    assert window.wait_ms(1, 1000) == 999  # a fixed window would allow 2 more at 1000


def test_sliding_window_merges_same_ms_and_bounds_memory() -> None:
    window = SlidingWindow(limit=5, window_ms=100)
    for _ in range(5):
        window.consume(1, 7)
    assert len(window) == 1
    window.consume(0, 8)
    assert len(window) == 1


def test_sliding_window_refund_removes_newest() -> None:
    window = SlidingWindow(limit=4, window_ms=1000)
    window.consume(2, 0)
    window.consume(2, 500)
    window.refund(3, 600)
    assert window.used(600) == 1
    assert window.reset_ms(600) == 400  # only the oldest entry (1 left of it) remains
    window.refund(10, 600)
    assert window.used(600) == 0


def test_sliding_window_rejects_impossible_costs() -> None:
    window = SlidingWindow(limit=2, window_ms=10)
    with pytest.raises(ValueError):
        window.wait_ms(3, 0)
    window.consume(2, 0)
    with pytest.raises(ValueError):
        window.consume(1, 5)


def test_sliding_window_time_going_backwards() -> None:
    window = SlidingWindow(limit=1, window_ms=100)
    window.consume(1, 1000)
    assert window.wait_ms(1, 500) == 100  # clamped to 1000: nothing elapsed
    window.consume(1, 1100)
    assert window.used(0) == 1


def test_sliding_window_reconfigure_keeps_usage() -> None:
    window = SlidingWindow(limit=10, window_ms=1000)
    window.consume(6, 0)
    window.reconfigure(4, 1000, 10)
    assert window.remaining(10) == 0
    assert window.wait_ms(1, 10) == 990


# --- shaper ------------------------------------------------------------------------------


def test_shaper_spaces_departures_at_the_rate_and_bounds_its_backlog() -> None:
    shaper = Shaper(Rate(1, 100), backlog=2)  # one request per 100 ms, two may wait
    slots = [shaper.take(0) for _ in range(3)]
    assert [shaper.delay_ms(slot, 0) for slot in slots] == [0, 100, 200]
    assert shaper.held(0) == 2
    assert shaper.wait_ms(0) == 100  # full: at 100 ms the first waiting one leaves
    assert shaper.wait_ms(99) == 1
    assert shaper.wait_ms(100) == 0
    assert shaper.delay_ms(shaper.take(100), 100) == 200  # departs at 300
    assert shaper.drain_ms(100) == 300


def test_shaper_idle_sends_at_once_and_fractional_rates_round_up() -> None:
    shaper = Shaper(Rate(3, 1000), backlog=5)
    assert shaper.delay_ms(shaper.take(0), 0) == 0
    assert shaper.delay_ms(shaper.take(0), 0) == 334  # 1000/3 ms, rounded up: never early
    assert shaper.delay_ms(shaper.take(0), 0) == 667
    assert shaper.delay_ms(shaper.take(5000), 5000) == 0  # idle again


def test_shaper_given_back_slot_is_reused_not_doubled() -> None:
    shaper = Shaper(Rate(1, 100), backlog=2)
    first, second, _third = (shaper.take(0) for _ in range(3))
    assert shaper.wait_ms(0) == 100
    shaper.give_back(second, 50)  # its client left before its send time (100)
    assert shaper.held(50) == 1 and shaper.wait_ms(50) == 0
    assert shaper.take(50) == second  # the next arrival departs in the hole, at 100
    shaper.give_back(first, 50)  # already sent: nothing to give back
    assert shaper.wait_ms(50) == 50


def test_shaper_backlog_zero_only_spaces() -> None:
    shaper = Shaper(Rate(1, 100), backlog=0)
    assert shaper.delay_ms(shaper.take(0), 0) == 0
    assert shaper.wait_ms(0) == 100 and shaper.wait_ms(100) == 0


def test_shaper_reconfigure_keeps_the_tail_time() -> None:
    shaper = Shaper(Rate(1, 100), backlog=5)
    for _ in range(3):
        shaper.take(0)
    shaper.reconfigure(Rate(1, 1000), 5)
    assert shaper.drain_ms(0) == 300
    assert shaper.delay_ms(shaper.take(0), 0) == 300
    assert shaper.drain_ms(0) == 1300
