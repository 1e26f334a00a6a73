"""The embedded default stores: one :class:`TenantLimiter` per tenant and the fair-queue
counters, in this process.

Limits are per replica with these stores; configure Redis for global limits.

A tenant no longer configured is forgotten (:meth:`MemoryStore.forget`) as Redis forgets it:
its limiter is kept until it is back to where a new one starts (buckets full, window empty,
shaper drained), and its token quotas' counts until their day or month ends. Configured
again before then, the tenant continues from them: removing and re-adding a key does not
reset its rate limits or its quotas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from limiter.calendar import period_bounds
from limiter.clock import wall_ms
from limiter.decision import QuotaUsage, TenantLimiter, TenantPolicy
from limiter.fairness import DEFAULT_LAG, REBASE_AT, VirtualCounters
from limiter.fairqueue import Offer, QueuedRequest
from limiter.outcome import Admit, Cost, Reject
from limiter.stores.base import Correction


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
        # forgotten tenants' limiters, kept until they are back to a new one's state: tenant
        # → when (ms); and the quota counts of those dropped: tenant → (period end, counts)
        self._fading: dict[str, int] = {}
        self._quotas_left: dict[str, tuple[int, QuotaUsage]] = {}
        self._next_sweep: int | None = None  # no fading limiter or count is due before

    def limiter(self, tenant: str, policy: TenantPolicy, now_ms: int) -> TenantLimiter:
        """The tenant's limiter, created lazily and brought up to date with ``policy``."""
        limiter = self._tenants.get(tenant)
        if limiter is None:
            limiter = TenantLimiter(policy, now_ms, lease_ttl_ms=self._lease_ttl_ms)
            if self._quotas_left:  # configured again within its quotas' period
                left = self._quotas_left.pop(tenant, None)
                if left is not None and left[0] > now_ms:
                    limiter.restore_quotas(left[1])
            self._tenants[tenant] = limiter
        else:
            if self._fading:  # configured again before its limiter was dropped
                self._fading.pop(tenant, None)
            if limiter.policy is not policy and limiter.policy != policy:
                limiter.update_policy(policy, now_ms)
        return limiter

    def forget(self, tenants: Iterable[str]) -> list[str]:
        """``tenants`` are no longer configured and have nothing admitted or queued: their
        limiters are dropped once back to a new one's state (now, or by a later call), their
        token quota counts kept until the period ends. Returns those accepted; one that
        still holds a lease is not (ask again once it is released). Every call also drops
        what earlier calls left to fade and is now due."""
        now_ms = self._clock()
        accepted = []
        for tenant in tenants:
            limiter = self._tenants.get(tenant)
            idle_in = None if limiter is None else limiter.idle_in_ms(now_ms)
            if limiter is not None and idle_in is None:
                continue
            accepted.append(tenant)
            if idle_in is not None:
                self._fading[tenant] = now_ms + idle_in
                self._next_sweep = now_ms  # (those idle already go at once)
        if self._next_sweep is not None and now_ms >= self._next_sweep:
            self._sweep(now_ms)
        return accepted

    def _sweep(self, now_ms: int) -> None:
        """Drop the fading limiters that are back to a new one's state (keeping their quota
        counts) and the quota counts whose period has ended."""
        for tenant, due in list(self._fading.items()):
            limiter = self._tenants[tenant]
            if due > now_ms:
                continue
            idle_in = limiter.idle_in_ms(now_ms)  # (0 unless the clock stepped back)
            if idle_in is None or idle_in > 0:
                self._fading[tenant] = now_ms + (idle_in or 0)
                continue
            del self._fading[tenant], self._tenants[tenant]
            usage = limiter.quota_usage(now_ms)
            if usage:
                end = max(period_bounds(start, period)[1] for period, start, _ in usage)
                self._quotas_left[tenant] = (end, usage)
        self._quotas_left = {tenant: left for tenant, left in self._quotas_left.items()
                             if left[0] > now_ms}
        dues = [*self._fading.values(), *(end for end, _ in self._quotas_left.values())]
        self._next_sweep = min(dues, default=None)

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).check_requests(now_ms)

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str, *, held: int = 0,
        unsent: bool = False,
    ) -> Admit | Reject:
        """``held`` and ``unsent`` are for shared stores: this one cannot lose leases, and
        its leases die with the process that holds them."""
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).admit(cost, lease_id, now_ms)

    def mark_sent(self, tenant: str, lease_id: str) -> None:
        """Nothing to mark (see ``admit``)."""

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> bool:
        return self._release(tenant, policy, lease_id, used_tokens, served)

    def release_soon(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> None:
        self._release(tenant, policy, lease_id, used_tokens, served)

    def _release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None,
        served: bool,
    ) -> bool:
        now_ms = self._clock()
        return self.limiter(tenant, policy, now_ms).release(lease_id, used_tokens, now_ms,
                                                            served=served)

    async def cancel(self, tenant: str, policy: TenantPolicy, lease_id: str) -> None:
        """A call in this process always answers: the lease is freed and everything it
        charged given back, as the Redis store's cancel does (not timed: an admission given
        up on says nothing of request durations)."""
        now_ms = self._clock()
        self.limiter(tenant, policy, now_ms).release(lease_id, 0, now_ms, served=False)

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

    async def correct(self, tenant: str, tokens: int, weight: float, *, band0: bool = False
                      ) -> None:
        self.core.correct(tenant, tokens, weight, band0=band0)

    async def correct_many(self, corrections: Sequence[Correction]) -> None:
        for tenant, tokens, weight, band0 in corrections:
            self.core.correct(tenant, tokens, weight, band0=band0)

    async def counters(self) -> dict[str, float]:
        return self.core.counters()

    def forget(self, tenants: Iterable[str]) -> None:
        self.core.forget(tenants)

    async def close(self) -> None:
        """Nothing to release."""
