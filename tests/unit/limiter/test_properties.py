"""Hypothesis properties of the limiter core, all checked with exact integer arithmetic.

The central promise: a rejected request retried exactly ``retry_after_ms`` later is admitted,
and 1 ms earlier it is not (absent other traffic). Plus the classic bounds: a token bucket
never admits more than ``rate × t + burst`` in any interval, a sliding window never more than
``limit`` in any window, and the shaper sends no faster than its rate and holds at most its
backlog.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from limiter import (
    Admit,
    Cost,
    Rate,
    Reason,
    Reject,
    Shaper,
    SlidingWindow,
    TenantLimiter,
    TenantPolicy,
    TokenBucket,
    format_duration,
)
from limiter.herd import MAX_HERD_WAIT_MS
from tests.limiter_support import assert_never_faster, policies

FAST = settings(max_examples=250, deadline=None)
SLOW = settings(max_examples=150, deadline=None)

rates = st.builds(Rate, st.integers(1, 50), st.integers(1, 5000))
# None: arrive exactly when the previous wait says it fits (exercises the tight edge).
gaps = st.one_of(st.none(), st.integers(0, 400))


def _ratio(draw: st.DrawFn, limit: int) -> int:
    """A cost in [0, limit], biased to the interesting top end."""
    return draw(st.one_of(st.integers(0, limit), st.just(limit), st.integers(limit // 2, limit)))


# --- rates and durations -----------------------------------------------------------------


@FAST
@given(st.integers(1, 10**6))
def test_per_second_is_exact_for_millis_decimals(n: int) -> None:
    assert Rate.per_second(n / 1000).per_ms() == Fraction(n, 10**6)


def _parse_duration(text: str) -> int:
    if text.endswith("ms"):
        return int(text[:-2])
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?([\d.]+)s", text)
    assert match, text
    hours, minutes, seconds = match.groups()
    total = Fraction(seconds) * 1000 + int(minutes or 0) * 60_000 + int(hours or 0) * 3_600_000
    assert total.denominator == 1
    return int(total)


@FAST
@given(st.integers(0, 10**9))
def test_format_duration_round_trips(ms: int) -> None:
    assert _parse_duration(format_duration(ms)) == ms


# --- token bucket ------------------------------------------------------------------------


@FAST
@given(rates, st.integers(1, 40), st.lists(st.tuples(gaps, st.integers(0, 40)), max_size=60))
def test_token_bucket_interval_bound(
    rate: Rate, capacity: int, arrivals: list[tuple[int | None, int]]
) -> None:
    """Over any [t_i, t_j]: admitted × period ≤ amount × (t_j − t_i) + capacity × period."""
    now, bucket, admitted = 0, TokenBucket(rate, capacity, 0), []
    for gap, raw_cost in arrivals:
        cost = min(raw_cost, capacity)
        now += bucket.wait_ms(cost, now) if gap is None else gap
        if bucket.wait_ms(cost, now) == 0:
            bucket.consume(cost, now)
            admitted.append((now, cost))
    period, amount = rate.period_ms, rate.amount
    for i, (start, _) in enumerate(admitted):
        total = 0
        for end, cost in admitted[i:]:
            total += cost
            assert total * period <= amount * (end - start) + capacity * period


@st.composite
def token_histories(draw: st.DrawFn) -> tuple[TokenBucket, int, int]:
    """A bucket (small or realistic per-minute sizes) after random consumes/charges/refunds."""
    big = draw(st.booleans())
    capacity = draw(st.integers(1, 10**6 if big else 50))
    rate = Rate.per_minute(draw(st.integers(1, 10**6))) if big else draw(rates)
    now = draw(st.integers(-(10**6), 10**6))
    bucket = TokenBucket(rate, capacity, now)
    for _ in range(draw(st.integers(0, 12))):
        op = draw(st.sampled_from(["consume", "consume", "charge", "refund"]))
        now += draw(st.integers(0, 5000))
        amount = _ratio(draw, capacity)
        if op == "consume" and bucket.wait_ms(amount, now) == 0:
            bucket.consume(amount, now)
        elif op == "charge":
            bucket.charge(amount, now)
        elif op == "refund":
            bucket.refund(amount, now)
        assert bucket.level_at(now) <= bucket.full_scaled
    return bucket, now, _ratio(draw, capacity)


@FAST
@given(token_histories())
def test_token_bucket_retry_exactness(history: tuple[TokenBucket, int, int]) -> None:
    bucket, now, cost = history
    wait = bucket.wait_ms(cost, now)
    event("token bucket: must wait" if wait else "token bucket: fits now")
    if wait > 0:
        assert bucket.wait_ms(cost, now + wait - 1) > 0
        assert bucket.available(now + wait - 1) * bucket.rate.period_ms < bucket.full_scaled
    assert bucket.wait_ms(cost, now + wait) == 0
    bucket.consume(cost, now + wait)


# --- sliding window ----------------------------------------------------------------------

windows = st.tuples(st.integers(1, 20), st.integers(1, 3000))


@FAST
@given(windows, st.lists(st.tuples(gaps, st.integers(0, 20)), max_size=80))
def test_sliding_window_never_exceeds_limit(
    shape: tuple[int, int], arrivals: list[tuple[int | None, int]]
) -> None:
    limit, window_ms = shape
    window, now, admitted = SlidingWindow(limit, window_ms), 0, []
    for gap, raw_cost in arrivals:
        cost = min(raw_cost, limit)
        now += window.wait_ms(cost, now) if gap is None else gap
        if window.wait_ms(cost, now) == 0:
            window.consume(cost, now)
            admitted.append((now, cost))
        assert len(window) <= limit
    for end, _ in admitted:
        assert sum(c for t, c in admitted if end - window_ms < t <= end) <= limit


@FAST
@given(windows, st.lists(st.tuples(st.booleans(), st.integers(0, 800), st.integers(0, 20))))
def test_sliding_window_retry_exactness(
    shape: tuple[int, int], ops: list[tuple[bool, int, int]]
) -> None:
    limit, window_ms = shape

    def replayed() -> tuple[SlidingWindow, int]:
        window, now = SlidingWindow(limit, window_ms), 0
        for is_refund, gap, raw_cost in ops:
            now, cost = now + gap, min(raw_cost, limit)
            if is_refund:
                window.refund(cost // 2, now)
            elif window.wait_ms(cost, now) == 0:
                window.consume(cost, now)
        return window, now

    for cost in range(limit + 1):
        probe, now = replayed()  # a fresh copy of the state for every probe
        wait = probe.wait_ms(cost, now)
        if wait > 0:
            assert probe.wait_ms(cost, now + wait - 1) > 0
        assert probe.wait_ms(cost, now + wait) == 0
        probe.consume(cost, now + wait)


# --- shaper ------------------------------------------------------------------------------

shaper_steps = st.lists(
    st.tuples(gaps, st.booleans(), st.integers(0, 10**6)),  # gap, a held client leaves, which
    max_size=60,
)


@FAST
@given(rates, st.integers(0, 6), shaper_steps)
def test_shaper_rate_and_backlog_bounds(
    rate: Rate, backlog: int, steps: list[tuple[int | None, bool, int]]
) -> None:
    """Whatever arrives and whoever leaves while held: requests are sent no faster than the
    rate, never more than ``backlog`` wait at once, and a full shaper admits no one."""
    shaper, now = Shaper(rate, backlog), 0
    sends: dict[int, int] = {}  # slot → send ms, of the requests that will be sent
    for gap, leave, pick in steps:
        now += shaper.wait_ms(now) if gap is None else gap
        waiting = sorted(slot for slot, at in sends.items() if at > now)
        if leave and sends:  # a request ends: held (its client left), or sent (finished)
            slot = sorted(sends)[pick % len(sends)]
            shaper.give_back(slot, now)
            if sends[slot] > now:
                del sends[slot]
            continue
        assert len(waiting) == shaper.held(now) <= backlog
        if shaper.wait_ms(now):
            assert len(waiting) == backlog  # refused only when the backlog is full
            continue
        slot = shaper.take(now)
        sends[slot] = now + shaper.delay_ms(slot, now)
        assert sum(1 for at in sends.values() if at > now) <= backlog
    assert_never_faster(list(sends.values()), rate)


@FAST
@given(rates, st.integers(0, 6), shaper_steps)
def test_shaper_retry_after_is_exact(
    rate: Rate, backlog: int, steps: list[tuple[int | None, bool, int]]
) -> None:
    """Full with wait w: still full at now + w − 1, room at now + w (absent other traffic)."""

    def replayed() -> tuple[Shaper, int]:
        shaper, now, slots = Shaper(rate, backlog), 0, []
        for gap, leave, pick in steps:
            now += gap or 0
            if leave and slots:
                shaper.give_back(slots.pop(pick % len(slots)), now)
            elif not shaper.wait_ms(now):
                slots.append(shaper.take(now))
        return shaper, now

    shaper, now = replayed()
    wait = shaper.wait_ms(now)
    event(f"full: {wait > 0}")
    if wait:
        assert replayed()[0].wait_ms(now + wait - 1) > 0
    assert shaper.wait_ms(now + wait) == 0
    shaper.take(now + wait)


# --- the tenant limiter ------------------------------------------------------------------


def _costs(draw: st.DrawFn, policy: TenantPolicy) -> Cost:
    cap = policy.token_burst or 3000
    prompt = _ratio(draw, cap)
    return Cost(prompt, _ratio(draw, cap - prompt), requests=draw(st.sampled_from([1, 1, 0, 2])))


def _snapshot(limiter: TenantLimiter, now: int) -> tuple[object, ...]:
    buckets = [limiter.request_bucket, limiter.token_bucket]
    window = limiter.window
    return (
        [(b.level_scaled, b.last_ms) for b in buckets if b is not None],
        (window.used(now), window.reset_ms(now)) if window is not None else None,
        limiter.in_flight,
        limiter.remaining(now),
    )


def _levels(limiter: TenantLimiter, now: int) -> tuple[int | None, ...]:
    """Exact scaled levels of the request and token buckets and the window's usage."""
    req, tok, window = limiter.request_bucket, limiter.token_bucket, limiter.window
    return (
        req.level_at(now) if req is not None else None,
        tok.level_at(now) if tok is not None else None,
        window.used(now) if window is not None else None,
    )


