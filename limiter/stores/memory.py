"""The embedded default stores: one :class:`TenantLimiter` per tenant and the fair-queue
counters, in this process.

Limits are per replica with these stores; configure Redis for global limits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from limiter.clock import wall_ms
from limiter.decision import TenantLimiter, TenantPolicy
from limiter.fairness import DEFAULT_LAG, REBASE_AT, VirtualCounters
from limiter.fairqueue import Offer, QueuedRequest
from limiter.outcome import Admit, Cost, Reject


class MemoryStore:
    """A :class:`~limiter.stores.LimiterStore` in a dict. Methods are ``async`` only to match
    the protocol: none of them awaits, so each call is atomic on the event loop.

    ``lease_ttl_ms`` (off by default: in one process a lease cannot be leaked by a crashed
    peer) makes unreleased leases expire as the Redis store's do.
    """

    def __init__(
        self, clock: Callable[[], int] = wall_ms, *, lease_ttl_ms: int | None = None
    ) -> None:
        self._clock = clock
        self._lease_ttl_ms = lease_ttl_ms
        self._tenants: dict[str, TenantLimiter] = {}

    def limiter(self, tenant: str, policy: TenantPolicy, now_ms: int) -> TenantLimiter:
        """The tenant's limiter, created lazily and brought up to date with ``policy``."""
        limiter = self._tenants.get(tenant)
        if limiter is None:
            limiter = TenantLimiter(policy, now_ms, lease_ttl_ms=self._lease_ttl_ms)
            self._tenants[tenant] = limiter
        elif limiter.policy is not policy and limiter.policy != policy:
            limiter.update_policy(policy, now_ms)
        return limiter

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).check_requests(now_ms)

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str, *, held: int = 0
    ) -> Admit | Reject:
        """``held`` is for shared stores: this one cannot lose leases."""
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).admit(cost, lease_id, now_ms)

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None
    ) -> bool:
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).release(lease_id, used_tokens, now_ms)

    async def cancel(self, tenant: str, policy: TenantPolicy, lease_id: str) -> None:
        """A call in this process always answers, so only the lease can be left to free
        (not timed: an admission given up on says nothing of request durations)."""
        now_ms = self._clock()
        self.limiter(tenant, policy, now_ms).release(lease_id, 0, now_ms, timed=False)

    async def renew(self, tenant: str, lease_ids: list[str], *, reassert: bool = False) -> None:
        limiter = self._tenants.get(tenant)
        if limiter is not None:
            limiter.renew(lease_ids, self._clock())

    async def in_flight(self, tenant: str) -> int:
        limiter = self._tenants.get(tenant)
        return 0 if limiter is None else limiter.expire_leases(self._clock())

    async def usage(self, tenant: str, policy: TenantPolicy) -> dict[str, Any]:
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).usage(now_ms)

    async def close(self) -> None:
        """Nothing to release; here for the protocol."""


class MemoryFairness:
    """:class:`VirtualCounters` behind the :class:`Fairness` protocol. Its coroutines never
    await, so each call is atomic on the event loop."""

    def __init__(self, *, lag_tokens: int = DEFAULT_LAG, rebase_at: int = REBASE_AT) -> None:
        self.core = VirtualCounters(lag_tokens=lag_tokens, rebase_at=rebase_at)

    @property
    def virtual_time(self) -> float:
        return self.core.virtual_time

    async def activate(self, tenant: str) -> None:
        self.core.activate(tenant)

    async def choose(self, offers: Sequence[Offer]) -> QueuedRequest | None:
        return self.core.choose(offers)

    async def correct(self, tenant: str, tokens: int, weight: float) -> None:
        self.core.correct(tenant, tokens, weight)

    async def counters(self) -> dict[str, float]:
        return self.core.counters()

    async def close(self) -> None:
        """Nothing to release."""
