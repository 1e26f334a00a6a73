"""The one interface the request path uses for limits, whichever store sits behind it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from limiter.decision import Admit, Cost, Reject, TenantPolicy


@runtime_checkable
class LimiterStore(Protocol):
    """Per-tenant admission state. Async because the shared (Redis) store does I/O.

    The policy travels with every call so a store never holds stale limits: it creates a
    tenant's state lazily and applies a changed policy on the next call.
    """

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        """Peek at request-count limits (headers phase); consumes nothing."""
        ...

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str
    ) -> Admit | Reject:
        """All-or-nothing admission across every dimension."""
        ...

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None
    ) -> bool:
        """Release a lease exactly once; False if unknown or already released."""
        ...

    async def in_flight(self, tenant: str) -> int:
        """Leases currently held by ``tenant``."""
        ...