def _minus(
    levels: tuple[int | None, ...], limiter: TenantLimiter, cost: Cost
) -> tuple[object, ...]:
    """What :func:`_levels` must read after admitting ``cost``."""
    req, tok = limiter.request_bucket, limiter.token_bucket
    return (
        None if req is None else levels[0] - cost.requests * req.rate.period_ms,
        None if tok is None else levels[1] - cost.tokens * tok.rate.period_ms,
        None if levels[2] is None else levels[2] + cost.requests,
    )


def _release(limiter: TenantLimiter, lease: str, cost: Cost, used: int | None, now: int) -> None:
    """Release and check the token reconciliation exactly (refund capped, overshoot charged)."""
    bucket = limiter.token_bucket
    before = bucket.level_at(now) if bucket is not None else 0
    assert limiter.release(lease, used, now) is True
    after = _snapshot(limiter, now)
    assert limiter.release(lease, used, now) is False
    assert _snapshot(limiter, now) == after
    if bucket is None:
        return
    delta = (cost.tokens - (cost.tokens if used is None else used)) * bucket.rate.period_ms
    expected = min(bucket.full_scaled, before + delta) if delta > 0 else before + delta
    assert bucket.level_at(now) == expected


def _run_history(
    draw: st.DrawFn, limiter: TenantLimiter, steps: int, now: int
) -> tuple[int, dict[str, Cost]]:
    """Random admits/releases with invariants checked at every step; returns (now, leases)."""
    policy, leases = limiter.policy, {}
    for step in range(steps):
        now += draw(st.one_of(st.just(0), st.integers(0, 50), st.integers(0, 600)))
        if leases and draw(st.booleans()):
            lease = draw(st.sampled_from(sorted(leases)))
            used = draw(st.one_of(st.none(), st.integers(0, 2 * leases[lease].tokens + 5)))
            _release(limiter, lease, leases.pop(lease), used, now)
            continue
        cost, before, levels = _costs(draw, policy), _snapshot(limiter, now), _levels(limiter, now)
        result = limiter.admit(cost, f"l{step}", now)
        if isinstance(result, Admit):
            leases[result.lease_id] = cost
            assert _levels(limiter, now) == _minus(levels, limiter, cost)  # consumed exactly
        else:
            assert _snapshot(limiter, now) == before  # all or nothing
        assert limiter.in_flight == len(leases) <= (policy.max_concurrency or len(leases))
        bucket = limiter.token_bucket
        assert bucket is None or bucket.available(now) <= bucket.capacity
    return now, leases


