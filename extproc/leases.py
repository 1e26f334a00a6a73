"""Lease ids, and the admissions that hold them until they are released.

An id is unique across every replica sharing a Redis (a random per-process prefix and a
counter), so a store can key leases by it. The book of open leases lets the server renew the
leases of long-running streams before their TTL in the shared store runs out.
"""

from __future__ import annotations

import itertools
import os

from limiter.stores import LimiterStore


class LeaseBook:
    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._numbers = itertools.count()
        self.open: dict[str, str] = {}  # lease id → tenant name

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._numbers):x}"

    def opened(self, lease_id: str, tenant: str) -> None:
        self.open[lease_id] = tenant

    def closed(self, lease_id: str) -> None:
        self.open.pop(lease_id, None)

    async def renew(self, store: LimiterStore) -> None:
        """Keep every open lease alive in the shared store: one call per tenant."""
        by_tenant: dict[str, list[str]] = {}
        for lease_id, tenant in list(self.open.items()):
            by_tenant.setdefault(tenant, []).append(lease_id)
        for tenant, leases in by_tenant.items():
            await store.renew(tenant, leases)
