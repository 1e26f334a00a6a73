"""Retry times that schedule a herd: each rejected client of a tenant gets its own slot.

An exact wait is exact for *one* client: the time until the bucket holds this request. Told
to twenty concurrent clients, it makes them all come back in the same millisecond, where one
wins and nineteen are refused again. So every dimension that refuses keeps one number per
tenant, the time of the last slot it promised (``tat``, as in GCRA): the next refused client
gets ``max(now + exact wait, tat + interval)``, where ``interval`` is what one more request
of this size needs of that dimension — its share of the bucket's refill or of the
concurrency slots' expected completions. A client takes from every rate limit when it comes
back, so each is scheduled at every refusal, whichever refused: the token buckets as a GCRA,
the shaper by its backlog's virtual tail, and a sliding window by the entries the promised
clients will log at their retry times (``SlidingWindow.herd_wait_ms``; at most a window's
limit of them are kept). Promises expire by themselves: once ``tat`` is in the past the rule
gives back the exact wait, and no state grows with the number of clients; a bucket's and the
shaper's also once the last client they were made to is back (:func:`live_promise`). A
single client still gets the exact time; nothing is reserved for a promise (admission is
unchanged), so a promise is a schedule, not a lease. A request's usage reconciled at its
release moves a bucket's live promise with the bucket (:func:`reconcile_promise`).

Concurrency has no exact time (a slot frees when some request ends), so its wait is an
expected completion: the tenant's observed mean request duration (the configured
``concurrency_retry_ms`` until one has been seen) plus half for the spread of durations
and 10 ms for the retry's own trip, after the oldest request in flight started; one of
``max_concurrency`` slots frees every such duration.

The Rate Limit Service's counters (:func:`limiter.ratelimit.schedule`) are scheduled by the
same functions, one counter per descriptor instead of one per tenant and dimension, and its
fixed windows by :func:`fixed_slot`: a window's limit of clients per window start.

Pure integer math so the Redis scripts (:mod:`limiter.stores.redis_scripts`) redo it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from limiter.buckets import SlidingWindow, TokenBucket, ceil_div
from limiter.rates import Rate

MAX_HERD_WAIT_MS = 60_000
"""A herd's schedule reaches at most this far from a refusal (a longer exact wait stands, the
same for every client then; openai-python honours ``retry-after-ms`` up to 60 s): every client
that comes back early — one ignoring Retry-After, in a loop — moves the schedule on by a
slot, and without a bound one such client sent every later client of its tenant away for
half an hour (2,500 refusals at 1 request/s: ``retry-after-ms`` 2,045,360)."""

DURATION_SAMPLES = 8
"""The observed mean duration is a running mean over the first samples, then an
exponential one weighing each new request 1/8."""


def herd_wait(now_ms: int, wait_ms: int, tat: int | None, interval_ms: int) -> int:
    """This client's wait: the exact one, or one interval after the last promised slot."""
    if tat is None:
        return wait_ms
    return max(wait_ms, tat + interval_ms - now_ms)


def rate_interval(cost: int, rate: Rate) -> int:
    """Ms for a bucket refilling at ``rate`` to refill ``cost`` (rounded up)."""
    return ceil_div(cost * rate.period_ms, rate.amount)


def live_promise(promised: int | None, back_ms: int | None, now_ms: int) -> int | None:
    """A bucket's (or the shaper's) promise while a client it was made to may still come
    back: ``back_ms`` is when the last of them was told to (None: not known, the promise
    stands). Once that is past, every promised client is back (its take is in the bucket)
    or is not coming, and the promise says nothing the bucket does not: None, the exact
    wait. Asking whether the bucket's own full time has caught up with the promise instead
    is not enough: a refund (a request that used less than it reserved) or the slots'
    rounding up leaves it short of the promise for good, and a client alone was spaced
    behind clients that were all back (told 9,900 ms for a 4,900 ms wait)."""
    if back_ms is not None and back_ms < now_ms:
        return None
    return promised


def promise_back(promised: int | None, back_ms: int | None, at_ms: int) -> int:
    """When the last client of a bucket's (or the shaper's) schedule is back once one more
    is promised a slot at ``at_ms``: ``promised`` is the schedule's live promise before it
    (:func:`live_promise`; None: this client starts a new schedule). A live promise kept
    without ``back_ms`` (by an older version) has clients whose return is not known: from
    now on, the schedule lasts until this one's."""
    if promised is None or back_ms is None:
        return at_ms
    return max(back_ms, at_ms)


def bucket_slot(promised: int | None, bucket: TokenBucket, cost: int, wait: int,
                now_ms: int) -> int:
    """This client's slot in a token bucket's schedule (GCRA): ``promised`` is when the
    bucket would be full again once every client promised a slot has taken its cost, so
    the client fits once that virtual bucket holds its cost — a bucket with room to spare
    for the promised clients does not space them."""
    if promised is None or promised <= now_ms + bucket.reset_ms(now_ms):
        return wait  # nothing promised beyond the bucket's own state
    rate = bucket.rate
    spare = (bucket.capacity - cost) * rate.period_ms // rate.amount
    return max(wait, min(promised - spare - now_ms, MAX_HERD_WAIT_MS))


def promise_bucket(promised: int | None, bucket: TokenBucket, cost: int, final: int,
                   now_ms: int) -> int:
    """The bucket's virtual full time once this client takes ``cost`` at ``now + final``
    (bounded: a client refused in a loop must not push it on forever)."""
    rate = bucket.rate
    full = now_ms + max(bucket.reset_ms(now_ms), final)
    base = full if promised is None else max(promised, full)
    bound = max(full, now_ms + MAX_HERD_WAIT_MS) + rate_interval(bucket.capacity, rate)
    return min(base + rate_interval(cost, rate), bound)