@SLOW
@given(st.data(), policies(concurrency=True))
def test_tenant_limiter_invariants(data: st.DataObject, policy: TenantPolicy) -> None:
    limiter = TenantLimiter(policy, now_ms=0)
    now, leases = _run_history(data.draw, limiter, data.draw(st.integers(0, 25)), 0)
    for lease, cost in sorted(leases.items()):
        _release(limiter, lease, cost, data.draw(st.one_of(st.none(), st.integers(0, 50))), now)
    assert limiter.in_flight == 0
    blocked = limiter.check_requests(now)
    assert blocked is None or blocked.reason in {Reason.REQUESTS, Reason.WINDOW, Reason.SHAPING}


@SLOW
@given(st.data(), policies(concurrency=False))
def test_tenant_limiter_retry_exactness(data: st.DataObject, policy: TenantPolicy) -> None:
    """Reject.retry_after_ms is the exact max over every dimension's wait."""
    steps, drawn = data.draw(st.integers(0, 20)), []

    def record(strategy: st.SearchStrategy[Any]) -> Any:
        drawn.append(data.draw(strategy))
        return drawn[-1]

    def replayed() -> TenantLimiter:
        """The same history on a new limiter: a copy of its state (compiled classes, see
        kvgate_native, cannot be deep-copied)."""
        values, copy = iter(drawn), TenantLimiter(policy, now_ms=0)
        _run_history(lambda _: next(values), copy, steps, 0)
        return copy

    limiter = TenantLimiter(policy, now_ms=0)
    now, _ = _run_history(record, limiter, steps, 0)
    cost = _costs(data.draw, policy)
    herd = replayed().admit(cost, "probe", now)  # the history's refused clients hold slots
    alone = replayed()
    alone.forget_promises()  # a client alone
    result = alone.admit(cost, "probe", now)
    event(f"probe: {result.reason if isinstance(result, Reject) else 'admitted'}")
    if isinstance(result, Admit):
        return
    if result.retry_after_ms is None:
        assert result.reason in {Reason.CONTEXT, Reason.TOO_LARGE}
        return
    retry = result.retry_after_ms
    assert retry > 0
    event(f"several dimensions: {' and ' in result.message}")
    assert isinstance(herd, Reject) and herd.retry_after_ms is not None
    assert herd.retry_after_ms >= retry  # a later slot, never an earlier one
    later = replayed()
    later.forget_promises()
    assert isinstance(later.admit(cost, "probe", now + retry - 1), Reject)
    assert isinstance(limiter.admit(cost, "probe", now + herd.retry_after_ms), Admit)
    assert isinstance(replayed().admit(cost, "probe", now + retry), Admit)


