"""One tenant's admission decision across every limit dimension, all or nothing.

A request is admitted only if *every* dimension has room; only then is anything consumed, so
a rejection never costs the tenant budget. A rejection carries the exact wait after which a
retry is admitted (absent other traffic): the max over the dimensions that said no. A spent
token quota is different: waiting seconds cannot help, so it carries its reset time instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from limiter.buckets import Shaper, SlidingWindow, TokenBucket, bucket_view
from limiter.calendar import Period, period_bounds
from limiter.herd import (
    MAX_HERD_WAIT_MS,
    Promised,
    bucket_slot,
    concurrency_interval,
    concurrency_wait,
    herd_wait,
    live_promise,
    observe,
    promise_back,
    promise_bucket,
    promise_window,
    rate_interval,
    reconcile_promise,
    window_slot,
)
from limiter.outcome import (
    Admit,
    BucketView,
    Cost,
    Reason,
    Reject,
    Remaining,
    ShapingView,
    Snapshot,
    WindowView,
    quota_reject,
    remaining_of,
    wait_reject,
)
from limiter.quota import QuotaCounter, QuotaView
from limiter.rates import Rate, require_int

__all__ = ["QuotaUsage", "TenantLimiter", "TenantPolicy", "never_fits"]

QuotaUsage = list[tuple[Period, int, int]]
"""Token quota counts as ``(period, period start ms, tokens used)``: what a forgotten tenant's
limiter leaves behind (:meth:`TenantLimiter.quota_usage`)."""

_POSITIVE_FIELDS = (
    "request_burst",
    "token_burst",
    "max_concurrency",
    "max_context_tokens",
    "window_limit",
    "window_ms",
    "daily_token_quota",
    "monthly_token_quota",
)


def _pair(policy: TenantPolicy, first: str, second: str) -> None:
    if (getattr(policy, first) is None) != (getattr(policy, second) is None):
        raise ValueError(f"{first} and {second} must be set together (or both left unset)")


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's limits; ``None`` means that dimension is unlimited.

    Rates come with their bucket capacity (burst) and the window limit with its length: a
    half-configured dimension is an error, not a silent "unlimited". Token quotas count per
    UTC calendar day / month. The shaper (``shaping_rate`` with ``shaping_backlog``) paces
    admitted requests instead of refusing them: see :class:`~limiter.buckets.Shaper`.
    """

    request_rate: Rate | None = None
    request_burst: int | None = None
    token_rate: Rate | None = None
    token_burst: int | None = None
    max_concurrency: int | None = None
    max_context_tokens: int | None = None
    window_limit: int | None = None
    window_ms: int | None = None
    concurrency_retry_ms: int = 1000
    daily_token_quota: int | None = None
    monthly_token_quota: int | None = None
    shaping_rate: Rate | None = None
    shaping_backlog: int | None = None
    # Derived once (every admission reads them): the quotas, and the largest request that
    # certainly passes ``never_fits`` — so the common case skips building its messages.
    _quotas: tuple[tuple[Period, int], ...] = field(init=False, repr=False, compare=False)
    _fits: tuple[float, float, float] = field(init=False, repr=False, compare=False)
    # hashed once: the Redis store keys its encoded form and its pending releases by policy
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _pair(self, "request_rate", "request_burst")
        _pair(self, "token_rate", "token_burst")
        _pair(self, "window_limit", "window_ms")
        _pair(self, "shaping_rate", "shaping_backlog")
        if self.shaping_backlog is not None:
            require_int("shaping_backlog", self.shaping_backlog, 0)
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name), 1)
        require_int("concurrency_retry_ms", self.concurrency_retry_ms, 1)
        pairs = ((Period.DAY, self.daily_token_quota), (Period.MONTH, self.monthly_token_quota))
        quotas = tuple((period, limit) for period, limit in pairs if limit is not None)
        budgets = [self.token_burst, *(limit for _, limit in quotas)]
        caps = (self.request_burst, self.window_limit)
        fits = (_bound(self.max_context_tokens), _bound(*budgets), _bound(*caps))
        object.__setattr__(self, "_quotas", quotas)
        object.__setattr__(self, "_fits", fits)
        object.__setattr__(self, "_hash", hash((*_scheduled_by(self), self.max_context_tokens)))

    def __hash__(self) -> int:
        return self._hash

    def quotas(self) -> tuple[tuple[Period, int], ...]:
        """The configured token quotas, daily first (the order every view lists them in)."""
        return self._quotas

    def surely_fits(self, cost: Cost) -> bool:
        """True when ``never_fits(self, cost)`` is certainly None (a few comparisons)."""
        context, budget, requests = self._fits
        return (cost.prompt_tokens <= context and cost.prompt_tokens + cost.max_output_tokens
                <= budget and cost.requests <= requests)


