"""One tenant's admission decision across every limit dimension, all or nothing.

A request is admitted only if *every* dimension has room; only then is anything consumed, so
a rejection never costs the tenant budget. A rejection carries the exact wait after which a
retry is admitted (absent other traffic): the max over the dimensions that said no.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from limiter.buckets import SlidingWindow, TokenBucket
from limiter.rates import Rate, require_int

_POSITIVE_FIELDS = (
    "request_burst",
    "token_burst",
    "max_concurrency",
    "max_context_tokens",
    "window_limit",
    "window_ms",
)


def _pair(policy: TenantPolicy, first: str, second: str) -> None:
    if (getattr(policy, first) is None) != (getattr(policy, second) is None):
        raise ValueError(f"{first} and {second} must be set together (or both left unset)")


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's limits; ``None`` means that dimension is unlimited.

    Rates come with their bucket capacity (burst) and the window limit with its length: a
    half-configured dimension is an error, not a silent "unlimited".
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

    def __post_init__(self) -> None:
        _pair(self, "request_rate", "request_burst")
        _pair(self, "token_rate", "token_burst")
        _pair(self, "window_limit", "window_ms")
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name), 1)
        require_int("concurrency_retry_ms", self.concurrency_retry_ms, 1)


@dataclass(frozen=True)
class Cost:
    """What one request asks for: its prompt plus the output it may generate."""

    prompt_tokens: int
    max_output_tokens: int
    requests: int = 1

    def __post_init__(self) -> None:
        require_int("prompt_tokens", self.prompt_tokens, 0)
        require_int("max_output_tokens", self.max_output_tokens, 0)
        require_int("requests", self.requests, 0)

    @property
    def tokens(self) -> int:
        """The reservation: the worst case, reconciled with real usage on release."""
        return self.prompt_tokens + self.max_output_tokens


class Reason(StrEnum):
    """Why a request was rejected; the values double as OpenAI-style error codes."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    WINDOW = "requests_window"
    CONTEXT = "context_length_exceeded"
    TOO_LARGE = "tokens_exceed_capacity"


_LIMIT_NAMES = {
    Reason.REQUESTS: "request rate",
    Reason.WINDOW: "request window",
    Reason.TOKENS: "token rate",
    Reason.CONCURRENCY: "concurrency",
}


@dataclass(frozen=True)
class Remaining:
    """Feeds ``x-ratelimit-*``: limit = capacity, remaining ≥ 0, reset = ms until full."""

    request_limit: int | None
    requests_remaining: int | None
    requests_reset_ms: int | None
    token_limit: int | None
    tokens_remaining: int | None
    tokens_reset_ms: int | None


@dataclass(frozen=True)
class Admit:
    """Go ahead; ``lease_id`` must be released exactly once when the request ends."""

    lease_id: str
    cost: Cost
    remaining: Remaining


@dataclass(frozen=True)
class Reject:
    """No; ``retry_after_ms`` is None when waiting cannot help (the request is too big)."""

    reason: Reason
    retry_after_ms: int | None
    remaining: Remaining
    message: str


def _seconds(ms: int) -> str:
    """``1234`` → ``"1.234"`` without a float round trip."""
    return f"{ms // 1000}.{ms % 1000:03d}"


def _bucket_view(bucket: TokenBucket | None, now_ms: int) -> tuple[int | None, ...]:
    if bucket is None:
        return (None, None, None)
    return (bucket.capacity, max(0, bucket.available(now_ms)), bucket.reset_ms(now_ms))


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


def _never_fits(policy: TenantPolicy, cost: Cost) -> tuple[Reason, str] | None:
    """Why ``cost`` can never be admitted under ``policy`` (retrying cannot help), if so."""
    limit = policy.max_context_tokens
    if limit is not None and cost.prompt_tokens > limit:
        return Reason.CONTEXT, (
            f"prompt of {cost.prompt_tokens} tokens exceeds this tenant's maximum context "
            f"of {limit} tokens"
        )
    limit = policy.token_burst
    if limit is not None and cost.tokens > limit:
        return Reason.TOO_LARGE, (
            f"request reserves {cost.tokens} tokens (prompt + max_tokens) but this tenant's "
            f"token budget holds at most {limit}; lower max_tokens"
        )
    caps = [c for c in (policy.request_burst, policy.window_limit) if c is not None]
    if caps and cost.requests > min(caps):
        return Reason.TOO_LARGE, (
            f"request counts as {cost.requests} requests but at most {min(caps)} fit"
        )
    return None


@dataclass(frozen=True)
class _Lease:
    cost: Cost
    tokens_charged: bool