@SLOW
@given(st.data(), policies(concurrency=False))
def test_check_requests_retry_exactness(data: st.DataObject, policy: TenantPolicy) -> None:
    limiter = TenantLimiter(policy, now_ms=0)
    now, _ = _run_history(data.draw, limiter, data.draw(st.integers(0, 20)), 0)
    limiter.forget_promises()  # a client alone (test_herd_* cover the others)
    result = limiter.check_requests(now)
    if result is None:
        return
    assert result.retry_after_ms is not None
    assert limiter.check_requests(now + result.retry_after_ms - 1) is not None
    assert limiter.check_requests(now + result.retry_after_ms) is None


# --- reconciliation: refunds and overcharges, with clients that honour Retry-After ---------

Step = tuple[str, int, str, Any]
"""``("admit", ms, lease, cost)`` or ``("release", ms, lease, (used, served))``."""


def _replayed(policy: TenantPolicy, steps: list[Step]) -> TenantLimiter:
    """The same calls on a new limiter: a copy of the state (see
    test_tenant_limiter_retry_exactness)."""
    limiter = TenantLimiter(policy, now_ms=0)
    for kind, now, lease, arg in steps:
        if kind == "admit":
            limiter.admit(arg, lease, now)
        else:
            limiter.release(lease, arg[0], now, served=arg[1])
    return limiter


