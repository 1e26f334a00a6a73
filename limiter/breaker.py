"""A circuit breaker for the shared store, sans-IO: the caller passes ``now_ms`` and acts on
the transitions it returns (one log line and one metric each).

While Redis is failing, every admission would otherwise wait out its timeout budget first;
an open breaker skips straight to the failure policy, and a single probe per ``open_ms``
notices when Redis is back, so limits resume within about ``open_ms``.

A probe that never reports (its caller was cancelled: a client that went away while its
admission was the probe) must not hold the breaker half-open for good, every later call
skipping Redis with nothing left to close it: a probe not heard of within ``open_ms`` is
taken as lost, and the next call probes again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"  # healthy: calls go to the store
    OPEN = "open"  # failing: calls skip the store until open_ms has passed
    HALF_OPEN = "half_open"  # one probe call is in flight (open_ms at most); the rest skip


@dataclass(frozen=True)
class Transition:
    old: BreakerState
    new: BreakerState


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, open_ms: int = 500):
        if failure_threshold < 1 or open_ms < 1:
            raise ValueError("failure_threshold and open_ms must be at least 1")
        self.failure_threshold = failure_threshold
        self.open_ms = open_ms
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0  # when it opened, or (half-open) when the probe went

    def allow(self, now_ms: int) -> tuple[bool, Transition | None]:
        """May this call go to the store? An open breaker lets one probe through per open_ms
        (a half-open one too: its probe was lost)."""
        if self.state is BreakerState.CLOSED:
            return True, None
        if now_ms - self._opened_at < self.open_ms:
            return False, None
        self._opened_at = now_ms
        if self.state is BreakerState.HALF_OPEN:
            return True, None
        return True, self._move(BreakerState.HALF_OPEN)

    def success(self) -> Transition | None:
        self._failures = 0
        if self.state is BreakerState.CLOSED:
            return None
        return self._move(BreakerState.CLOSED)

    def failure(self, now_ms: int) -> Transition | None:
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self._failures >= self.failure_threshold
        ):
            self._opened_at = now_ms
            return self._move(BreakerState.OPEN)
        return None  # already open: a straggler from before opening changes nothing

    def _move(self, new: BreakerState) -> Transition:
        transition = Transition(self.state, new)
        self.state = new
        return transition


class Breakers:
    """One breaker per failure domain (a Redis Cluster node; a rate limit domain), made on
    first use with ``template``'s settings (``template`` is domain ``""``'s: a single
    Redis), and when a call last asked each. Only a call moves a breaker, so a gauge counts
    those open or half-open that a call asked within ``idle_ms``: one left open when the
    calls stopped says nothing of the store now."""

    def __init__(self, template: CircuitBreaker) -> None:
        self.template = template
        self._by_domain: dict[str, CircuitBreaker] = {"": template}
        self._asked_ms: dict[str, int] = {}

    def get(self, domain: str) -> CircuitBreaker:
        breaker = self._by_domain.get(domain)
        if breaker is None:
            breaker = self._by_domain[domain] = CircuitBreaker(self.template.failure_threshold,
                                                               self.template.open_ms)
        return breaker

    def asked(self, domain: str, now_ms: int) -> None:
        self._asked_ms[domain] = now_ms

    def allow(self, domain: str, now_ms: int
              ) -> tuple[CircuitBreaker, bool, Transition | None]:
        """``domain``'s breaker, whether this call may go, and the transition to report."""
        self._asked_ms[domain] = now_ms
        breaker = self.get(domain)
        allowed, transition = breaker.allow(now_ms)
        return breaker, allowed, transition

    def open_count(self, now_ms: int, idle_ms: int) -> int:
        """Domains open or half-open and asked within ``idle_ms``. A domain other than
        ``""`` no call asked for longer is forgotten (a Cluster node whose slots moved
        elsewhere would keep its breaker open with nothing left to probe it)."""
        for domain in [d for d, at in self._asked_ms.items() if d and now_ms - at > idle_ms]:
            del self._asked_ms[domain]
            self._by_domain.pop(domain, None)
        return sum(breaker.state != BreakerState.CLOSED
                   and now_ms - self._asked_ms.get(domain, now_ms) <= idle_ms
                   for domain, breaker in self._by_domain.items())
