"""Retry slots for a herd (limiter.herd): refused clients that come back when told are
admitted on their first retry."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from limiter import Admit, Cost, Rate, Reason, Reject, TenantLimiter, TenantPolicy
from limiter.herd import MAX_HERD_WAIT_MS, concurrency_wait, observe


def _refuse_all(limiter: TenantLimiter, n: int, now: int, cost: Cost) -> list[int]:
    waits = []
    for i in range(n):
        result = limiter.admit(cost, f"r{i}", now)
        assert isinstance(result, Reject) and result.retry_after_ms is not None
        waits.append(result.retry_after_ms)
    return waits


def test_rate_limited_herd_gets_the_refill_times() -> None:
    policy = TenantPolicy(request_rate=Rate(2, 1000), request_burst=4)
    limiter = TenantLimiter(policy, now_ms=0)
    for i in range(4):
        assert isinstance(limiter.admit(Cost(1, 1), f"a{i}", 0), Admit)
    waits = _refuse_all(limiter, 16, 0, Cost(1, 1))
    assert waits == [500 * (k + 1) for k in range(16)]  # the k-th gets the k-th refill
    for k, wait in enumerate(waits):  # each comes back when told: admitted at once
        assert isinstance(limiter.admit(Cost(1, 1), f"retry{k}", wait), Admit)


def test_a_newcomer_queues_behind_the_promised_slots() -> None:
    policy = TenantPolicy(request_rate=Rate(1, 100), request_burst=1)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(1, 1), "a", 0), Admit)
    assert _refuse_all(limiter, 3, 0, Cost(1, 1)) == [100, 200, 300]
    assert isinstance(limiter.admit(Cost(1, 1), "first", 100), Admit)
    later = limiter.admit(Cost(1, 1), "new", 150)
    assert isinstance(later, Reject) and later.retry_after_ms == 400 - 150
    # once every promised slot is past, a refusal is exact again
    for i, now in enumerate((200, 300, 400)):
        assert isinstance(limiter.admit(Cost(1, 1), f"b{i}", now), Admit)
    alone = limiter.admit(Cost(1, 1), "alone", 430)
    assert isinstance(alone, Reject) and alone.retry_after_ms == 70


def test_token_herd_is_spaced_by_each_request_s_tokens() -> None:
    policy = TenantPolicy(token_rate=Rate(10, 1000), token_burst=100)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(100, 0), "a", 0), Admit)
    waits = _refuse_all(limiter, 3, 0, Cost(20, 0))
    assert waits == [2000, 4000, 6000]


def test_concurrency_herd_follows_observed_durations() -> None:
    policy = TenantPolicy(max_concurrency=2, concurrency_retry_ms=1000)
    limiter = TenantLimiter(policy, now_ms=0)
    for i in range(4):  # learn: requests take 40 ms
        assert isinstance(limiter.admit(Cost(1, 1), f"w{i}", i * 100), Admit)
        assert limiter.release(f"w{i}", 2, i * 100 + 40)
    assert limiter.mean_duration_ms == 40
    for i in range(2):
        assert isinstance(limiter.admit(Cost(1, 1), f"a{i}", 1000), Admit)
    waits = _refuse_all(limiter, 6, 1000, Cost(1, 1))
    # expected end 40 ms + half + 10 ms after the oldest start; then one slot per 70/2 ms
    assert waits == [70, 105, 140, 175, 210, 245]
    assert len(set(waits)) == len(waits)


def test_a_slot_past_its_expected_end_is_waited_for_as_long_as_it_is_late() -> None:
    """A request in flight past its expected end (a long generation, or the lease of a
    process that died, held until its TTL): refused clients were told 1 ms, and retried in
    a tight loop for the lease TTL. The wait is now how late it is, up to one interval."""
    # mean 800 ms: expected to end 1210 ms after its start; one of 2 slots per 605 ms
    assert [concurrency_wait(now, 0, 800, 2) for now in (1000, 1210, 1215, 1510, 30_000)] \
        == [210, 1, 5, 300, 605]
    policy = TenantPolicy(max_concurrency=1, concurrency_retry_ms=800)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(1, 1), "held", 0), Admit)
    late = limiter.admit(Cost(1, 1), "late", 30_000)
    assert isinstance(late, Reject) and late.retry_after_ms == 1210


def test_only_requests_that_ran_are_timed() -> None:
    limiter = TenantLimiter(TenantPolicy(max_concurrency=1, concurrency_retry_ms=1000), 0)
    assert isinstance(limiter.admit(Cost(1, 1), "queued", 0), Admit)
    assert limiter.release("queued", 0, 30_000)  # gave up in the queue: used nothing
    assert limiter.mean_duration_ms == 1000  # still the hint
    assert isinstance(limiter.admit(Cost(1, 1), "ran", 30_000), Admit)
    assert limiter.release("ran", None, 30_040)  # usage unknown: it ran
    assert limiter.mean_duration_ms == 40


def test_no_duration_seen_uses_the_configured_hint() -> None:
    policy = TenantPolicy(max_concurrency=1, concurrency_retry_ms=800)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(1, 1), "a", 0), Admit)
    assert _refuse_all(limiter, 2, 0, Cost(1, 1)) == [1210, 2420]


def test_policy_reload_forgets_promises() -> None:
    limiter = TenantLimiter(TenantPolicy(request_rate=Rate(1, 1000), request_burst=1), 0)
    assert isinstance(limiter.admit(Cost(1, 1), "a", 0), Admit)
    assert _refuse_all(limiter, 2, 0, Cost(1, 1)) == [1000, 2000]
    limiter.update_policy(TenantPolicy(request_rate=Rate(1, 10), request_burst=1), 5)
    assert _refuse_all(limiter, 1, 5, Cost(1, 1)) == [10]  # exact under the new rate


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(20, 2000), st.integers(1, 6), st.integers(1, 40),
       st.integers(0, 3000))
def test_every_client_of_a_herd_is_admitted_on_its_first_retry(
    amount: int, period: int, burst: int, clients: int, start: int
) -> None:
    """However many refused at once, each retrying at its own time is admitted (while the
    herd's schedule fits within MAX_HERD_WAIT_MS)."""
    assume(clients * period // amount < MAX_HERD_WAIT_MS)
    policy = TenantPolicy(request_rate=Rate(amount, period), request_burst=burst)
    limiter = TenantLimiter(policy, now_ms=0)
    for i in range(burst):
        assert isinstance(limiter.admit(Cost(1, 1), f"a{i}", start), Admit)
    waits = _refuse_all(limiter, clients, start, Cost(1, 1))
    assert waits == sorted(waits) and len(set(waits)) == len(waits)
    for k, wait in enumerate(waits):
        assert isinstance(limiter.admit(Cost(1, 1), f"retry{k}", start + wait), Admit)


def test_observed_mean_starts_with_the_first_sample() -> None:
    assert observe(0, 0, 40) == (40, 1)
    assert observe(40, 1, 80) == (60, 2)
    mean, samples = 100, 8
    assert observe(mean, samples, 180) == (110, 8)  # 1/8 of the difference from then on
    assert Reason.CONCURRENCY.value == "concurrency"


def test_a_sliding_window_herd_follows_the_entries_leaving() -> None:
    """Bunched entries: each refused client is sent back when one more entry has left, not
    at the window's average spacing (which sent the second client back at 350 ms, while
    the entries of 700 and 800 ms still counted)."""
    limiter = TenantLimiter(TenantPolicy(window_limit=4, window_ms=1000), now_ms=0)
    for at in (0, 700, 800, 900):
        assert isinstance(limiter.admit(Cost(1, 1), f"a{at}", at), Admit)
    waits = _refuse_all(limiter, 5, 900, Cost(1, 1))
    assert waits == [100, 800, 900, 1000, 1100]  # the fifth: when the first is back and leaves
    for k, wait in enumerate(waits):
        assert isinstance(limiter.admit(Cost(1, 1), f"retry{k}", 900 + wait), Admit)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(10, 2000), st.lists(st.integers(0, 1999), max_size=8),
       st.integers(1, 30))
def test_every_client_of_a_window_herd_is_admitted_on_its_first_retry(
    limit: int, window: int, offsets: list[int], clients: int
) -> None:
    """Whatever the entries' spacing and however many clients beyond the limit, each
    retrying at its own slot is admitted (while the herd's schedule fits within
    MAX_HERD_WAIT_MS); a newcomer later queues behind them."""
    assume((clients // limit + 2) * window < MAX_HERD_WAIT_MS)
    limiter = TenantLimiter(TenantPolicy(window_limit=limit, window_ms=window), now_ms=0)
    now = 0
    for i, offset in enumerate(sorted(o % window for o in offsets)):
        result = limiter.admit(Cost(1, 1), f"a{i}", offset)
        now = offset
        if isinstance(result, Reject):
            break
    else:  # fill what is left of the window at the last entry's time
        filled = 0
        while isinstance(limiter.admit(Cost(1, 1), f"fill{filled}", now), Admit):
            filled += 1
    waits = _refuse_all(limiter, clients, now, Cost(1, 1))
    assert waits == sorted(waits)
    for k, wait in enumerate(waits):
        assert isinstance(limiter.admit(Cost(1, 1), f"retry{k}", now + wait), Admit)
    newcomer = limiter.admit(Cost(1, 1), "new", now + waits[-1])
    if isinstance(newcomer, Reject):
        assert newcomer.retry_after_ms is not None and newcomer.retry_after_ms > 0


def test_a_herd_is_scheduled_a_minute_ahead_at_most() -> None:
    """A client ignoring Retry-After, refused in a loop, moved the schedule on by a slot at
    each refusal: after 2,500 of them at 1 request/s a well-behaved client of the tenant
    was told to come back in 34 minutes. Past a minute, refused clients share its end."""
    limiter = TenantLimiter(TenantPolicy(request_rate=Rate(1, 1000), request_burst=1), 0)
    assert isinstance(limiter.admit(Cost(1, 1), "a", 0), Admit)
    waits = _refuse_all(limiter, 200, 0, Cost(1, 1))
    assert waits[:60] == [1000 * (k + 1) for k in range(60)]
    assert max(waits) == 60_000


def test_a_herd_refused_by_the_token_rate_is_also_spaced_by_the_request_rate() -> None:
    """Requests per second and tokens per minute (OpenAI's pair): a herd refused by the
    token rate alone was spaced by its refill (300 ms for 500 tokens at 100,000 a minute)
    and came back faster than 2 requests/s allow: 19 of 20 refused again after waiting
    their ``retry-after-ms``. Each client comes back when both buckets hold it."""
    policy = TenantPolicy(request_rate=Rate(2, 1000), request_burst=2,
                          token_rate=Rate.per_minute(100_000), token_burst=100_000)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(99_800, 0), "big", 0), Admit)  # a request left
    waits = _refuse_all(limiter, 20, 0, Cost(300, 200))
    assert waits == sorted(waits) and len(set(waits)) == len(waits)
    for k, wait in enumerate(waits):
        assert isinstance(limiter.admit(Cost(300, 200), f"retry{k}", wait), Admit), k
    assert waits[-1] <= 500 * 20  # not later than the request rate needs


def test_a_bucket_with_room_to_spare_does_not_space_a_herd() -> None:
    """The request bucket holds the whole herd: only the token rate spaces it."""
    policy = TenantPolicy(request_rate=Rate(1, 1000), request_burst=100,
                          token_rate=Rate(1, 1), token_burst=1000)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(1000, 0), "big", 0), Admit)
    assert _refuse_all(limiter, 5, 0, Cost(100, 0)) == [100, 200, 300, 400, 500]