def _bound(*limits: int | None) -> float:
    return min((limit for limit in limits if limit is not None), default=math.inf)


def _scheduled_by(policy: TenantPolicy) -> tuple[Any, ...]:
    """The limits retry slots are computed from (what the Redis scripts compare too)."""
    return (policy.request_rate, policy.request_burst, policy.token_rate, policy.token_burst,
            policy.window_limit, policy.window_ms, policy.max_concurrency,
            policy.concurrency_retry_ms, policy.daily_token_quota, policy.monthly_token_quota,
            policy.shaping_rate, policy.shaping_backlog)


def _view_of(state: tuple[int, Rate, int] | None) -> BucketView | None:
    """A bucket's view from ``(capacity, rate, level_scaled)`` remembered earlier."""
    if state is None:
        return None
    limit, available, reset_ms = bucket_view(state[0], state[1], state[2])
    return BucketView(limit, available, reset_ms)


def _bucket_view(bucket: TokenBucket | None, now_ms: int) -> BucketView | None:
    return None if bucket is None else BucketView(*bucket.view(now_ms))


def _rebucket(
    bucket: TokenBucket | None, rate: Rate | None, capacity: int | None, now_ms: int
) -> TokenBucket | None:
    """Carry a bucket across a policy change: keep its level, start new ones full."""
    if rate is None or capacity is None:
        return None
    if bucket is None:
        return TokenBucket(rate, capacity, now_ms)
    bucket.reconfigure(rate, capacity, now_ms)
    return bucket


def never_fits(policy: TenantPolicy, cost: Cost) -> tuple[Reason, str] | None:
    """Why ``cost`` can never be admitted under ``policy`` (retrying cannot help), if so.

    Pure, so a shared store can decide it before its round trip.
    """
    if policy.surely_fits(cost):
        return None
    limit = policy.max_context_tokens
    if limit is not None and cost.prompt_tokens > limit:
        return Reason.CONTEXT, (
            f"prompt of {cost.prompt_tokens} tokens exceeds this tenant's maximum context "
            f"of {limit} tokens"
        )
    budgets = [("token budget holds at most", policy.token_burst)] + [
        (f"{period.value} token quota is", quota) for period, quota in policy.quotas()
    ]
    for what, limit in budgets:
        if limit is not None and cost.tokens > limit:
            return Reason.TOO_LARGE, (
                f"request reserves {cost.tokens} tokens (prompt + max_tokens) but this "
                f"tenant's {what} {limit}; lower max_tokens"
            )
    caps = [c for c in (policy.request_burst, policy.window_limit) if c is not None]
    if caps and cost.requests > min(caps):
        return Reason.TOO_LARGE, (
            f"request counts as {cost.requests} requests but at most {min(caps)} fit"
        )
    return None


def _reshape(shaper: Shaper | None, policy: TenantPolicy) -> Shaper | None:
    """Carry the shaper across a policy change (slots handed out keep their times)."""
    if policy.shaping_rate is None or policy.shaping_backlog is None:
        return None
    if shaper is None:
        return Shaper(policy.shaping_rate, policy.shaping_backlog)
    shaper.reconfigure(policy.shaping_rate, policy.shaping_backlog)
    return shaper


@dataclass(slots=True)
class _Lease:
    cost: Cost
    tokens_charged: bool
    quotas_charged: tuple[Period, ...]
    expires_ms: int | None
    started_ms: int
    requests_charged: bool = False  # to the request bucket
    window_ts: int | None = None  # when its entry was logged in the sliding window
    slot: tuple[int, Rate] | None = None  # its shaper slot, and the rate it was taken at


