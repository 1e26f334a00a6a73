"""The interfaces the request path uses for limits and fair-queue counters, whichever store
sits behind them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from limiter.decision import TenantPolicy
from limiter.fairqueue import Offer, QueuedRequest
from limiter.outcome import Admit, Cost, Reject
from limiter.stores.slots import SlotMap

Correction = tuple[str, int, float, bool]
"""One fair-order correction: tenant, tokens (negative: a refund), weight, band-0 work."""


class StoreUnavailable(Exception):
    """The shared store could not answer (connection refused, timeout, server error).

    One exception type so the caller's failure policy (fail open, fail closed, fall back to
    local limits) needs to know nothing about the store's client library.
    """


class LeasesLost(StoreUnavailable):
    """The shared store holds fewer of a tenant's leases than this replica does (Redis
    restarted empty): they must be re-asserted before anything is admitted on top."""


@runtime_checkable
class LimiterStore(Protocol):
    """Per-tenant admission state. Async because the shared (Redis) store does I/O.

    The policy travels with every call so a store never holds stale limits: it creates a
    tenant's state lazily and applies a changed policy on the next call. Any method of a
    shared store may raise :class:`StoreUnavailable`.
    """

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        """Peek at request-count limits (headers phase); consumes nothing."""
        ...

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str, *, held: int = 0,
        unsent: bool = False,
    ) -> Admit | Reject:
        """All-or-nothing admission across every dimension. ``held``: leases of ``tenant``
        the caller holds in this store; a shared store that has fewer raises
        :class:`LeasesLost` and charges nothing. ``unsent``: the request waits (in a pool's
        queue) before it goes upstream, until :meth:`mark_sent`; a shared store gives its
        reservation back to the quotas should its lease expire unreleased before then (its
        holder died with it queued, or held for its shaper's slot)."""
        ...

    def mark_sent(self, tenant: str, lease_id: str) -> None:
        """An ``unsent`` admission was dispatched: from now on an expiry of its lease keeps
        its quota charge, as for any request that ran. Not awaited, not retried."""
        ...

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> bool:
        """Release a lease exactly once; False if unknown, expired or already released.
        ``served=False``: the request never ran, and every charge of its admission comes
        back (its request and window entry too, not only its tokens)."""
        ...

    def release_soon(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> None:
        """:meth:`release`, not waiting for the store's answer (the request path's way)."""
        ...

    async def cancel(self, tenant: str, policy: TenantPolicy, lease_id: str) -> None:
        """Undo an admission whose answer never came back: free its lease and refund all it
        charged if it ran, and make sure it charges nothing if it runs later."""
        ...

    async def renew(self, tenant: str, lease_ids: list[str], *, reassert: bool = False) -> None:
        """Extend the TTL of held leases (long streams), so they are not reclaimed as leaked;
        with ``reassert``, put back those the store lost (a restarted Redis)."""
        ...

    async def in_flight(self, tenant: str) -> int:
        """Leases currently held by ``tenant``."""
        ...

    async def usage(self, tenant: str, policy: TenantPolicy) -> dict[str, Any]:
        """JSON-friendly snapshot of every dimension (admin endpoint)."""
        ...

    def forget(self, tenants: Iterable[str]) -> list[str]:
        """``tenants`` were removed from the configuration and have nothing admitted or
        queued: drop what this process keeps for them, once nothing of theirs is owed to
        the shared store. Returns those forgotten; the caller asks again later for the
        others. What a shared store keeps (Redis) expires there by itself; the in-memory
        store keeps a tenant's limits as long as Redis would (see ``MemoryStore``). No I/O."""
        ...


class SharedStore(LimiterStore, Protocol):
    """A store every replica shares (Redis), behind :class:`~limiter.stores.FailoverStore`,
    which serves from memory while it is unreachable and tells it afterwards."""

    async def charge_usage(self, tenant: str, policy: TenantPolicy, usage_id: str,
                           used_tokens: int) -> None:
        """Charge ``used_tokens`` to ``tenant``'s quotas for an admission this store never
        saw (the fallback served it): once per ``usage_id``, however often it is sent."""
        ...

    async def close(self) -> None:
        """Release the store's resources (connections)."""
        ...

    def queue_release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> asyncio.Future[Any]:
        """:meth:`release`, sent without waiting: the future gets its answer or failure."""
        ...

    async def settle_releases(self) -> None:
        """Wait until every release queued so far (:meth:`queue_release`) has its answer."""
        ...

    def on_connection_lost(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called whenever a connection to the store turns out dead (it
        may have restarted and forgotten the leases it held)."""
        ...

    def domain(self, tenant: str) -> str:
        """What fails together with ``tenant``'s state: the Redis Cluster node serving its
        keys' slot ("" for a single Redis, one domain for every tenant)."""
        ...

    @property
    def times_its_calls(self) -> bool:
        """Whether each call fails by itself (``TimeoutError``) when the store does not
        answer within its timeout; else :class:`~limiter.stores.FailoverStore` bounds it."""
        ...

    @property
    def cluster(self) -> bool:
        """Whether tenants spread over the shards of a Redis Cluster (which fails over)."""
        ...

    def slot(self, tenant: str) -> int:
        """The Redis Cluster hash slot of ``tenant``'s state."""
        ...

    async def slot_map(self) -> SlotMap | None:
        """Which node serves each slot as primary now (one call); None without a cluster."""
        ...

    async def reread_slots(self) -> None:
        """Route calls by the cluster's slot table as it is now (a failover was seen)."""
        ...


@runtime_checkable
class Fairness(Protocol):
    """Picks the next request among the tenants' offers and charges its tenant, atomically;
    the rules are :class:`limiter.fairness.VirtualCounters`' (shares by weight over all of a
    tenant's work, better bands first within a bounded lag).

    Async because the shared implementation does I/O; every method of a shared one may raise
    :class:`~limiter.stores.base.StoreUnavailable` (the caller then falls back to a
    :class:`MemoryFairness`).
    """

    async def activate(self, tenant: str) -> None:
        """``tenant``'s queue went from empty to non-empty (on this replica)."""
        ...

    async def choose(self, offers: Sequence[Offer]) -> QueuedRequest | None:
        """Pick one of ``offers`` (one per tenant, ``FairQueue.candidates``) and charge its
        tenant, in one step. None: none may go now (no offers, or none that is eligible and
        fits: wait for the next capacity event); nothing is charged then."""
        ...

    async def correct(self, tenant: str, tokens: int, weight: float, *, band0: bool = False
                      ) -> None:
        """A dispatched request of ``tenant`` finished: add the difference between its real
        price and the estimate it was charged (negative: a refund), in tokens — to its
        band-0 counter too when it was charged as band-0 work (``band0``). The counter
        never goes below 0; a tenant without a counter is left alone."""
        ...

    async def correct_many(self, corrections: Sequence[Correction]) -> None:
        """:meth:`correct` for several tenants in one step (one Redis call): the director
        prices the requests in flight again each scrape round, every tenant at once."""
        ...

    async def counters(self) -> dict[str, float]:
        """Tenant → virtual counter in tokens per unit of weight (``/debug/queues``)."""
        ...

    def forget(self, tenants: Iterable[str]) -> None:
        """Drop this process's counters of ``tenants``: removed from the configuration, with
        nothing queued or running. No I/O (shared counters expire by themselves)."""
        ...

    async def close(self) -> None:
        """Release resources (connections)."""
        ...