def _retry_in_order(limiter: TenantLimiter, waits: list[int], start: int,
                    costs: list[Cost]) -> list[int]:
    """Each refused client comes back after its ``retry-after-ms`` (earliest first): the
    ones refused again."""
    again = []
    for k in sorted(range(len(waits)), key=lambda k: waits[k]):
        if isinstance(limiter.admit(costs[k], f"retry{k}", start + waits[k]), Reject):
            again.append(k)
    return again


def test_a_herd_refused_by_the_token_rate_is_also_spaced_by_the_sliding_window() -> None:
    """2 requests a second in a sliding window and a token rate: a herd refused by the
    token rate alone was spaced by its refill (300 ms) and 5 of 10 came back to a full
    window. Each client takes its place in the window when it comes back."""
    policy = TenantPolicy(window_limit=2, window_ms=1000,
                          token_rate=Rate(1000, 1000), token_burst=1000)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(1000, 0), "big", 0), Admit)
    waits = _refuse_all(limiter, 10, 0, Cost(300, 0))
    assert waits == [300, 1000, 1300, 2000, 2300, 3000, 3300, 4000, 4300, 5000]
    assert _retry_in_order(limiter, waits, 0, [Cost(300, 0)] * 10) == []


def test_a_herd_refused_by_another_limit_is_also_spaced_by_the_shaper() -> None:
    """A shaper (1 a second, backlog 2) after a token rate: the herd refused by the token
    rate came back every 100 ms and 7 of 10 found the backlog full. Each client's departure
    slot is counted when it comes back, so the herd is spaced by the backlog's drain."""
    policy = TenantPolicy(token_rate=Rate(1000, 1000), token_burst=1000,
                          shaping_rate=Rate(1, 1000), shaping_backlog=2)
    limiter = TenantLimiter(policy, now_ms=0)
    assert isinstance(limiter.admit(Cost(1000, 0), "big", 0), Admit)
    waits = _refuse_all(limiter, 10, 0, Cost(100, 0))
    assert waits == [100, 200, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
    assert _retry_in_order(limiter, waits, 0, [Cost(100, 0)] * 10) == []


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_every_client_of_a_herd_over_any_rate_limits_is_admitted_on_its_first_retry(
    data: st.DataObject,
) -> None:
    """Any mix of request rate, sliding window, token rate and shaper, requests of any
    size, a herd refused at once: each client that comes back after its ``retry-after-ms``
    is admitted (while the schedule fits within MAX_HERD_WAIT_MS)."""
    draw = data.draw
    limits: dict[str, object] = {}
    if draw(st.booleans()):
        limits.update(request_rate=Rate(1, draw(st.integers(1, 500))),
                      request_burst=draw(st.integers(1, 4)))
    if draw(st.booleans()):
        limits.update(window_limit=draw(st.integers(1, 6)),
                      window_ms=draw(st.integers(50, 2000)))
    if draw(st.booleans()):
        limits.update(token_rate=Rate(1, draw(st.integers(1, 5))), token_burst=1000)
    if draw(st.booleans()):
        limits.update(shaping_rate=Rate(draw(st.integers(1, 5)), draw(st.integers(100, 1500))),
                      shaping_backlog=draw(st.integers(0, 4)))
    limiter = TenantLimiter(TenantPolicy(**limits), now_ms=0)  # type: ignore[arg-type]
    now = 0
    for i, (gap, tokens) in enumerate(draw(st.lists(st.tuples(st.integers(0, 30),
                                                              st.integers(0, 400)),
                                                    max_size=8))):
        now += gap
        limiter.admit(Cost(tokens, 0), f"a{i}", now)
    costs = [Cost(tokens, 0) for tokens in draw(st.lists(st.integers(1, 600), min_size=2,
                                                         max_size=12))]
    waits: list[int] = []
    for k, cost in enumerate(costs):
        result = limiter.admit(cost, f"r{k}", now)
        if isinstance(result, Reject):
            assert result.retry_after_ms is not None
            waits.append(result.retry_after_ms)
        else:  # admitted after one was refused: a newcomer that found room, not the herd
            assume(not waits)
    costs = costs[len(costs) - len(waits):]
    assume(waits and max(waits) < MAX_HERD_WAIT_MS)
    assert _retry_in_order(limiter, waits, now, costs) == []


# --- a request's usage reconciled with its reservation (release) ----------------------------


def _admitted(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> None:
    assert isinstance(limiter.admit(cost, lease, now), Admit), (lease, now)


def _told(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> int:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Reject) and result.retry_after_ms is not None, (lease, now)
    return result.retry_after_ms


def test_a_refund_does_not_space_a_client_alone_behind_a_herd_that_is_back() -> None:
    """Reported: the refund made the next refusal's promise long. B, refused, came back when
    told and ran; it used nothing and gave its 50 tokens back. C, alone (no refused client
    still out), was told 9,900 ms for a 4,900 ms wait: the schedule promised to B, past
    the bucket's own full time for good once the tokens came back, still spaced C."""
    limiter = TenantLimiter(TenantPolicy(token_rate=Rate(10, 1000), token_burst=100), 0)
    _admitted(limiter, Cost(100, 0), "a", 0)
    assert _told(limiter, Cost(50, 0), "b", 0) == 5000
    _admitted(limiter, Cost(50, 0), "b", 5000)
    assert limiter.release("b", 0, 5100)
    assert _told(limiter, Cost(100, 0), "c", 5100) == 4900
    _told(limiter, Cost(100, 0), "c", 9999)
    _admitted(limiter, Cost(100, 0), "c", 10_000)


def test_a_client_alone_is_not_spaced_by_the_schedule_s_rounding() -> None:
    """Every slot promised is rounded up to a whole ms: the schedule ended 1 ms past the
    bucket's full time once its client was back, and the next client alone was told 3 ms
    for a 2 ms wait."""
    limiter = TenantLimiter(TenantPolicy(token_rate=Rate(399, 625), token_burst=141), 0)
    _admitted(limiter, Cost(3, 0), "a", 0)
    assert _told(limiter, Cost(140, 0), "b", 0) == 4
    _admitted(limiter, Cost(140, 0), "b", 4)
    assert _told(limiter, Cost(2, 0), "c", 5) == 2
    _admitted(limiter, Cost(2, 0), "c", 7)


def test_a_refund_while_the_herd_is_out_moves_its_schedule_back() -> None:
    """B and D refused; B came back and gave its 50 tokens back while D was still out. C
    was told 14,900 ms: D takes its 50 at 10 s, and the bucket holds C's 100 from 15 s."""
    limiter = TenantLimiter(TenantPolicy(token_rate=Rate(10, 1000), token_burst=100), 0)
    _admitted(limiter, Cost(100, 0), "a", 0)
    assert [_told(limiter, Cost(50, 0), lease, 0) for lease in "bd"] == [5000, 10_000]
    _admitted(limiter, Cost(50, 0), "b", 5000)
    assert limiter.release("b", 0, 5100)
    assert _told(limiter, Cost(100, 0), "c", 5100) == 9900
    _admitted(limiter, Cost(50, 0), "d", 10_000)
    assert isinstance(limiter.admit(Cost(100, 0), "early", 14_999), Reject)
    _admitted(limiter, Cost(100, 0), "c", 15_000)


def test_a_refund_the_bucket_cannot_hold_until_the_herd_is_back_counts_in_part() -> None:
    """A gives back 60 tokens while B is out: the bucket is full at 4 s, B takes its 50 at
    5 s, so 10 of the 60 overflow and C's 100 are there at 10 s — not at 9 s, as the whole
    refund would say (C would be refused again), nor at 15 s, as none of it would."""
    limiter = TenantLimiter(TenantPolicy(token_rate=Rate(10, 1000), token_burst=100), 0)
    _admitted(limiter, Cost(100, 0), "a", 0)
    assert _told(limiter, Cost(50, 0), "b", 0) == 5000
    assert limiter.release("a", 40, 100)
    assert _told(limiter, Cost(100, 0), "c", 100) == 9900
    _admitted(limiter, Cost(50, 0), "b", 5000)
    assert isinstance(limiter.admit(Cost(100, 0), "early", 9999), Reject)
    _admitted(limiter, Cost(100, 0), "c", 10_000)


def test_an_overcharge_while_the_herd_is_out_moves_its_schedule_on() -> None:
    """A used 50 tokens over its reservation while B (refused by the request rate) was out:
    C was told 10,900 ms, as if the debt were the only thing ahead of it, and came back
    before B had taken its 10 tokens and the bucket had them again. The schedule now moves
    on by the debt's refill: never early, though later than needed here (15,900 ms for
    11,900), since the bucket fills before B is back and absorbs part of the debt, which
    the schedule cannot count on without knowing when B comes."""
    policy = TenantPolicy(request_rate=Rate(1, 10_000), request_burst=1,
                          token_rate=Rate(10, 1000), token_burst=100)
    limiter = TenantLimiter(policy, 0)
    _admitted(limiter, Cost(60, 0), "a", 0)
    assert _told(limiter, Cost(10, 0), "b", 0) == 10_000
    assert limiter.release("a", 110, 100)
    tokens_only = Cost(100, 0, requests=0)
    assert _told(limiter, tokens_only, "c", 100) == 15_900
    _admitted(limiter, Cost(10, 0), "b", 10_000)
    _admitted(limiter, tokens_only, "c", 16_000)