class TenantLimiter:
    """All limit dimensions of one tenant: request rate, sliding window, token rate,
    concurrency, context length and token quotas. Pure state; the caller passes ``now_ms``
    (wall-clock epoch ms: quotas follow the UTC calendar) every time.

    With ``lease_ttl_ms`` a lease that is neither released nor renewed within that time
    frees its concurrency slot by itself (its reservation stays charged), exactly like the
    Redis store's leases.
    """

    def __init__(
        self, policy: TenantPolicy, now_ms: int, lease_ttl_ms: int | None = None
    ) -> None:
        self.policy = TenantPolicy()
        self.lease_ttl_ms = None if lease_ttl_ms is None else require_int(
            "lease_ttl_ms", lease_ttl_ms, 1
        )
        self._requests: TokenBucket | None = None
        self._tokens: TokenBucket | None = None
        self._window: SlidingWindow | None = None
        self._shaper: Shaper | None = None
        self._quotas = {period: QuotaCounter(period) for period in Period}
        self._leases: dict[str, _Lease] = {}
        # leases that expired, kept one lease TTL (until ms, lease): a release that comes
        # late still settles the reservation against what was used, as the Redis store does
        self._gone: dict[str, tuple[int, _Lease]] = {}
        self._next_expiry: int | None = None  # a lower bound on the earliest lease expiry
        self._promised: dict[Reason, int] = {}  # dimension → its last promised retry slot
        # bucket or shaper → when the last client promised a slot in its schedule is back
        self._back: dict[Reason, int] = {}
        # the entries promised clients will log in the sliding window: (ms, requests)
        self._window_promised: Promised = []
        self._mean_ms = 0  # observed mean request duration (limiter.herd), and its samples
        self._samples = 0
        self.update_policy(policy, now_ms)

    @property
    def in_flight(self) -> int:
        """Admitted requests not yet released (as of the last call: see expire_leases)."""
        return len(self._leases)

    @property
    def request_bucket(self) -> TokenBucket | None:
        """The request-rate bucket (read-only use: metrics, stores, tests)."""
        return self._requests

    @property
    def token_bucket(self) -> TokenBucket | None:
        """The token-rate bucket (read-only use)."""
        return self._tokens

    @property
    def window(self) -> SlidingWindow | None:
        """The sliding request window (read-only use)."""
        return self._window

    @property
    def shaper(self) -> Shaper | None:
        """The shaper pacing admitted requests (read-only use)."""
        return self._shaper

    def update_policy(self, policy: TenantPolicy, now_ms: int) -> None:
        """Swap limits on a config reload; current levels carry over, clamped to new caps.

        Quota counters carry over even through a quota being switched off and on again.
        """
        self._requests = _rebucket(
            self._requests, policy.request_rate, policy.request_burst, now_ms
        )
        self._tokens = _rebucket(self._tokens, policy.token_rate, policy.token_burst, now_ms)
        self._window = self._rewindow(policy, now_ms)
        if _scheduled_by(policy) != _scheduled_by(self.policy):
            self.forget_promises()  # slots promised under old limits say nothing of the new
        self._shaper = _reshape(self._shaper, policy)
        self.policy = policy

    def idle_in_ms(self, now_ms: int) -> int | None:
        """Ms until, absent calls, this limiter is back to where a new one starts: its buckets
        full, its window empty, every shaper slot started and every retry slot it promised
        passed (0: it is now). Forgetting it then changes nothing but its token quotas' counts
        (:meth:`quota_usage`) and the observed mean duration — what a shared store's key
        TTLs forget too. None while it holds a lease."""
        if self.expire_leases(now_ms):
            return None
        waits = [0]
        for bucket in (self._requests, self._tokens):
            if bucket is not None:
                waits.append(bucket.reset_ms(now_ms))
        if self._window is not None:
            waits.append(self._window.reset_ms(now_ms))
        if self._shaper is not None:
            waits.append(self._shaper.drain_ms(now_ms))
        waits.extend(slot - now_ms for slot in self._promised.values())
        waits.extend(ts - now_ms for ts, _ in self._window_promised[-1:])
        return max(waits)

    def quota_usage(self, now_ms: int) -> QuotaUsage:
        """The token quota counts of the periods under way that are not 0, whether or not
        the policy has that quota now (:meth:`update_policy` keeps them too)."""
        usage: QuotaUsage = []
        for period, counter in self._quotas.items():
            start = counter.start_ms
            if start is not None and counter.used and start >= period_bounds(now_ms, period)[0]:
                usage.append((period, start, counter.used))
        return usage

    def restore_quotas(self, usage: QuotaUsage) -> None:
        """Take up the counts :meth:`quota_usage` gave (a tenant forgotten, and configured
        again within the period): a quota is not reset by removing and re-adding a key."""
        for period, start, used in usage:
            counter = self._quotas[period]
            counter.start_ms, counter.used = start, used

    def forget_promises(self) -> None:
        """Drop the retry slots promised to refused clients (``limiter.herd``): the next
        refusal gets the exact wait."""
        self._promised.clear()
        self._back.clear()
        self._window_promised = []

    def _rewindow(self, policy: TenantPolicy, now_ms: int) -> SlidingWindow | None:
        if policy.window_limit is None or policy.window_ms is None:
            return None
        if self._window is None:
            return SlidingWindow(policy.window_limit, policy.window_ms)
        self._window.reconfigure(policy.window_limit, policy.window_ms, now_ms)
        return self._window

    def expire_leases(self, now_ms: int) -> int:
        """Drop leases whose TTL passed (expiry ≤ now); returns the leases still held.

        Cheap: the scan runs only once the earliest possible expiry has been reached.
        """
        if self._next_expiry is None or now_ms < self._next_expiry:
            return len(self._leases)
        self._prune_gone(now_ms)  # (each record lives one TTL: kept from piling up)
        held: dict[str, _Lease] = {}
        for lease_id, lease in self._leases.items():
            if lease.expires_ms is None or lease.expires_ms > now_ms:
                held[lease_id] = lease
            elif self.lease_ttl_ms is not None:
                self._gone[lease_id] = (now_ms + self.lease_ttl_ms, lease)
        self._leases = held
        expiries = [lease.expires_ms for lease in self._leases.values()]
        self._next_expiry = min((e for e in expiries if e is not None), default=None)
        return len(self._leases)

    def renew(self, lease_ids: list[str], now_ms: int) -> int:
        """Push the expiry of held leases to ``now + lease_ttl_ms`` (long streams); returns
        how many were renewed. Without a TTL there is nothing to renew."""
        self.expire_leases(now_ms)
        if self.lease_ttl_ms is None:
            return 0
        renewed = 0
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.expires_ms = now_ms + self.lease_ttl_ms
                self._lower_next_expiry(lease.expires_ms)
                renewed += 1
        return renewed

    def _lower_next_expiry(self, expires_ms: int) -> None:
        """Keep ``_next_expiry`` a lower bound (a clock step back can shorten an expiry)."""
        if self._next_expiry is None or expires_ms < self._next_expiry:
            self._next_expiry = expires_ms

    def _quota_views(self, now_ms: int) -> list[QuotaView]:
        return [self._quotas[period].view(limit, now_ms) for period, limit in self.policy.quotas()]

    def remaining(self, now_ms: int) -> Remaining:
        """Current headroom for the ``x-ratelimit-*`` headers."""
        return remaining_of(
            _bucket_view(self._requests, now_ms),
            _bucket_view(self._tokens, now_ms),
            self._quota_views(now_ms),
        )

    def snapshot(self, now_ms: int) -> Snapshot:
        """Every dimension at ``now_ms`` (the admin view)."""
        window = self._window
        return Snapshot(
            requests=_bucket_view(self._requests, now_ms),
            tokens=_bucket_view(self._tokens, now_ms),
            window=None if window is None else WindowView(
                window.limit, window.window_ms, window.used(now_ms), window.reset_ms(now_ms)
            ),
            quotas=tuple(self._quota_views(now_ms)),
            in_flight=self.expire_leases(now_ms),
            max_concurrency=self.policy.max_concurrency,
            shaping=None if self._shaper is None else ShapingView(
                self._shaper.backlog, self._shaper.held(now_ms), self._shaper.drain_ms(now_ms)),
        )

    def usage(self, now_ms: int) -> dict[str, Any]:
        """JSON-friendly snapshot for an admin endpoint (see :meth:`Snapshot.usage`)."""
        return self.snapshot(now_ms).usage()

    def check_requests(self, now_ms: int) -> Reject | None:
        """Peek (consumes nothing) at the request-count dimensions, before the body arrives."""
        if self._next_expiry is not None:
            self.expire_leases(now_ms)
        waits = self._waits(1, None, now_ms)
        if not waits:
            return None
        return wait_reject(self._schedule(waits, 1, None, now_ms), self.remaining(now_ms))

    def admit(self, cost: Cost, lease_id: str, now_ms: int) -> Admit | Reject:
        """Admit ``cost`` under ``lease_id`` if every dimension has room, else consume nothing."""
        if self._next_expiry is not None:
            self.expire_leases(now_ms)
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} is already held")
        policy = self.policy
        if not policy.surely_fits(cost):
            problem = never_fits(policy, cost)
            if problem is not None:
                return Reject(problem[0], None, self.remaining(now_ms), problem[1])
        quotas = self._quota_views(now_ms) if policy._quotas else []
        failing = [quota for quota in quotas if not quota.fits(cost.tokens)]
        if failing:
            return quota_reject(failing, cost.tokens, self.remaining(now_ms))
        waits = self._waits(cost.requests, cost.tokens, now_ms)
        if waits:
            waits = self._schedule(waits, cost.requests, cost.tokens, now_ms)
            return wait_reject(waits, self.remaining(now_ms))
        window_ts = self._consume(cost, now_ms)
        lease = self._leases[lease_id] = self._new_lease(cost, quotas, now_ms, window_ts)
        hold = 0
        if self._shaper is not None and cost.requests:
            slot = self._shaper.take(now_ms)
            lease.slot = (slot, self._shaper.rate)
            hold = self._shaper.delay_ms(slot, now_ms)
        return Admit(lease_id, cost, self._remaining_later(now_ms), hold)

    def _remaining_later(self, now_ms: int) -> Callable[[], Remaining]:
        """``remaining(now_ms)`` as of now, computed only if someone asks: only the buckets'
        levels are remembered (just consumed, so they are current at ``now_ms``)."""
        requests, tokens = self._requests, self._tokens
        request_state = None if requests is None else (
            requests.capacity, requests.rate, requests.level_scaled)
        token_state = None if tokens is None else (tokens.capacity, tokens.rate,
                                                   tokens.level_scaled)
        quotas = self._quota_views(now_ms) if self.policy._quotas else []
        return lambda: remaining_of(_view_of(request_state), _view_of(token_state), quotas)

    def _new_lease(self, cost: Cost, quotas: list[QuotaView], now_ms: int,
                   window_ts: int | None) -> _Lease:
        expires = None if self.lease_ttl_ms is None else now_ms + self.lease_ttl_ms
        if expires is not None:
            self._lower_next_expiry(expires)
        periods = tuple(quota.period for quota in quotas) if quotas else ()
        return _Lease(cost, self._tokens is not None, periods, expires, now_ms,
                      self._requests is not None, window_ts)

    def release(self, lease_id: str, used_tokens: int | None, now_ms: int, *,
                served: bool = True) -> bool:
        """Free the lease exactly once (False on repeats, or once its TTL passed) and
        reconcile reserved vs used tokens on the token bucket and the quotas it was charged to.
        A request released before its shaper slot (its client left while held) gives the
        slot back.

        ``used_tokens=None`` (usage unknown: error, disconnect) counts the reservation as used.
        ``served=False``: it never ran (it left the queue or its hold, kvgate refused it after
        admitting it, or its admission was given up on): every charge comes back — its
        request, its window entry and its whole reservation — as for a refused request, so
        its client's retry is not charged twice.
        """
        if self._next_expiry is not None:
            self.expire_leases(now_ms)
        if not served:
            used_tokens = 0
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            gone = self._take_gone(lease_id, now_ms)
            if gone is not None:  # no slot to free: its reservation is still settled
                self._settle(gone, used_tokens, now_ms, served)
            return False
        if served and (used_tokens is None or used_tokens > 0):
            # a request that ran (one that used nothing never did: it left the queue, or it
            # was a GET) — its duration joins the observed mean
            self._mean_ms, self._samples = observe(self._mean_ms, self._samples,
                                                   now_ms - lease.started_ms)
        shaper = self._shaper
        if lease.slot is not None and shaper is not None and shaper.rate == lease.slot[1]:
            shaper.give_back(lease.slot[0], now_ms)  # not sent yet (its client left): a hole
        self._settle(lease, used_tokens, now_ms, served)
        return True

    def _take_gone(self, lease_id: str, now_ms: int) -> _Lease | None:
        """The record of an expired lease still kept (see ``_gone``), taken out; the records
        past their time are dropped first."""
        if not self._gone:
            return None
        self._prune_gone(now_ms)
        kept = self._gone.pop(lease_id, None)
        return None if kept is None else kept[1]

    def _prune_gone(self, now_ms: int) -> None:
        if self._gone:
            self._gone = {k: v for k, v in self._gone.items() if v[0] > now_ms}

    def _settle(self, lease: _Lease, used_tokens: int | None, now_ms: int,
                served: bool) -> None:
        """Reconcile a lease's reserved tokens with those used, on the token bucket and
        the quotas it was charged to; one never served gives back its request too."""
        requests, tokens = self._requests, self._tokens
        if not served:
            if lease.requests_charged and requests is not None:
                promised = self._live(Reason.REQUESTS, now_ms)
                before = requests.level_at(now_ms) if promised is not None else 0
                requests.refund(lease.cost.requests, now_ms)
                self._reconciled(Reason.REQUESTS, promised, requests, before, now_ms)
            if lease.window_ts is not None and self._window is not None:
                self._window.refund_at(lease.window_ts, lease.cost.requests, now_ms)
        reserved = lease.cost.tokens
        used = reserved if used_tokens is None else max(0, used_tokens)
        if lease.tokens_charged and tokens is not None and used != reserved:
            promised = self._live(Reason.TOKENS, now_ms)
            before = tokens.level_at(now_ms) if promised is not None else 0
            if used < reserved:
                tokens.refund(reserved - used, now_ms)
            else:
                tokens.charge(used - reserved, now_ms)
            self._reconciled(Reason.TOKENS, promised, tokens, before, now_ms)
        if lease.quotas_charged:
            configured = {period for period, _ in self.policy.quotas()}
            for period in lease.quotas_charged:
                if period in configured:
                    self._quotas[period].reconcile(reserved - used, now_ms)

    def _reconciled(self, reason: Reason, promised: int | None, bucket: TokenBucket,
                    before: int, now_ms: int) -> None:
        """A release moved ``bucket``'s level from ``before``: so does the schedule it
        promised, while a client it promised a slot may still come back
        (:func:`~limiter.herd.reconcile_promise`). ``promised`` is that live promise, read
        before the release (None: there is none, and ``before`` was not read: a level per
        release is a cost on the hot path that only a herd still out needs)."""
        if promised is not None:
            self._promised[reason] = reconcile_promise(promised, self._back.get(reason), bucket,
                                                       before, now_ms)

    def _waits(self, requests: int, tokens: int | None, now_ms: int) -> list[tuple[Reason, int]]:
        """Every dimension without room for ``requests`` and ``tokens`` now, with its exact
        wait (in the order rejections name them); empty when the request fits. ``tokens``
        None skips the token bucket (the headers-phase peek); 0 still waits out a debt."""
        waits = []
        if self._requests is not None and (wait := self._requests.wait_ms(requests, now_ms)):
            waits.append((Reason.REQUESTS, wait))
        if self._window is not None and (wait := self._window.wait_ms(requests, now_ms)):
            waits.append((Reason.WINDOW, wait))
        if (tokens is not None and self._tokens is not None
                and (wait := self._tokens.wait_ms(tokens, now_ms))):
            waits.append((Reason.TOKENS, wait))
        limit = self.policy.max_concurrency
        if limit is not None and len(self._leases) >= limit:
            # A slot frees when some request finishes: expected from observed durations.
            oldest = min((lease.started_ms for lease in self._leases.values()), default=None)
            waits.append((Reason.CONCURRENCY,
                          concurrency_wait(now_ms, oldest, self.mean_duration_ms, limit)))
        if requests and self._shaper is not None and (wait := self._shaper.wait_ms(now_ms)):
            waits.append((Reason.SHAPING, wait))
        return waits

    @property
    def mean_duration_ms(self) -> int:
        """The tenant's observed mean request duration; the configured hint before any."""
        return self._mean_ms if self._samples else self.policy.concurrency_retry_ms

    def _schedule(self, waits: list[tuple[Reason, int]], requests: int, tokens: int | None,
                  now_ms: int) -> list[tuple[Reason, int]]:
        """Exact waits → this client's slot in each dimension's schedule, which moves on by
        one (``limiter.herd``).

        Every dimension the client takes from when it comes back is scheduled, whether it
        refused or not — the request and token buckets, the sliding window and the shaper —
        and the client is told the latest of its slots: a herd refused by the token rate
        alone and spaced by it came back faster than the request rate allows (2 requests/s
        and 100,000 tokens/min, 500-token requests: 19 of 20 refused again after waiting
        their ``retry-after-ms``), faster than a sliding window of 2 a second allows (5 of
        10), and faster than a shaper's backlog drains (7 of 10)."""
        exact = dict(waits)
        slots: dict[Reason, int] = {}
        paced = [(reason, bucket, cost) for reason, bucket, cost in (
            (Reason.REQUESTS, self._requests, requests),
            (Reason.TOKENS, self._tokens if tokens is not None else None, tokens or 0),
        ) if bucket is not None and (cost or reason in exact)]
        live = {reason: self._live(reason, now_ms) for reason, _, _ in paced}
        for reason, bucket, cost in paced:
            slots[reason] = bucket_slot(live[reason], bucket, cost, exact.get(reason, 0),
                                        now_ms)
        window = self._window if requests else None
        if window is not None:
            own_slot, self._window_promised = window_slot(window, requests, now_ms,
                                                          self._window_promised)
            slots[Reason.WINDOW] = max(exact.get(Reason.WINDOW, 0),
                                       min(own_slot, MAX_HERD_WAIT_MS))
        shaper = self._shaper if requests else None
        if shaper is not None:
            live[Reason.SHAPING] = self._live(Reason.SHAPING, now_ms)
            slots[Reason.SHAPING] = self._shaper_slot(shaper, live[Reason.SHAPING],
                                                      exact.get(Reason.SHAPING, 0), now_ms)
        for reason, wait in waits:
            if reason not in slots:  # concurrency: a slot frees as requests end
                slot = herd_wait(now_ms, wait, self._promised.get(reason), concurrency_interval(
                    self.mean_duration_ms, self.policy.max_concurrency or 1))
                slots[reason] = slot = max(wait, min(slot, MAX_HERD_WAIT_MS))
                self._promised[reason] = now_ms + slot
        final = max(slots.values())
        for reason, bucket, cost in paced:
            self._promised[reason] = promise_bucket(live[reason], bucket, cost, final, now_ms)
        if window is not None and own_slot <= final:  # past the bound: no place to keep
            self._window_promised = promise_window(self._window_promised, window.window_ms,
                                                   now_ms + final, requests)
        if shaper is not None:
            self._promise_shaper(shaper, live[Reason.SHAPING], final, now_ms)
        for reason, promise in live.items():  # this client is back at now + final too
            self._back[reason] = promise_back(promise, self._back.get(reason), now_ms + final)
        scheduled = [(reason, slots[reason]) for reason, _ in waits]
        top = max(range(len(scheduled)), key=lambda i: scheduled[i][1])
        scheduled[top] = (scheduled[top][0], final)  # one that did not refuse may set it
        return scheduled

    def _live(self, reason: Reason, now_ms: int) -> int | None:
        """The promise of a bucket's or the shaper's schedule while a client it was made to
        may still come back (:func:`~limiter.herd.live_promise`)."""
        return live_promise(self._promised.get(reason), self._back.get(reason), now_ms)

    def _shaper_slot(self, shaper: Shaper, promised: int | None, wait: int,
                     now_ms: int) -> int:
        """This client's slot in the shaper's schedule: its promise is the backlog's virtual
        tail (ms, rounded up) once every promised client took its departure slot, and the
        client fits once that tail is within the backlog of its return."""
        if promised is None or promised <= now_ms + shaper.drain_ms(now_ms):
            return wait  # nothing promised beyond the shaper's own slots
        rate = shaper.rate
        room = shaper.backlog * rate.period_ms // rate.amount
        return max(wait, min(promised - room - now_ms, MAX_HERD_WAIT_MS))

    def _promise_shaper(self, shaper: Shaper, promised: int | None, final: int,
                        now_ms: int) -> None:
        """The virtual tail once this client, back at ``now + final``, takes the slot after
        the tail (bounded like a bucket's promise)."""
        rate = shaper.rate
        tail = max(now_ms + shaper.drain_ms(now_ms), now_ms + final)
        base = tail if promised is None else max(promised, tail)
        bound = now_ms + MAX_HERD_WAIT_MS + rate_interval(shaper.backlog + 1, rate)
        self._promised[Reason.SHAPING] = min(base + rate_interval(1, rate), bound)

    def _consume(self, cost: Cost, now_ms: int) -> int | None:
        """Charge every dimension; returns when the window logged it (None: no window)."""
        window_ts = None
        if self._requests is not None:
            self._requests.consume(cost.requests, now_ms)
        if self._window is not None:
            window_ts = self._window.consume(cost.requests, now_ms)
        if self._tokens is not None:
            self._tokens.consume(cost.tokens, now_ms)
        for period, _ in self.policy._quotas:
            self._quotas[period].consume(cost.tokens, now_ms)
        return window_ts
