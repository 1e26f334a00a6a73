"""What an admission decision returns, and the pure functions that build it from raw views.

Both stores read their state into the same small views (:class:`BucketView`,
:class:`WindowView`, :class:`~limiter.quota.QuotaView`) and build every ``Admit``, ``Reject``,
``Remaining`` and admin ``usage`` snapshot with the functions here, so the Redis store's
answers are identical to the in-memory ones by construction, messages included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from limiter.quota import QuotaView
from limiter.rates import format_duration, require_int


@dataclass(frozen=True)
class Cost:
    """What one request asks for: its prompt plus the output it may generate."""

    prompt_tokens: int
    max_output_tokens: int
    requests: int = 1
    # The reservation: the worst case, reconciled with real usage on release. Derived
    # once: admission and release read it several times per request.
    tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prompt, output, requests = self.prompt_tokens, self.max_output_tokens, self.requests
        if not (type(prompt) is int and type(output) is int and type(requests) is int
                and prompt >= 0 and output >= 0 and requests >= 0):
            require_int("prompt_tokens", prompt, 0)  # raises with the precise complaint
            require_int("max_output_tokens", output, 0)
            require_int("requests", requests, 0)
        object.__setattr__(self, "tokens", prompt + output)



class Reason(StrEnum):
    """Why a request was refused. The tenant's limits give the first eight, KV admission
    (the scheduler and flow control) the last four; the values are the ``x-kvgate-reject``
    header and the metrics' ``reason`` label."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    WINDOW = "requests_window"
    CONTEXT = "context_length_exceeded"
    TOO_LARGE = "tokens_exceed_capacity"
    QUOTA = "quota_exceeded"
    SHAPING = "shaping_backlog_full"  # the tenant's shaper holds as many as it may
    KV_TOO_LARGE = "kv_exceeds_capacity"  # larger than any endpoint's KV cache
    NO_ENDPOINT = "no_ready_endpoint"  # the pool has no fresh, healthy endpoint
    KV_SHARE = "kv_share_exceeded"  # the tenant is over its weighted share of a busy pool
    SATURATED = "pool_saturated"  # every endpoint is full


_STATUS = {  # the rest are 429: the tenant is over its own limits or share
    Reason.CONTEXT: 400,
    Reason.KV_TOO_LARGE: 400,
    Reason.NO_ENDPOINT: 503,
    Reason.SATURATED: 503,
}
QUEUEABLE = frozenset((Reason.SATURATED, Reason.KV_SHARE))  # waiting for capacity can fix these


_LIMIT_NAMES = {
    Reason.REQUESTS: "request rate",
    Reason.WINDOW: "request window",
    Reason.TOKENS: "token rate",
    Reason.CONCURRENCY: "concurrency",
    Reason.SHAPING: "shaping backlog",
}


@dataclass(frozen=True)
class BucketView:
    """A token bucket at one instant: capacity, whole tokens available (negative while in
    debt) and ms until full again."""

    limit: int
    available: int
    reset_ms: int


@dataclass(frozen=True)
class WindowView:
    """The sliding window at one instant (admin snapshot only)."""

    limit: int
    window_ms: int
    used: int
    reset_ms: int


@dataclass(frozen=True)
class ShapingView:
    """The shaper at one instant (admin snapshot only): its backlog limit, the requests
    waiting for their slot, and ms until every slot handed out has started."""

    backlog: int
    held: int
    drain_ms: int


@dataclass(frozen=True)
class Remaining:
    """Feeds ``x-ratelimit-*``: limit = capacity, remaining ≥ 0, reset = ms until full.

    The quota fields describe the *tighter* of the daily and monthly quotas (fewer tokens
    left; on a tie the one resetting later, since the earlier reset alone frees nothing);
    on a quota refusal, the refusing quota that resets last (:func:`quota_reject`).
    """

    request_limit: int | None
    requests_remaining: int | None
    requests_reset_ms: int | None
    token_limit: int | None
    tokens_remaining: int | None
    tokens_reset_ms: int | None
    quota_limit: int | None = None
    quota_remaining: int | None = None
    quota_reset_ms: int | None = None


class Admit:
    """Go ahead; ``lease_id`` must be released exactly once when the request ends.

    ``remaining`` (the headroom right after this admission) may be given as a function of
    state captured at admission: it is computed on first use, as most admissions never
    show it to anyone. ``hold_ms``: how long the tenant's shaper holds the request before
    it may be sent (0 without a shaper, or when its slot is now).
    """

    __slots__ = ("_remaining", "cost", "hold_ms", "lease_id")

    def __init__(self, lease_id: str, cost: Cost,
                 remaining: Remaining | Callable[[], Remaining], hold_ms: int = 0) -> None:
        self.lease_id = lease_id
        self.cost = cost
        self._remaining = remaining
        self.hold_ms = hold_ms

    @property
    def remaining(self) -> Remaining:
        if not isinstance(self._remaining, Remaining):
            self._remaining = self._remaining()
        return self._remaining

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Admit):
            return NotImplemented
        return (self.lease_id, self.cost, self.hold_ms, self.remaining) == (
            other.lease_id, other.cost, other.hold_ms, other.remaining)

    __hash__ = None  # type: ignore[assignment]  # mutable cache: unhashable, like the rest

    def __repr__(self) -> str:
        return f"Admit(lease_id={self.lease_id!r}, cost={self.cost!r}, " \
               f"hold_ms={self.hold_ms}, remaining={self.remaining!r})"