class TenantLimiter:
    """All limit dimensions of one tenant: request rate, sliding window, token rate,
    concurrency and context length. Pure state; the caller passes ``now_ms`` every time."""

    def __init__(self, policy: TenantPolicy, now_ms: int) -> None:
        self.policy = TenantPolicy()
        self._requests: TokenBucket | None = None
        self._tokens: TokenBucket | None = None
        self._window: SlidingWindow | None = None
        self._leases: dict[str, _Lease] = {}
        self.update_policy(policy, now_ms)

    @property
    def in_flight(self) -> int:
        """Admitted requests not yet released (the concurrency in use)."""
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

    def update_policy(self, policy: TenantPolicy, now_ms: int) -> None:
        """Swap limits on a config reload; current levels carry over, clamped to new caps."""
        self._requests = _rebucket(
            self._requests, policy.request_rate, policy.request_burst, now_ms
        )
        self._tokens = _rebucket(self._tokens, policy.token_rate, policy.token_burst, now_ms)
        self._window = self._rewindow(policy, now_ms)
        self.policy = policy

    def _rewindow(self, policy: TenantPolicy, now_ms: int) -> SlidingWindow | None:
        if policy.window_limit is None or policy.window_ms is None:
            return None
        if self._window is None:
            return SlidingWindow(policy.window_limit, policy.window_ms)
        self._window.reconfigure(policy.window_limit, policy.window_ms, now_ms)
        return self._window

    def remaining(self, now_ms: int) -> Remaining:
        """Current headroom for the ``x-ratelimit-*`` headers."""
        return Remaining(*_bucket_view(self._requests, now_ms), *_bucket_view(self._tokens, now_ms))

    def check_requests(self, now_ms: int) -> Reject | None:
        """Peek (consumes nothing) at the request-count dimensions, before the body arrives."""
        waits = self._request_waits(1, now_ms) + self._concurrency_wait()
        return self._reject(waits, now_ms) if waits else None

    def admit(self, cost: Cost, lease_id: str, now_ms: int) -> Admit | Reject:
        """Admit ``cost`` under ``lease_id`` if every dimension has room, else consume nothing."""
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} is already held")
        too_big = self._static_reject(cost, now_ms)
        if too_big is not None:
            return too_big
        waits = self._request_waits(cost.requests, now_ms)
        waits += self._token_waits(cost.tokens, now_ms) + self._concurrency_wait()
        if waits:
            return self._reject(waits, now_ms)
        self._consume(cost, now_ms)
        self._leases[lease_id] = _Lease(cost, tokens_charged=self._tokens is not None)
        return Admit(lease_id, cost, self.remaining(now_ms))

    def release(self, lease_id: str, used_tokens: int | None, now_ms: int) -> bool:
        """Free the lease exactly once (False on repeats) and reconcile reserved vs used tokens.

        ``used_tokens=None`` (usage unknown: error, disconnect) counts the reservation as used.
        """
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        if lease.tokens_charged and self._tokens is not None:
            reserved = lease.cost.tokens
            used = reserved if used_tokens is None else max(0, used_tokens)
            if used < reserved:
                self._tokens.refund(reserved - used, now_ms)
            elif used > reserved:
                self._tokens.charge(used - reserved, now_ms)
        return True

    def _request_waits(self, requests: int, now_ms: int) -> list[tuple[Reason, int]]:
        waits = []
        if self._requests is not None:
            waits.append((Reason.REQUESTS, self._requests.wait_ms(requests, now_ms)))
        if self._window is not None:
            waits.append((Reason.WINDOW, self._window.wait_ms(requests, now_ms)))
        return [(reason, wait) for reason, wait in waits if wait > 0]

    def _token_waits(self, tokens: int, now_ms: int) -> list[tuple[Reason, int]]:
        wait = self._tokens.wait_ms(tokens, now_ms) if self._tokens is not None else 0
        return [(Reason.TOKENS, wait)] if wait > 0 else []

    def _concurrency_wait(self) -> list[tuple[Reason, int]]:
        limit = self.policy.max_concurrency
        if limit is None or self.in_flight < limit:
            return []
        # A slot frees when some request finishes: unknowable here, so a configured hint.
        return [(Reason.CONCURRENCY, self.policy.concurrency_retry_ms)]

    def _reject(self, waits: list[tuple[Reason, int]], now_ms: int) -> Reject:
        """The longest wait wins: retrying after it satisfies every other dimension too."""
        reason, wait = max(waits, key=lambda rw: rw[1])
        names = [_LIMIT_NAMES[r] for r, _ in waits]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        plural = "s" if len(names) > 1 else ""
        message = f"tenant over its {listed} limit{plural}; retry after {_seconds(wait)} s"
        return Reject(reason, wait, self.remaining(now_ms), message)

    def _static_reject(self, cost: Cost, now_ms: int) -> Reject | None:
        """Requests that can never be admitted, however long the client waits."""
        problem = _never_fits(self.policy, cost)
        if problem is None:
            return None
        return Reject(problem[0], None, self.remaining(now_ms), problem[1])

    def _consume(self, cost: Cost, now_ms: int) -> None:
        if self._requests is not None:
            self._requests.consume(cost.requests, now_ms)
        if self._window is not None:
            self._window.consume(cost.requests, now_ms)
        if self._tokens is not None:
            self._tokens.consume(cost.tokens, now_ms)