def reconcile_promise(promised: int, back_ms: int | None, bucket: TokenBucket,
                      before_scaled: int, now_ms: int) -> int:
    """A bucket's live promise once a release moved the bucket's level at ``now_ms`` from
    ``before_scaled`` to what it is now (a request's usage reconciled with its reservation),
    so a refusal while promised clients are still out is not spaced behind tokens given back
    (or ahead of tokens charged).

    An overcharge (usage above the reservation) leaves the promised clients that much less:
    the promise moves on by its refill time, never less than they lose. A refund moves it
    back by what the promised clients are sure to keep of it: the bucket may fill before
    the last of them is back (``back_ms``) and lose the rest, at most the refill from when
    it would fill to then; so a slot is never early either. Without ``back_ms`` (a promise
    kept by an older version) nothing is moved back."""
    rate = bucket.rate
    after = bucket.level_at(now_ms)
    if after < before_scaled:  # charged
        return promised + ceil_div(before_scaled - after, rate.amount)
    if after == before_scaled or back_ms is None:
        return promised
    # the bucket had room for ``headroom`` before the refund, and refilling until the last
    # promised client is back fills ``refill_ms`` of it: what is beyond is kept for sure
    headroom = bucket.full_scaled - before_scaled
    refill_ms = max(0, back_ms - now_ms)
    if refill_ms >= ceil_div(headroom, rate.amount):  # (compared first: no huge product)
        return promised
    kept = min(after - before_scaled, headroom - refill_ms * rate.amount)
    return promised - kept // rate.amount


Promised = list[tuple[int, int]]
"""The entries promised clients will log in a sliding window at their retry: (ms, cost),
ascending."""


def window_slot(window: SlidingWindow, cost: int, now_ms: int,
                promised: Sequence[tuple[int, int]]) -> tuple[int, Promised]:
    """This client's slot in a sliding window's schedule, unbounded
    (:meth:`SlidingWindow.herd_wait_ms`), and the promised entries still ahead (the rest
    are kept no more)."""
    kept = [p for p in promised if p[0] >= now_ms]
    return window.herd_wait_ms(cost, now_ms, kept), kept


def promise_window(promised: Promised, window_ms: int, at_ms: int, cost: int) -> Promised:
    """The entries once this client logs ``cost`` when it comes back at ``at_ms``; entries
    a window before the last one no longer bear on a later slot (so at most a window's
    limit of them are kept)."""
    promised = list(promised)
    if promised and promised[-1][0] == at_ms:
        cost += promised.pop()[1]
    promised.append((at_ms, cost))
    return [p for p in promised if p[0] > at_ms - window_ms]


def fixed_slot(promised: int | None, used: int, limit: int, window_ms: int, cost: int,
               wait: int, now_ms: int) -> int:
    """This client's slot in a fixed window's schedule: ``promised`` is the start of the
    window the last promised client comes back in and ``used`` what they will count there.
    The client comes back in that window while it has room, else at the next one's start:
    ``limit`` clients per window, in order."""
    at = now_ms + wait
    if promised is None or promised < at - at % window_ms:
        return wait  # nothing promised from the window this client fits in on
    if used + cost > limit:
        promised += window_ms
    return max(wait, promised - now_ms)


def promise_fixed(promised: int | None, used: int, window_ms: int, cost: int,
                  at_ms: int) -> tuple[int | None, int]:
    """The promised window and its count once this client, back at ``at_ms``, counts
    ``cost`` there (one before the promised one is not promised: a bounded slot)."""
    start = at_ms - at_ms % window_ms
    if promised is None or start > promised:
        return start, cost
    if start == promised:
        return promised, used + cost
    return promised, used


TRIP_MS = 10
"""A retry's own trip through Envoy and kvgate's two messages before it takes a slot."""


def completion_ms(mean_ms: int) -> int:
    """How long after its start a slot is expected to be free again: the mean duration plus
    half (durations spread, and every round of a herd adds its admission's latency) plus a
    retry's trip, so that a client sent back then finds the slot free."""
    return mean_ms + ceil_div(mean_ms, 2) + TRIP_MS


def concurrency_wait(now_ms: int, oldest_start_ms: int | None, mean_ms: int,
                     max_concurrency: int = 1) -> int:
    """Until the oldest request in flight is expected to have ended. Once it is past that,
    as long as it is late, up to one :func:`concurrency_interval` (at least 1 ms): the
    later it is, the less likely it ends at once (a long generation, or a lease of a dead
    process waiting out its TTL), and 1 ms sent a client back in a tight loop."""
    if oldest_start_ms is None:
        return completion_ms(mean_ms)
    due = oldest_start_ms + completion_ms(mean_ms) - now_ms
    if due > 0:
        return due
    return max(1, min(-due, concurrency_interval(mean_ms, max_concurrency)))


def concurrency_interval(mean_ms: int, max_concurrency: int) -> int:
    """One of ``max_concurrency`` slots frees per expected duration."""
    return ceil_div(completion_ms(mean_ms), max_concurrency)


def observe(mean_ms: int, samples: int, duration_ms: int) -> tuple[int, int]:
    """The mean duration and sample count after one more finished request."""
    samples = min(samples + 1, DURATION_SAMPLES)
    delta = max(0, duration_ms) - mean_ms
    return mean_ms + delta // samples, samples