NO_REMAINING = Remaining(None, None, None, None, None, None)


@dataclass(frozen=True)
class Reject:
    """No — the one refusal type, whoever refuses: the tenant's limits, the scheduler or flow
    control. ``retry_after_ms`` is None when waiting a little cannot help (the request is too
    big, or a token quota is spent). ``reset_ms`` is set for quota rejections: the ms until
    the exhausted quota resets (a client may show it; retrying before then is pointless).
    ``extproc.rejections`` turns it into the HTTP answer."""

    reason: Reason
    retry_after_ms: int | None
    remaining: Remaining
    message: str
    reset_ms: int | None = None

    @property
    def status(self) -> int:
        """400 for a request that can never run, 503 for a pool that cannot run it now, 429
        for a tenant over its limits or share."""
        return _STATUS.get(self.reason, 429)

    @property
    def retryable(self) -> bool:
        return self.retry_after_ms is not None


def refuse(reason: Reason, message: str, retry_after_ms: int | None) -> Reject:
    """A refusal that no tenant limit gave (KV admission): nothing to report as remaining."""
    return Reject(reason, retry_after_ms, NO_REMAINING, message)


def _seconds(ms: int) -> str:
    """``1234`` → ``"1.234"`` without a float round trip."""
    return f"{ms // 1000}.{ms % 1000:03d}"


def _listed(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def tightest(quotas: Sequence[QuotaView]) -> QuotaView | None:
    """The quota that binds first: fewest tokens left, then the later reset."""
    return min(quotas, key=lambda q: (q.remaining, -q.reset_ms), default=None)


def remaining_of(
    requests: BucketView | None, tokens: BucketView | None, quotas: Sequence[QuotaView]
) -> Remaining:
    """The ``x-ratelimit-*`` view of raw state (negative availability shows as 0)."""
    quota = tightest(quotas) if quotas else None
    return Remaining(
        None if requests is None else requests.limit,
        None if requests is None else max(0, requests.available),
        None if requests is None else requests.reset_ms,
        None if tokens is None else tokens.limit,
        None if tokens is None else max(0, tokens.available),
        None if tokens is None else tokens.reset_ms,
        None if quota is None else quota.limit,
        None if quota is None else quota.remaining,
        None if quota is None else quota.reset_ms,
    )


def wait_reject(waits: Sequence[tuple[Reason, int]], remaining: Remaining) -> Reject:
    """The longest wait wins: retrying after it satisfies every other dimension too."""
    reason, wait = max(waits, key=lambda rw: rw[1])
    names = [_LIMIT_NAMES[r] for r, _ in waits]
    plural = "s" if len(names) > 1 else ""
    message = f"tenant over its {_listed(names)} limit{plural}; retry after {_seconds(wait)} s"
    return Reject(reason, wait, remaining, message)


def quota_reject(failing: Sequence[QuotaView], tokens: int, remaining: Remaining) -> Reject:
    """A spent quota: no retry-after (minutes of retrying cannot help), but the reset time.

    Its ``-quota`` headers describe the refusing quota that resets last, not the one with
    the fewest tokens left: when both refuse, the daily reset alone admits nothing, and a
    client that waits for the reset it was shown must be admitted."""
    binding = max(failing, key=lambda q: (q.reset_ms, -q.remaining))  # a tie: fewer left
    reset = binding.reset_ms
    remaining = replace(remaining, quota_limit=binding.limit,
                        quota_remaining=binding.remaining, quota_reset_ms=reset)
    names = [f"{q.period.value} token quota ({q.used} of {q.limit} used)" for q in failing]
    message = (
        f"tenant over its {_listed(names)}; this request reserves {tokens} tokens; "
        f"the quota resets in {format_duration(reset)}"
    )
    return Reject(Reason.QUOTA, None, remaining, message, reset_ms=reset)


@dataclass(frozen=True)
class Snapshot:
    """Every dimension of one tenant at one instant: the admin ``usage`` endpoint's data."""

    requests: BucketView | None
    tokens: BucketView | None
    window: WindowView | None
    quotas: tuple[QuotaView, ...]
    in_flight: int
    max_concurrency: int | None
    shaping: ShapingView | None = None

    def remaining(self) -> Remaining:
        """The same view an admission would report."""
        return remaining_of(self.requests, self.tokens, self.quotas)

    def usage(self) -> dict[str, Any]:
        """JSON-friendly: plain dicts, ints and None only."""
        return {
            "in_flight": self.in_flight,
            "max_concurrency": self.max_concurrency,
            "requests": _plain(self.requests),
            "tokens": _plain(self.tokens),
            "window": _plain(self.window),
            "quotas": {q.period.value: _quota_dict(q) for q in self.quotas},
            "shaping": _plain(self.shaping),
        }


def _plain(view: BucketView | WindowView | ShapingView | None) -> dict[str, int] | None:
    return None if view is None else asdict(view)  # (compiled classes have no __dict__)


def _quota_dict(quota: QuotaView) -> dict[str, int]:
    return {
        "limit": quota.limit,
        "used": quota.used,
        "remaining": quota.remaining,
        "reset_ms": quota.reset_ms,
        "period_start_ms": quota.start_ms,
    }
