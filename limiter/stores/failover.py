"""A shared (Redis) store behind a timeout budget, a circuit breaker and a failure policy.

Admission must never hang on Redis: each call gets ``timeout_ms``; failures open the
breaker, and while it is open the configured policy decides — ``fail_open`` admits
unlimited, ``fail_closed`` answers 503, ``local`` enforces this replica's share of every
limit in memory. Leases remember which store admitted them, so each is released where it
was taken; leases left in Redis by a failed release expire by their TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from limiter.breaker import CircuitBreaker, Transition
from limiter.clock import monotonic_ms
from limiter.decision import TenantPolicy
from limiter.fairqueue import QueuedRequest
from limiter.outcome import NO_REMAINING, Admit, Cost, Reason, Reject
from limiter.share import scale_policy
from limiter.stores.base import Fairness, LimiterStore, StoreUnavailable
from limiter.stores.memory import MemoryFairness, MemoryStore

log = logging.getLogger(__name__)

class FailurePolicy(StrEnum):
    FAIL_OPEN = "fail_open"
    FAIL_CLOSED = "fail_closed"
    LOCAL = "local"


class FailoverStore:
    """A :class:`LimiterStore` that degrades as configured instead of failing requests."""

    def __init__(
        self,
        primary: LimiterStore,
        *,
        policy: FailurePolicy,
        replicas: int = 1,
        timeout_s: float = 0.02,
        breaker: CircuitBreaker | None = None,
        on_transition: Callable[[Transition], None] | None = None,
        on_fallback: Callable[[str], None] | None = None,
        clock_ms: Callable[[], int] = monotonic_ms,
    ):
        self.primary = primary
        self.policy = policy
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self.local = MemoryStore()
        self.clock_ms = clock_ms
        self._on_transition = on_transition or (lambda _t: None)
        self._on_fallback = on_fallback or (lambda _p: None)
        self._local_policies: dict[TenantPolicy, TenantPolicy] = {}
        self._where: dict[str, str] = {}  # lease id → "primary" | "local" | "open"
        self._blocked: dict[str, tuple[int, Reject]] = {}  # tenant → (until ms, rejection)

    # -- the LimiterStore protocol ---------------------------------------------------------

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        """The headers-phase peek, answered without a Redis round trip: from the last
        rejection Redis gave this tenant, while its retry time has not passed. Admission
        itself stays one round trip; a tenant that keeps knocking is turned away early."""
        if self.breaker.state != "closed" and self.policy is FailurePolicy.LOCAL:
            return await self.local.check_requests(tenant, self._local(policy))
        blocked = self._blocked.get(tenant)
        if blocked is None:
            return None
        until, reject = blocked
        wait = until - self.clock_ms()
        if wait <= 0:
            del self._blocked[tenant]
            return None
        return dataclasses.replace(reject, retry_after_ms=wait)

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str
    ) -> Admit | Reject:
        ok, result = await self._try(self.primary.admit(tenant, policy, cost, lease_id))
        if ok:
            if isinstance(result, Admit):
                self._where[lease_id] = "primary"
            elif result.reason in (Reason.REQUESTS, Reason.WINDOW) and result.retry_after_ms:
                self._blocked[tenant] = (self.clock_ms() + result.retry_after_ms, result)
            return result
        self._on_fallback(self.policy.value)
        if self.policy is FailurePolicy.FAIL_CLOSED:
            raise StoreUnavailable("shared limits unavailable and failure_policy is fail_closed")
        if self.policy is FailurePolicy.FAIL_OPEN:
            self._where[lease_id] = "open"
            return Admit(lease_id=lease_id, cost=cost, remaining=NO_REMAINING)
        decision = await self.local.admit(tenant, self._local(policy), cost, lease_id)
        if isinstance(decision, Admit):
            self._where[lease_id] = "local"
        return decision

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None
    ) -> bool:
        where = self._where.pop(lease_id, None)
        if where == "local":
            return await self.local.release(tenant, self._local(policy), lease_id, used_tokens)
        if where == "primary":
            ok, result = await self._try(
                self.primary.release(tenant, policy, lease_id, used_tokens)
            )
            return bool(result) if ok else False  # its TTL frees the lease in Redis
        return where == "open"

    async def renew(self, tenant: str, lease_ids: list[str]) -> None:
        mine = [lease for lease in lease_ids if self._where.get(lease) == "primary"]
        if mine:
            await self._try(self.primary.renew(tenant, mine))

    async def in_flight(self, tenant: str) -> int:
        ok, result = await self._try(self.primary.in_flight(tenant))
        local = await self.local.in_flight(tenant)
        return (result if ok else 0) + local

    async def usage(self, tenant: str, policy: TenantPolicy) -> dict[str, Any]:
        ok, result = await self._try(self.primary.usage(tenant, policy))
        if ok:
            return {**result, "store": "redis"}
        local = await self.local.usage(tenant, self._local(policy))
        return {**local, "store": f"unavailable ({self.policy.value})"}

    async def close(self) -> None:
        await self.primary.close()

    # -- plumbing --------------------------------------------------------------------------

    async def _try(self, call: Any) -> tuple[bool, Any]:
        """(True, result) from the primary, or (False, None) when it is skipped or failed."""
        allowed, transition = self.breaker.allow(self.clock_ms())
        self._report(transition)
        if not allowed:
            call.close()  # never awaited: silence "coroutine was never awaited"
            return False, None
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await call
        except (StoreUnavailable, TimeoutError, OSError) as error:
            self._report(self.breaker.failure(self.clock_ms()), error)
            return False, None
        self._report(self.breaker.success())
        return True, result

    def _report(self, transition: Transition | None, error: BaseException | None = None) -> None:
        if transition is None:
            return
        why = f": {error!r}" if error else ""
        level = logging.INFO if transition.new == "closed" else logging.WARNING
        log.log(level, "shared store breaker %s → %s (failure policy %s)%s",
                transition.old, transition.new, self.policy.value, why)
        self._on_transition(transition)

    def _local(self, policy: TenantPolicy) -> TenantPolicy:
        scaled = self._local_policies.get(policy)
        if scaled is None:
            scaled = self._local_policies[policy] = scale_policy(policy, self.replicas)
        return scaled


class FailoverFairness:
    """Fair-queue counters in Redis (one global weighted order across replicas), falling back
    to this process's own counters while Redis is unreachable, so dispatch never stalls."""

    def __init__(self, shared: Fairness, timeout_s: float):
        self.shared = shared
        self.local = MemoryFairness()
        self.timeout_s = timeout_s

    async def activate(self, tenant: str) -> None:
        await self.local.activate(tenant)
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(self.timeout_s):
                await self.shared.activate(tenant)

    async def choose(self, candidates: list[QueuedRequest], now_ms: int) -> QueuedRequest | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.shared.choose(candidates, now_ms)
        except (StoreUnavailable, TimeoutError):
            return await self.local.choose(candidates, now_ms)

    async def counters(self) -> dict[str, float]:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.shared.counters()
        except (StoreUnavailable, TimeoutError):
            return await self.local.counters()

    async def close(self) -> None:
        await self.shared.close()
