"""Who goes next among a band's candidates: start-time fair queueing by tokens.

Each tenant has a **virtual counter** (its next start tag). Dispatching a request of ``cost``
tokens advances its tenant's counter by ``cost / weight``; among the candidates the smallest
counter goes next (ties: earliest ``enqueued_ms``, then candidate order). Over any busy
period each backlogged tenant therefore gets tokens in proportion to its weight, within one
request's cost ("busy: share by weight"). The system virtual time ``V`` is the start counter
of the most recently dispatched request. A tenant whose queue goes from empty to non-empty
is **activated**: ``counter = max(counter, V)``, so time spent idle is not banked as credit
("idle: borrow" carries no debt either way). A tenant with no counter at all starts at ``V``.

``V`` is deliberately *not* forced monotone (``max(V, start)``): with several replicas, one
replica dispatching a tenant that is ahead would drag ``V`` up, and every local activation
of a tenant that is globally backlogged but behind would then throw its credit away. In the
two-replica skewed-mix simulation (``tests/integration/test_redis_fairness.py``) the monotone
variant missed the 5:3:1 target by up to 4%, this one by 0.2%.

**Exact integers.** Counters are integers in ``SCALE`` (1000) units per token per unit of
weight: a request's *charge* is ``max(1, round(cost · 1000 / weight))``, computed once in
Python, so the memory and Redis implementations add the same integers and reach the same
decisions (Lua numbers are doubles, exact below 2^53). A charge is at most ``MAX_CHARGE``
(2^40); when ``V`` reaches ``REBASE_AT`` (2^50) every counter and ``V`` are shifted down by
half of it (floored at 0), which changes no comparison between active tenants, so counters
stay exact however long a pool stays busy.

This module is the pure core (:class:`VirtualCounters`, synchronous). The stores behind the
async :class:`limiter.stores.Fairness` protocol serve it: ``MemoryFairness`` (in-process, the
embedded default and the fallback when Redis fails) and ``RedisFairness`` (counters and ``V``
in Redis, so every replica serves a pool's tenants in **one global weighted order**).
:class:`VirtualCounters` also implements the **dynamic** order (``α·wait/SLA + β·progress +
γ·tier``, :meth:`limiter.fairqueue.FairQueue.dynamic_score`): pass ``score=`` or build it
with :meth:`VirtualCounters.for_queue`; the shared order always uses WFQ counters (a dynamic
score depends on each replica's local wait times, which a shared order cannot rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from limiter.fairqueue import FairQueue, QueuedRequest
from limiter.rates import require_int

__all__ = ["MAX_CHARGE", "REBASE_AT", "SCALE", "VirtualCounters", "charge_of", "pick_wfq"]

SCALE = 1000
"""Counter units per token per unit of weight."""
MAX_CHARGE = 2**40
"""The largest charge one request may add (cost · SCALE / weight), to keep Lua exact."""
REBASE_AT = 2**50
"""When ``V`` reaches this, counters and ``V`` shift down by ``REBASE_AT // 2``."""

Score = Callable[[QueuedRequest, int], float]


def charge_of(item: QueuedRequest) -> int:
    """The counter units dispatching ``item`` costs its tenant: ``cost · SCALE / weight``.

    At least 1, so even free requests take turns instead of letting one tenant run forever.
    """
    charge = max(1, round(item.cost * SCALE / item.weight))
    if charge > MAX_CHARGE:
        raise ValueError(
            f"request {item.id!r}: cost/weight {item.cost}/{item.weight} is too large for "
            f"exact virtual counters (at most {MAX_CHARGE // SCALE} tokens per unit weight)"
        )
    return charge


def pick_wfq(starts: Sequence[int], candidates: Sequence[QueuedRequest]) -> int:
    """WFQ's choice: the smallest start counter, then the earliest enqueued, then first."""
    return min(range(len(candidates)),
               key=lambda i: (starts[i], candidates[i].enqueued_ms, i))


def check_rebase(rebase_at: int) -> int:
    return require_int("rebase_at", rebase_at, 2 * MAX_CHARGE)


class VirtualCounters:
    """In-process virtual counters (see the module docstring for the rules): synchronous,
    no I/O. :class:`limiter.stores.MemoryFairness` serves them behind the async protocol.

    With ``score`` (the dynamic order), the highest score goes first (ties: WFQ order); the
    chosen tenant is still charged, so counters stay meaningful if the order is switched.
    """

    def __init__(self, *, score: Score | None = None, rebase_at: int = REBASE_AT) -> None:
        self._score = score
        self._rebase_at = check_rebase(rebase_at)
        self._counters: dict[str, int] = {}
        self._vtime = 0

    @classmethod
    def for_queue(cls, queue: FairQueue) -> VirtualCounters:
        """The selector ``queue.order`` asks for: WFQ, or ``queue.dynamic_score``."""
        return cls(score=queue.dynamic_score if queue.order == "dynamic" else None)

    @property
    def virtual_time(self) -> float:
        """``V`` in tokens per unit of weight."""
        return self._vtime / SCALE

    def activate(self, tenant: str) -> None:
        """``tenant``'s queue went from empty to non-empty: idle time is not banked."""
        self._counters[tenant] = max(self._counters.get(tenant, 0), self._vtime)

    def choose(self, candidates: list[QueuedRequest], now_ms: int) -> QueuedRequest | None:
        """Pick one of ``candidates`` (None if empty) and charge its tenant."""
        if not candidates:
            return None
        charges = [charge_of(item) for item in candidates]
        starts = [self._counters.get(item.tenant, self._vtime) for item in candidates]
        index = self._pick(starts, candidates, now_ms)
        self._charge(candidates[index].tenant, starts[index], charges[index])
        return candidates[index]

    def _pick(self, starts: list[int], candidates: list[QueuedRequest], now_ms: int) -> int:
        if self._score is None:
            return pick_wfq(starts, candidates)
        scores = [self._score(item, now_ms) for item in candidates]
        return min(range(len(candidates)),
                   key=lambda i: (-scores[i], starts[i], candidates[i].enqueued_ms, i))

    def _charge(self, tenant: str, start: int, charge: int) -> None:
        self._counters[tenant] = start + charge
        self._vtime = start
        if self._vtime >= self._rebase_at:
            shift = self._rebase_at // 2
            self._vtime -= shift
            self._counters = {t: max(0, c - shift) for t, c in self._counters.items()}

    def counters(self) -> dict[str, float]:
        """Tenant → virtual counter in tokens per unit of weight."""
        return {tenant: value / SCALE for tenant, value in self._counters.items()}