@dataclass
class _Honest:
    """One tenant's clients that come back when told: a refused client retries at exactly
    its ``retry-after-ms`` (up to three times), every admitted request ends after it was
    sent and reconciles its reservation with what it used (less, the same, more, unknown),
    or gives everything back (never served). Checks every answer as it comes:

    - a client refused while no other refused client is still out (every one of them was
      told a time before now) gets the exact wait: admitted then, refused 1 ms earlier;
    - a refused client coming back is admitted, unless someone took from what its schedule
      counted on: a request charged over its reservation since the client was refused, or a
      newcomer admitted while the herd was out (admissions do not move the schedule: the
      store cannot tell a newcomer from a client coming back)."""

    policy: TenantPolicy
    limiter: TenantLimiter
    steps: list[Step] = field(default_factory=list)
    held: dict[str, tuple[Cost, int]] = field(default_factory=dict)  # lease → cost, sent ms
    due: list[tuple[int, int, str, Cost, int, int]] = field(default_factory=list)
    out_until: int = -1  # the latest time a refused client was told
    overcharges: int = 0
    newcomers: int = 0  # admitted while a herd was out
    herd_start: int = 0  # newcomers when the herd now out began
    unbounded: bool = False  # a wait past MAX_HERD_WAIT_MS: the herd shares its end
    exact_checks: int = 0
    n: int = 0

    def attempt(self, client: str, cost: Cost, now: int, tries: int = 0,
                since: int | None = None) -> None:
        self.n += 1
        lease, alone = f"{client}.{self.n}", self.out_until < now
        if alone:
            self.herd_start = self.newcomers
        result = self.limiter.admit(cost, lease, now)
        self.steps.append(("admit", now, lease, cost))
        if isinstance(result, Admit):
            self.held[lease] = (cost, now + result.hold_ms)
            self.newcomers += tries == 0 and not alone
            return
        assert since is None or since != self.overcharges or self.unbounded \
            or self.herd_start != self.newcomers, (client, now, result, self.steps)
        wait = result.retry_after_ms
        if wait is None:
            return
        self.unbounded |= wait >= MAX_HERD_WAIT_MS
        if alone:
            self.exact_checks += 1
            early = _replayed(self.policy, self.steps).admit(cost, "probe", now + wait - 1)
            assert isinstance(early, Reject), (now, wait, self.steps)
            on_time = _replayed(self.policy, self.steps).admit(cost, "probe", now + wait)
            assert isinstance(on_time, Admit), (now, wait, self.steps)
        self.out_until = max(self.out_until, now + wait)
        if tries < 3:
            heapq.heappush(self.due, (now + wait, self.n, client, cost, tries + 1,
                                      self.overcharges))

    def come_back(self, until: int) -> None:
        """The refused clients due by ``until`` retry, in the order of their times."""
        while self.due and self.due[0][0] <= until:
            at, _, client, cost, tries, since = heapq.heappop(self.due)
            self.attempt(client, cost, at, tries, since)

    def release(self, lease: str, used: int | None, served: bool, now: int) -> None:
        cost, _ = self.held.pop(lease)
        self.overcharges += served and used is not None and used > cost.tokens
        self.limiter.release(lease, used, now, served=served)
        self.steps.append(("release", now, lease, (used, served)))


@settings(max_examples=400, deadline=None)
@given(st.data(), policies(concurrency=False))
def test_retry_after_stays_exact_through_refunds_and_overcharges(
    data: st.DataObject, policy: TenantPolicy
) -> None:
    """Reported: a refund made the next token refusal's retry-after-ms long (a client alone
    told 9,900 ms for a 4,900 ms wait: the schedule promised to a herd, all back by then,
    still counted the tokens given back). See :class:`_Honest` for what is checked."""
    draw = data.draw
    world, now = _Honest(policy, TenantLimiter(policy, now_ms=0)), 0
    cap = policy.token_burst or 3000
    for step in range(draw(st.integers(1, 30))):
        now += draw(st.one_of(st.just(0), st.integers(0, 50), st.integers(0, 3000)))
        world.come_back(now)
        sent = sorted(lease for lease, (_, at) in world.held.items() if at <= now)
        if sent and draw(st.booleans()):
            lease = draw(st.sampled_from(sent))
            reserved = world.held[lease][0].tokens
            used = draw(st.one_of(st.none(), st.integers(0, reserved),
                                  st.integers(reserved, 2 * reserved + 5)))
            world.release(lease, used, draw(st.integers(0, 9)) > 0, now)
            continue
        prompt = draw(st.integers(0, cap))
        cost = Cost(prompt, draw(st.integers(0, cap - prompt)), draw(st.sampled_from([1, 1, 0])))
        world.attempt(f"c{step}", cost, now)
    world.come_back(now + 10**9)
    event(f"exact waits checked: {min(world.exact_checks, 3)}")
    event(f"overcharged: {world.overcharges > 0}")
