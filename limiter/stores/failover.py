"""A shared (Redis) store behind a timeout budget, a circuit breaker and a failure policy.

Admission must never hang on Redis: each call gets ``timeout_ms`` (kept by the Redis store
itself where it can: ``times_its_calls``; by an ``asyncio.timeout`` here otherwise); failures
open the breaker, and while it is open the configured policy decides — ``fail_open`` admits
unlimited, ``fail_closed`` answers 503, ``local`` enforces this replica's share of every
limit in memory (its concurrency share counts every lease the replica holds, those in
Redis included). Leases remember which store admitted them, so each is released where it
was taken.

Nothing a failed call took stays in Redis. A call that timed out may still run there later
(a paused Redis runs what was queued); so the store owes Redis a *cancel* for every
admission whose answer it never got — unless the fallback then serves it, in which case the
cancel is owed at its release — and a *release* for every release that failed. A background
repair loop sends what is owed until Redis answers (every ``REPAIR_PAUSE_S``); the cancel
refunds the admission if it ran and tombstones its id if it has not (see
:mod:`limiter.stores.redis_scripts`), so the order in which they reach Redis does not matter.
What a request served without Redis used (the fallback's, or one whose admission there is
cancelled) is owed to Redis's token quotas the same way, marked charged there once sent.

Concurrency stays exact when Redis restarts empty: after any failure the repair loop
re-asserts in Redis every lease this store holds — the ones Redis had, and those the
fallback admitted meanwhile, which from then on count (and are released) in Redis. Each
admission also tells Redis how many leases this store holds for the tenant, wherever they
were admitted; if Redis has fewer it answers :class:`LeasesLost`, the leases are re-asserted
at once and the admission is tried again, so nothing is admitted on top of leases Redis
does not know. (With several replicas Redis's count includes the others' leases, so this
check can miss a loss; the repair loop's re-assert then closes the gap within
``REPAIR_PAUSE_S`` of Redis answering. A replica that saw no call fail starts it when Redis
ends one of its connections, as a restart does — an idle one's next call would reconnect
without an error — or, where Redis lost its data with no connection ended, at the next
renewal, which re-asserts too.)

On a Redis Cluster a failover can lose writes the same way: the replica promoted may lack
the last ones its primary acknowledged (replication is asynchronous) — leases, releases,
cancels — and a process that made no call to that shard meanwhile saw no failure. So the
store watches the cluster's slot map (one ``CLUSTER NODES`` every ``WATCH_PAUSE_S``, every
``WATCH_SUSPECT_PAUSE_S`` while a primary is flagged failing): where a slot's primary
changed, it re-asserts its leases of the tenants there and sends their releases, cancels and
usage charges of the last ``RECENT_MS`` again (each is idempotent: a lease Redis no longer
has is not released, refunded or charged twice). Nothing is logged without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from limiter.breaker import Breakers, BreakerState, CircuitBreaker, Transition
from limiter.clock import monotonic_ms
from limiter.decision import TenantPolicy
from limiter.fairness import DEFAULT_LAG
from limiter.fairqueue import Offer, QueuedRequest
from limiter.outcome import NO_REMAINING, Admit, Cost, Reason, Reject, wait_reject
from limiter.share import scale_policy
from limiter.stores.base import Correction, LeasesLost, SharedStore, StoreUnavailable
from limiter.stores.memory import MemoryFairness, MemoryStore
from limiter.stores.slots import SlotMap

if TYPE_CHECKING:
    from limiter.stores.fairness import RedisFairness

log = logging.getLogger(__name__)

REPAIR_PAUSE_S = 0.05
"""How often the repair loop tries Redis again while it owes it something."""
REPAIR_TIMEOUT_S = 0.5
"""Budget of one repair round (off the request path, so more than a call's)."""
BREAKER_IDLE_MS = 10_000
"""A cluster node's breaker no call has asked for this long is forgotten (see
``FailoverStore.breakers_open``)."""
LOCAL_POLICIES = 16_384
"""Scaled policies cached at most (one per distinct policy: per-tenant limits of a config
that renames its tenants every day would add new ones for good)."""
CLOSE_REPAIR_S = 2.0
"""How long closing keeps sending what is owed to Redis (a blip at shutdown: a SIGTERM while
Redis is paused or restarting must not drop releases, cancels and usage charges)."""
UNDO_FOR_S = 600
"""How long a fair-queue choice that timed out keeps being undone in Redis (the counters'
default TTL: after that Redis has forgotten them anyway)."""
REPAIR_BATCH = 64
"""Repair calls sent at once (each takes a pooled connection)."""
WATCH_PAUSE_S = 1.0
"""How often a cluster's slot map is read (one small call), to see failovers."""
WATCH_SUSPECT_PAUSE_S = 0.1
"""… and while the node asked flags a primary as failing (or none answers): a promotion
is then seen this soon, before most other processes' clients read the new slot table."""
REREAD_MS = 5_000
"""After a failover is seen, a repair round that fails re-reads the slot table first (at
most every ``WATCH_SUSPECT_PAUSE_S``) for this long: the nodes learn of a promotion one
after the other, and the client may have read the table from one that had not yet."""
RECENT_MS = 20_000
"""How long a confirmed release, cancel or usage charge is kept, to send again should its
tenant's primary change (the promoted replica may lack it): longer than a failure takes to
be suspected with Redis's default ``cluster-node-timeout`` (15 s); none is dropped while
a primary is suspected."""
RECENT_MAX = 65_536
"""… and at most this many (the oldest go first)."""
_FAILURES = (StoreUnavailable, TimeoutError, OSError)
_REQUEST_LIMITS = (Reason.REQUESTS, Reason.WINDOW, Reason.SHAPING)
"""Refusals the headers-phase peek may repeat until their retry time: they count requests."""


class FailurePolicy(StrEnum):
    FAIL_OPEN = "fail_open"
    FAIL_CLOSED = "fail_closed"
    LOCAL = "local"


@dataclasses.dataclass
class _Held:
    """A lease this store handed out: where it counts, and whether Redis may have it too
    (its admission timed out there: it must then be cancelled, not released)."""

    tenant: str
    policy: TenantPolicy
    place: str  # "primary" | "local" | "open"
    unsure: bool = False
    # a re-assert of it got no answer, so it may still land in Redis: its release goes
    # there too, wherever it counts now
    reasserted: bool = False
    # served by the failure policy (Redis did not admit it): what it uses is owed to the
    # quotas apart (idempotent), even once a re-assert made it count in Redis
    fallback: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _Owed:
    """A release (with the tokens used), a cancel, or the quota usage of an admission
    Redis never saw, that Redis has not confirmed yet."""

    tenant: str
    policy: TenantPolicy
    cancel: bool
    used_tokens: int | None = None
    usage: bool = False
    served: bool = True  # a release: False gives every charge back (the request never ran)


def _vaguer(owed: _Owed, known: _Owed) -> bool:
    """``owed`` and ``known`` are both the lease's release, and only ``known`` carries the
    tokens used."""
    return (not owed.cancel and not owed.usage and not known.usage
            and owed.used_tokens is None and known.used_tokens is not None)


USAGE_SUFFIX = ":usage"
"""Appended to a lease id: the key under which its quota usage is owed (and marked charged
in Redis), apart from a release or cancel owed for the lease itself."""


class FailoverStore:
    """A :class:`LimiterStore` that degrades as configured instead of failing requests."""

    def __init__(
        self,
        primary: SharedStore,
        *,
        policy: FailurePolicy,
        replicas: int = 1,
        timeout_s: float = 0.02,
        breaker: CircuitBreaker | None = None,
        on_transition: Callable[[Transition], None] | None = None,
        on_fallback: Callable[[str], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        clock_ms: Callable[[], int] = monotonic_ms,
    ):
        self.primary = primary
        self.policy = policy
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()  # the single Redis's (domain "")
        # failure domain (a cluster node; "" for a single Redis) → its breaker: a shard
        # down sends only its own tenants to the failure policy
        self._breakers = Breakers(self.breaker)
        self.local = MemoryStore()
        self.clock_ms = clock_ms
        self._on_transition = on_transition or (lambda _t: None)
        self._on_fallback = on_fallback or (lambda _p: None)
        self._on_error = on_error or (lambda _e: None)  # every failed call (metrics)
        self._local_policies: dict[TenantPolicy, TenantPolicy] = {}
        self._held: dict[str, _Held] = {}  # lease id → where it counts
        self._counts: Counter[str] = Counter()  # tenant → leases held (Redis needs as many)
        self._owed: dict[str, _Owed] = {}  # lease id → what Redis still has to be told
        self._reassert = False  # a call failed: Redis may have lost (or never had) leases
        self._moved: set[str] = set()  # tenants whose slot's primary changed: re-assert
        self._repairer: asyncio.Task[None] | None = None
        # a cluster's failovers (see the module docstring): the slot map watch, started by
        # the first call, and what Redis confirmed lately, to send again after one
        self._cluster = primary.cluster
        # the primary's calls fail by themselves past the timeout: no timer per call here
        self._timed = primary.times_its_calls
        self._watch_due = self._cluster
        self._watcher: asyncio.Task[None] | None = None
        self._suspect = False  # a primary is flagged failing: keep every recent entry
        self._reread_until = self._reread_at = 0  # (ms) see REREAD_MS
        self._recent: deque[tuple[int, str, _Owed]] = deque(maxlen=RECENT_MAX)
        self._blocked: dict[str, tuple[int, Reject]] = {}  # tenant → (until ms, rejection)
        self._closing = False
        primary.on_connection_lost(self._connection_lost)

    # -- the LimiterStore protocol ---------------------------------------------------------

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        """The headers-phase peek: no Redis round trip unless Redis refused this tenant
        lately and its retry time has not passed; then Redis is asked (one round trip, as
        an admission would cost), so that every refused client gets its own retry slot
        (``limiter.herd``), across replicas. Without an answer, the last refusal stands."""
        if self._breaker(tenant).state != "closed" and self.policy is FailurePolicy.LOCAL:
            self._breakers.asked(self.primary.domain(tenant), self.clock_ms())  # (the gauge)
            return await self.local.check_requests(tenant, self._local(policy))
        blocked = self._blocked.get(tenant)
        if blocked is None:
            return None
        until, reject = blocked
        wait = until - self.clock_ms()
        if wait <= 0:
            del self._blocked[tenant]
            return None
        ok, result, _error = await self._try(
            tenant, lambda: self.primary.check_requests(tenant, policy))
        if not ok:
            return dataclasses.replace(reject, retry_after_ms=wait)
        if result is None:
            self._blocked.pop(tenant, None)  # (another request may have got there first)
        return result

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str, *, held: int = 0,
        unsent: bool = False,
    ) -> Admit | Reject:
        """``held`` is ignored: this store counts its own leases for Redis."""

        def call() -> Awaitable[Admit | Reject]:
            return self.primary.admit(tenant, policy, cost, lease_id, held=self._counts[tenant],
                                      unsent=unsent)

        try:
            ok, result, error = await self._try(tenant, call)
            if isinstance(error, LeasesLost):  # Redis restarted: put ours back, then retry
                with contextlib.suppress(*_FAILURES):
                    async with asyncio.timeout(self.timeout_s):
                        await self._reassert_leases()
                ok, result, error = await self._try(tenant, call)
        except asyncio.CancelledError:
            self._owe(lease_id, _Owed(tenant, policy, cancel=True))
            raise
        if ok:
            if isinstance(result, Admit):
                self._hold(lease_id, _Held(tenant, policy, "primary"))
            elif result.reason in _REQUEST_LIMITS and result.retry_after_ms:
                self._blocked[tenant] = (self.clock_ms() + result.retry_after_ms, result)
            return result
        unsure = error is not None and not isinstance(error, LeasesLost)
        decision = None
        try:
            decision = await self._fallback(tenant, policy, cost, lease_id)
        finally:
            if isinstance(decision, Admit):
                self._hold(lease_id, _Held(tenant, policy, self._place(), unsure,
                                           fallback=True))
            elif unsure:  # refused or 503: what Redis may have admitted is undone there
                self._owe(lease_id, _Owed(tenant, policy, cancel=True))
        return decision

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> bool:
        held = self._let_go(tenant, policy, lease_id, used_tokens, served)
        if held is None:
            return False
        if held.place == "primary" and not held.unsure:
            owed = _Owed(tenant, policy, cancel=False, used_tokens=used_tokens, served=served)
            ok, result, _error = await self._try(
                tenant, lambda: self.primary.release(tenant, policy, lease_id, used_tokens,
                                                     served=served)
            )
            if not ok:
                self._owe(lease_id, owed)
            elif self._cluster:
                self._confirmed(lease_id, owed)
            return bool(result) if ok else True
        return True

    def release_soon(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> None:
        """:meth:`release` without waiting for Redis's answer (the request path's: no task
        per release): a release Redis does not confirm is owed, as when :meth:`release`
        fails, and the breaker learns of it all the same."""
        held = self._let_go(tenant, policy, lease_id, used_tokens, served)
        if held is None or held.place != "primary" or held.unsure:
            return
        owed = functools.partial(_Owed, tenant, policy, cancel=False, used_tokens=used_tokens,
                                 served=served)
        allowed = self._allow(tenant)
        if allowed is None:
            self._owe(lease_id, owed())
            return
        sent = self.primary.queue_release(tenant, policy, lease_id, used_tokens, served=served)
        sent.add_done_callback(functools.partial(self._release_answered, allowed, lease_id,
                                                 owed))

    def _release_answered(self, asked: tuple[str, CircuitBreaker], lease_id: str,
                          owed: Callable[[], _Owed], answer: asyncio.Future[Any]) -> None:
        """``owed`` makes the release's record: kept only after a cluster's confirmation or
        a failure (none is made for a single Redis's usual answer)."""
        domain, breaker = asked
        error = (StoreUnavailable("redis release was cancelled") if answer.cancelled()
                 else answer.exception())
        if error is None:
            self._report(domain, breaker.success())
            if self._cluster:
                self._confirmed(lease_id, owed())
            return
        if not isinstance(error, _FAILURES):  # (a surprise: logged, and owed all the same)
            log.error("shared store release failed", exc_info=error)
        self._failed(domain, breaker, error)
        self._owe(lease_id, owed())

    def _let_go(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None,
        served: bool,
    ) -> _Held | None:
        """Forget ``lease_id`` here (None: it was not held), release it where the fallback
        served it, and owe Redis what it must still learn of it; the caller releases a
        lease that counts in Redis (``place`` primary, not ``unsure``)."""
        held = self._drop(lease_id)
        if held is None:
            return None
        if held.place == "local":
            self.local.release_soon(tenant, self._local(policy), lease_id, used_tokens,
                                    served=served)
        if held.fallback and used_tokens and (
                policy.daily_token_quota or policy.monthly_token_quota):
            # served while Redis was unreachable (or admitted there without an answer, which
            # the cancel below undoes): what it used still counts toward the quotas (tokens
            # a day or month, which nothing local enforces) once Redis answers. Charged
            # once by its id, also for a lease a re-assert put in Redis since: Redis cannot
            # tell such a lease from one a late re-assert put back after its release
            self._owe(lease_id + USAGE_SUFFIX,
                      _Owed(tenant, policy, cancel=False, used_tokens=used_tokens, usage=True))
        if held.unsure:  # whatever reached Redis for it is undone there
            self._owe(lease_id, _Owed(tenant, policy, cancel=True))
        elif held.reasserted and held.place != "primary":  # (see _unanswered)
            self._owe(lease_id, _Owed(tenant, policy, cancel=False))
        return held

    def mark_sent(self, tenant: str, lease_id: str) -> None:
        """Tell Redis, if it admitted the lease and answers now (the breaker closed), that
        the request was dispatched; else nothing (see ``RedisStore.mark_sent``)."""
        held = self._held.get(lease_id)
        if (held is not None and held.place == "primary" and not held.unsure
                and self._breaker(tenant).state == BreakerState.CLOSED):
            self.primary.mark_sent(tenant, lease_id)

    async def renew(self, tenant: str, lease_ids: list[str], *, reassert: bool = False) -> None:
        """Renew this store's leases in Redis, putting back any Redis lost (also where no
        call failed here: another replica saw the restart); one released meanwhile is
        released again, since the renewal may have landed after its release."""
        mine = {lease: self._held[lease] for lease in lease_ids
                if self._where(lease) == "primary"}
        if mine:
            ok, _result, _error = await self._try(
                tenant, lambda: self.primary.renew(tenant, list(mine), reassert=True)
            )
            if ok:
                for lease_id, held in mine.items():
                    await self._adopt(lease_id, held)

    async def cancel(self, tenant: str, policy: TenantPolicy, lease_id: str) -> None:
        held = self._drop(lease_id)
        if held is not None and held.place == "local":
            await self.local.cancel(tenant, self._local(policy), lease_id)
        if held is not None and (held.place == "primary" or held.unsure):
            self._owe(lease_id, _Owed(tenant, policy, cancel=True))

    async def in_flight(self, tenant: str) -> int:
        ok, result, _error = await self._try(tenant, lambda: self.primary.in_flight(tenant))
        local = await self.local.in_flight(tenant)
        return (result if ok else 0) + local

    async def usage(self, tenant: str, policy: TenantPolicy) -> dict[str, Any]:
        ok, result, _error = await self._try(tenant,
                                             lambda: self.primary.usage(tenant, policy))
        if ok:
            return {**result, "store": "redis"}
        local = await self.local.usage(tenant, self._local(policy))
        return {**local, "store": f"unavailable ({self.policy.value})"}

    async def close(self) -> None:
        """Wait for the answers to the releases sent (``release_soon``: one that failed is
        owed then), send what is still owed — every batch, retried for up to
        ``CLOSE_REPAIR_S`` (logged if some is left), then close the primary."""
        self._watch_due = False
        self._closing = True  # (its connections end now: nothing to put back)
        await self.primary.settle_releases()
        for task in (self._watcher, self._repairer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_REPAIR_S
        while self._owed and loop.time() < deadline:  # every batch, until Redis confirms
            try:
                async with asyncio.timeout(min(REPAIR_TIMEOUT_S, deadline - loop.time())):
                    await self._settle()
            except _FAILURES as error:
                log.debug("shared store repair at close failed, will retry: %r", error)
                await asyncio.sleep(REPAIR_PAUSE_S)
            except Exception:  # (an unexpected reply: what is owed must still go)
                log.exception("shared store repair at close failed, will retry")
                await asyncio.sleep(REPAIR_PAUSE_S)
        if self._owed:
            kinds = Counter("cancel" if o.cancel else "usage" if o.usage else "release"
                            for o in self._owed.values())
            log.warning("shared store closed with %s not confirmed by Redis after %g s: "
                        "their leases expire within the lease TTL; usage not charged",
                        ", ".join(f"{n} {kind}(s)" for kind, n in sorted(kinds.items())),
                        CLOSE_REPAIR_S)
        await self.primary.close()

    def forget(self, tenants: Iterable[str]) -> list[str]:
        """Forget ``tenants`` (removed from the configuration) but those with a lease held
        here, or a release, cancel or usage still owed to Redis (asked again later); the
        fallback's limits of theirs go as the in-memory store's go."""
        owing = {owed.tenant for owed in self._owed.values()}
        ready = [t for t in tenants if not self._counts.get(t) and t not in owing]
        done = set(self.local.forget(ready)) & set(self.primary.forget(ready))
        for tenant in done:
            self._blocked.pop(tenant, None)
        return [tenant for tenant in ready if tenant in done]

    def idle(self) -> bool:
        """Nothing held and nothing owed to Redis (tests, and a drained replica)."""
        return not self._held and not self._owed and not self._reassert and not self._moved

    def debug(self) -> dict[str, Any]:
        return {"held": {k: v.place for k, v in self._held.items()},
                "owed": {k: "cancel" if v.cancel else "release" for k, v in self._owed.items()},
                "reassert": self._reassert}

    # -- fallback --------------------------------------------------------------------------

    async def _fallback(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str
    ) -> Admit | Reject:
        self._on_fallback(self.policy.value)
        if self.policy is FailurePolicy.FAIL_CLOSED:
            raise StoreUnavailable("shared limits unavailable and failure_policy is fail_closed")
        if self.policy is FailurePolicy.FAIL_OPEN:
            return Admit(lease_id=lease_id, cost=cost, remaining=NO_REMAINING)
        local = self._local(policy)
        if local.max_concurrency is not None and self._counts[tenant] >= local.max_concurrency:
            # this replica's share counts every lease it holds, Redis's ones included
            waits = [(Reason.CONCURRENCY, local.concurrency_retry_ms)]
            return wait_reject(waits, NO_REMAINING)
        return await self.local.admit(tenant, local, cost, lease_id)

    def _place(self) -> str:
        return "open" if self.policy is FailurePolicy.FAIL_OPEN else "local"

    def _where(self, lease_id: str) -> str | None:
        held = self._held.get(lease_id)
        return None if held is None else held.place

    def _hold(self, lease_id: str, held: _Held) -> None:
        self._held[lease_id] = held
        self._counts[held.tenant] += 1

    def _drop(self, lease_id: str) -> _Held | None:
        held = self._held.pop(lease_id, None)
        if held is not None:
            self._counts[held.tenant] -= 1
            if not self._counts[held.tenant]:
                del self._counts[held.tenant]
        return held

    # -- repairs: what failed calls left to tell Redis -------------------------------------

    def _owe(self, lease_id: str, owed: _Owed) -> None:
        """Owe Redis ``owed`` for ``lease_id``, one record per key: a cancel covers all, and
        a release that knows no tokens (sent again after a re-assert) leaves in place one
        that knows them, which releases the lease as well; sent instead, it settled the
        reservation as if the request had used all of it."""
        known = self._owed.get(lease_id)
        if known is None or not (known.cancel or _vaguer(owed, known)):
            self._owed[lease_id] = owed
        self._need_repair()

    def _need_repair(self) -> None:
        if self._repairer is None or self._repairer.done():
            self._repairer = asyncio.get_running_loop().create_task(self._repair())

    async def _repair(self) -> None:
        """Until Redis has been told everything: send what is owed, re-assert leases."""
        while self._owed or self._reassert or self._moved:
            try:
                async with asyncio.timeout(REPAIR_TIMEOUT_S):
                    await self._settle()
                    if self._reassert:
                        await self._reassert_leases()
                    elif self._moved:
                        await self._reassert_leases(set(self._moved))
            except _FAILURES as error:
                log.debug("shared store repair failed, will retry: %r", error)
                now = self.clock_ms()
                if (now < self._reread_until
                        and now - self._reread_at >= WATCH_SUSPECT_PAUSE_S * 1000):
                    await self._reread()  # (it may have gone to the old primary)
            except Exception:  # (an unexpected reply or error: what is owed must still go)
                log.exception("shared store repair failed, will retry")
            if self._owed or self._reassert or self._moved:
                await asyncio.sleep(REPAIR_PAUSE_S)

    async def _settle(self) -> None:
        """Send every owed release and cancel (concurrently); each confirmed one is done."""
        async def send(lease_id: str, owed: _Owed) -> None:
            if owed.cancel:
                await self.primary.cancel(owed.tenant, owed.policy, lease_id)
            elif owed.usage:
                await self.primary.charge_usage(owed.tenant, owed.policy, lease_id,
                                                owed.used_tokens or 0)
            else:
                await self.primary.release(owed.tenant, owed.policy, lease_id, owed.used_tokens,
                                           served=owed.served)
            if self._owed.get(lease_id) is owed:
                del self._owed[lease_id]
            if self._cluster:
                self._confirmed(lease_id, owed)

        batch = list(self._owed.items())[:REPAIR_BATCH]
        for key, owed in batch:  # round robin: if these fail (a shard down), the next round
            del self._owed[key]  # sends what is owed to the others first
            self._owed[key] = owed
        results = await asyncio.gather(*(send(k, v) for k, v in batch), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _reassert_leases(self, tenants: set[str] | None = None) -> None:
        """Put every lease this store holds (of ``tenants`` only, if given: those whose
        slot moved to another primary) into Redis; from then on each counts there. A
        tenant's leases are adopted as soon as its own call succeeds: one shard down must
        not leave the others' leases counted in memory (and released only there) while
        Redis holds them too. A round cut short (its caller's budget ran out) marks the
        leases whose renewals were under way as unanswered: Redis may run them yet."""
        if tenants is None:
            self._reassert = False
            self._moved.clear()  # (all of them)
            held = dict(self._held)
        else:
            self._moved -= tenants
            held = {k: v for k, v in self._held.items() if v.tenant in tenants}
        by_tenant: dict[str, list[str]] = {}
        for lease_id, lease in held.items():
            by_tenant.setdefault(lease.tenant, []).append(lease_id)
        groups = list(by_tenant.items())
        failed: BaseException | None = None
        sent: list[str] = []  # leases whose renewals are under way
        try:
            for start in range(0, len(groups), REPAIR_BATCH):  # one call per tenant
                batch = groups[start:start + REPAIR_BATCH]
                sent = [lease_id for _tenant, ids in batch for lease_id in ids]
                results = await asyncio.gather(
                    *(self.primary.renew(tenant, ids, reassert=True) for tenant, ids in batch),
                    return_exceptions=True)
                sent = []
                for (_tenant, ids), result in zip(batch, results, strict=True):
                    if isinstance(result, BaseException):  # its shard is down: next round
                        failed = failed or result
                        for lease_id in ids:
                            self._unanswered(lease_id, held[lease_id])
                        continue
                    for lease_id in ids:  # in Redis now, whatever another shard does
                        await self._adopt(lease_id, held[lease_id])
            if failed is not None:
                raise failed
        except BaseException:
            for lease_id in sent:  # cut short: each renewal may still run in Redis
                self._unanswered(lease_id, held[lease_id])
            if tenants is None:
                self._reassert = True
            else:
                self._moved |= tenants
            self._need_repair()  # (also when the admission path's own re-assert timed out)
            raise

    def _unanswered(self, lease_id: str, held: _Held) -> None:
        """A re-assert of ``lease_id`` got no answer: it may still run in Redis (a slow or
        paused Redis runs what it was sent) and put the lease back after its release, which
        then held its slot until the lease TTL. One released meanwhile is released there
        again; one still held is released there too when it ends."""
        if self._held.get(lease_id) is held:
            held.reasserted = True
        else:
            self._owe(lease_id, _Owed(held.tenant, held.policy, cancel=held.unsure))

    async def _adopt(self, lease_id: str, held: _Held) -> None:
        """A re-asserted lease counts in Redis now; one released meanwhile is released there
        again, since the re-assert may have landed after its release."""
        if self._held.get(lease_id) is not held:
            self._owe(lease_id, _Owed(held.tenant, held.policy, cancel=held.unsure))
            return
        if held.place == "local":
            await self.local.release(held.tenant, self._local(held.policy), lease_id, 0)
        held.place = "primary"

    # -- a cluster's failovers: what the promoted replica may lack -------------------------

    def _confirmed(self, key: str, owed: _Owed) -> None:
        """Redis (a cluster) confirmed ``owed``: kept ``RECENT_MS``, to send again should the
        tenant's primary change before it reached the replica."""
        now = self.clock_ms()
        recent = self._recent
        if not self._suspect:
            while recent and now - recent[0][0] > RECENT_MS:
                recent.popleft()
        recent.append((now, key, owed))

    def _start_watch(self) -> None:
        self._watch_due = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Read the cluster's slot map now and then (see the module docstring); where a
        slot's primary changed, put back what its new primary may lack."""
        seen: SlotMap | None = None
        while True:
            now: SlotMap | None = None
            try:
                async with asyncio.timeout(REPAIR_TIMEOUT_S):
                    now = await self.primary.slot_map()
                if now is not None and seen is not None and now.ranges != seen.ranges:
                    await self._failed_over(seen, now)
            except _FAILURES as error:
                log.debug("Redis Cluster slot map unavailable, will retry: %r", error)
            except Exception:  # (an unexpected reply: the watch must go on)
                log.exception("Redis Cluster failover watch failed, will retry")
            if now is not None:
                seen = now
            self._suspect = now is None or now.suspect
            await asyncio.sleep(WATCH_SUSPECT_PAUSE_S if self._suspect else WATCH_PAUSE_S)

    async def _failed_over(self, old: SlotMap, new: SlotMap) -> None:
        """Slots changed primary (a failover, or slots migrated): re-assert this store's
        leases of their tenants, and send their recent releases and cancels again, along
        the new slot table."""
        self._reread_until = self.clock_ms() + REREAD_MS
        await self._reread()
        slot = self.primary.slot
        tenants = {held.tenant for held in self._held.values()}
        tenants.update(owed.tenant for _at, _key, owed in self._recent)
        moved = {t for t in tenants if old.primary(slot(t)) != new.primary(slot(t))}
        if not moved:
            return
        holding = {tenant for tenant in moved if self._counts.get(tenant)}
        self._moved |= holding
        again = [(key, owed) for _at, key, owed in self._recent if owed.tenant in moved]
        for key, owed in again:
            self._owe(key, owed)
        log.info("Redis Cluster slots moved to another primary: re-asserting the leases of "
                 "%d tenants, sending %d recent releases and cancels again",
                 len(holding), len(again))
        self._need_repair()

    async def _reread(self) -> None:
        """Route calls by the cluster's slot table as it is now."""
        self._reread_at = self.clock_ms()
        try:
            async with asyncio.timeout(REPAIR_TIMEOUT_S):
                await self.primary.reread_slots()
        except _FAILURES as error:  # (the client's own refresh follows a failed call)
            log.debug("Redis Cluster slot table not reread: %r", error)
        except Exception:  # (best effort, on the cluster client's internals: never fatal)
            log.exception("Redis Cluster slot table not reread")

    # -- plumbing --------------------------------------------------------------------------

    async def _try(
        self, tenant: str, call: Callable[[], Awaitable[Any]]
    ) -> tuple[bool, Any, BaseException | None]:
        """(True, result, None) from the primary, or (False, None, why): ``why`` is None
        when the breaker of ``tenant``'s domain skipped the call (it never reached Redis)."""
        allowed = self._allow(tenant)
        if allowed is None:
            return False, None, None
        domain, breaker = allowed
        try:
            if self._timed:
                result = await call()
            else:
                async with asyncio.timeout(self.timeout_s):
                    result = await call()
        except LeasesLost as lost:  # an answer, not a failure
            self._report(domain, breaker.success())
            return False, None, lost
        except _FAILURES as error:
            self._failed(domain, breaker, error)
            return False, None, error
        self._report(domain, breaker.success())
        return True, result, None

    def _allow(self, tenant: str) -> tuple[str, CircuitBreaker] | None:
        """The domain and breaker of ``tenant`` for a call to the primary; None when the
        breaker skips the call."""
        if self._watch_due:
            self._start_watch()
        domain = self.primary.domain(tenant)
        breaker, allowed, transition = self._breakers.allow(domain, self.clock_ms())
        self._report(domain, transition)
        return (domain, breaker) if allowed else None

    def _connection_lost(self) -> None:
        """Redis ended a connection: it may have restarted empty, and no call of this store
        need fail for that (the next one reconnects), so the leases held here are put back
        now — within ``REPAIR_PAUSE_S`` of Redis answering — rather than at their next
        renewal, while every other replica could be admitted on top of them."""
        if self._held and not self._closing:
            self._reassert = True
            self._need_repair()

    def _failed(self, domain: str, breaker: CircuitBreaker, error: BaseException) -> None:
        """A call to the primary failed: counted, and Redis may have lost leases."""
        self._on_error(error)
        self._report(domain, breaker.failure(self.clock_ms()), error)
        self._reassert = True
        self._need_repair()

    def _breaker(self, tenant: str, domain: str | None = None) -> CircuitBreaker:
        """The breaker of ``tenant``'s failure domain (a cluster node), made on first use
        with the single Redis's settings."""
        return self._breakers.get(self.primary.domain(tenant) if domain is None else domain)

    def breakers_open(self) -> int:
        """Failure domains whose breaker is open or half-open and that a call asked within
        ``BREAKER_IDLE_MS`` (``kvgate_store_breaker_open``, read at each scrape). A node no
        call has asked for that long is forgotten: after a failover its tenants' slots
        moved to another node, and its breaker, open when it went, would stay open with
        nothing left to probe it. A single Redis's breaker is kept but not counted: only a
        call moves it, and on a replica that got no request after Redis came back it
        stayed open, the failure policy deciding nothing."""
        return self._breakers.open_count(self.clock_ms(), BREAKER_IDLE_MS)

    def _report(self, domain: str, transition: Transition | None,
                error: BaseException | None = None) -> None:
        if transition is None:
            return
        why = f": {error!r}" if error else ""
        where = f" for Redis node {domain}" if domain else ""
        level = logging.INFO if transition.new == "closed" else logging.WARNING
        log.log(level, "shared store breaker%s %s → %s (failure policy %s)%s",
                where, transition.old, transition.new, self.policy.value, why)
        self._on_transition(transition)

    def _local(self, policy: TenantPolicy) -> TenantPolicy:
        scaled = self._local_policies.get(policy)
        if scaled is None:
            if len(self._local_policies) >= LOCAL_POLICIES:
                self._local_policies.clear()
            scaled = self._local_policies[policy] = scale_policy(policy, self.replicas)
        return scaled


def _log_fairness_breaker(transition: Transition, error: BaseException | None = None) -> None:
    """One line per change, as the store's breaker logs its own: an operator sees when the
    fair order went local and when it came back."""
    level = logging.INFO if transition.new == "closed" else logging.WARNING
    log.log(level, "fair queue breaker %s → %s (each replica orders by its own counters "
            "while it is open)%s", transition.old, transition.new,
            f": {error!r}" if error else "")


class FailoverFairness:
    """Fair-queue counters in Redis (one global weighted order across replicas), falling back
    to this process's own counters while Redis is unreachable, so dispatch never stalls.

    Behind a circuit breaker of its own (the store's settings): while Redis is failing, a
    dispatch decision would otherwise wait out ``timeout_s`` first, every time. A choice
    that timed out may still run in Redis later (a paused Redis runs what was queued) and
    charge a tenant the fallback did not serve: it is undone there once Redis answers, and
    the tenant served instead charged (:meth:`RedisFairness.undo`), retried every
    ``REPAIR_PAUSE_S`` for up to ``UNDO_FOR_S``."""

    def __init__(self, shared: RedisFairness, timeout_s: float, lag_tokens: int = DEFAULT_LAG,
                 breaker: CircuitBreaker | None = None,
                 clock_ms: Callable[[], int] = monotonic_ms,
                 on_transition: Callable[[Transition], None] | None = None,
                 on_fallback: Callable[[], None] | None = None):
        """``on_transition`` hears each change of the breaker's state and ``on_fallback``
        each choice made by this process's own counters (the metrics)."""
        self.shared = shared
        self.local = MemoryFairness(lag_tokens=lag_tokens)
        self.timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self.clock_ms = clock_ms
        self.on_transition = on_transition
        self.on_fallback = on_fallback
        self._undos: set[asyncio.Task[None]] = set()
        self._asked_ms: int | None = None  # when a call last asked the breaker

    def ordering_locally(self) -> bool:
        """``kvgate_queue_breaker_open``, read at each scrape: the breaker is open or
        half-open and a queue call asked it within ``BREAKER_IDLE_MS``. Only a call moves
        the breaker, and a pool queues only while saturated: counted by its state alone, an
        outage during one burst kept the gauge at 1 (and KvgateFairOrderLocal firing) with
        Redis back and nothing queued, until the pool saturated again."""
        asked = self._asked_ms
        return (self.breaker.state != "closed" and asked is not None
                and self.clock_ms() - asked <= BREAKER_IDLE_MS)

    async def _try(self, call: Callable[[], Awaitable[Any]]) -> tuple[bool, Any, bool]:
        """(answered, result, asked): ``asked`` is False when the breaker skipped the call
        (it never reached Redis)."""
        self._asked_ms = now_ms = self.clock_ms()
        allowed, transition = self.breaker.allow(now_ms)
        self._changed(transition)
        if not allowed:
            return False, None, False
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await call()
        except (StoreUnavailable, TimeoutError) as error:
            self._changed(self.breaker.failure(self.clock_ms()), error)
            return False, None, True
        self._changed(self.breaker.success())
        return True, result, True

    def _changed(self, transition: Transition | None, error: BaseException | None = None
                 ) -> None:
        if transition is not None:
            _log_fairness_breaker(transition, error)
            if self.on_transition is not None:
                self.on_transition(transition)

    async def activate(self, tenant: str) -> None:
        await self.local.activate(tenant)
        await self._try(lambda: self.shared.activate(tenant))

    async def choose(self, offers: Sequence[Offer]) -> QueuedRequest | None:
        if len(offers) == 1 and offers[0].fits and self._queue_choice(offers[0]):
            return offers[0].item
        decision = uuid.uuid4().hex
        answered, chosen, asked = await self._try(lambda: self.shared.choose(offers, decision))
        if answered:
            return chosen
        if self.on_fallback is not None:
            self.on_fallback()
        chosen = await self.local.choose(offers)
        if asked:  # it may run in Redis yet
            self._undo_soon(decision, chosen)
        return chosen

    def _queue_choice(self, offer: Offer) -> bool:
        """One offer that fits goes without waiting for Redis (``RedisFairness.queue_choice``);
        Redis's answer, when it comes, tells the breaker as a waited call's would (a send
        counted as answered kept the breaker closed, and the order on Redis, while Redis
        hung). False unless the breaker is closed (a probe is a call that waits), or
        without an open pipe: the caller asks as for several offers."""
        if self.breaker.state is not BreakerState.CLOSED:
            return False
        sent = self.shared.queue_choice(offer)
        if sent is None:
            return False
        self._asked_ms = self.clock_ms()
        sent.add_done_callback(self._choice_answered)
        return True

    def _choice_answered(self, answer: asyncio.Future[Any]) -> None:
        error = (StoreUnavailable("redis choice was cancelled") if answer.cancelled()
                 else answer.exception())
        if error is None:
            self._changed(self.breaker.success())
        elif isinstance(error, (StoreUnavailable, TimeoutError)) or self.shared.is_failure(error):
            self._changed(self.breaker.failure(self.clock_ms()), error)
        else:
            log.error("fair queue: a queued choice failed", exc_info=error)

    def _undo_soon(self, decision: str, chosen: QueuedRequest | None) -> None:
        task = asyncio.create_task(self._undo(decision, chosen))
        self._undos.add(task)
        task.add_done_callback(self._undos.discard)

    async def _undo(self, decision: str, chosen: QueuedRequest | None) -> None:
        """Sent until Redis answers (each try idempotent), for up to ``UNDO_FOR_S``."""
        until = self.clock_ms() + UNDO_FOR_S * 1000
        while True:
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                async with asyncio.timeout(REPAIR_TIMEOUT_S):
                    await self.shared.undo(decision, chosen)
                return
            if self.clock_ms() >= until:
                log.warning("fair queue: a choice Redis did not answer in time was not undone "
                            "there (its charge stays)")
                return
            await asyncio.sleep(REPAIR_PAUSE_S)

    async def correct(self, tenant: str, tokens: int, weight: float, *, band0: bool = False
                      ) -> None:
        await self.correct_many([(tenant, tokens, weight, band0)])

    async def correct_many(self, corrections: Sequence[Correction]) -> None:
        """Best effort: a correction lost to an outage only delays the share's convergence."""
        await self.local.correct_many(corrections)
        await self._try(lambda: self.shared.correct_many(corrections))

    async def counters(self) -> dict[str, float]:
        answered, counters, _ = await self._try(self.shared.counters)
        return counters if answered else await self.local.counters()

    def forget(self, tenants: Iterable[str]) -> None:
        names = list(tenants)
        self.local.forget(names)
        self.shared.forget(names)

    async def close(self) -> None:
        """Undos still owed get up to ``CLOSE_REPAIR_S`` (as the store's releases do)."""
        if self._undos:
            _, left = await asyncio.wait(set(self._undos), timeout=CLOSE_REPAIR_S)
            for task in left:
                task.cancel()
            if left:
                log.warning("fair queue: %d choice(s) Redis did not answer were not undone "
                            "there before closing (their charges stay)", len(left))
        await self.shared.close()
