"""The fair queue: requests held while GPU capacity is short, released in a defined order.

The order is **hierarchical**: tenants share the pool by weight over *all* their work, and
each tenant's own work goes in class order inside its share.

1. **Inside a tenant**: its best *effective* band first (0 = interactive, larger = lower),
   then FCFS ``(enqueued_ms, insertion order)``. :meth:`FairQueue.candidates` offers one
   request per tenant: that head, or — when it does not fit anywhere — the tenant's best
   head in a worse band that does (work conserving). A tenant's later request never
   overtakes an earlier one of the same band.
2. **Between tenants**: not decided here. A selector (:mod:`limiter.fairness`: virtual token
   counters, charged by usage) picks among the offered heads and the caller
   :meth:`~FairQueue.take`\\ s it. Keeping the choice outside lets several replicas share one
   global order (Redis). Bands still matter between tenants, within a bounded lag: see
   :func:`limiter.fairness.pick`.
3. **Aging**: a request waiting ``k × aging_ms`` of its band is promoted ``k`` bands (never
   above 0), so a tenant's own interactive stream cannot starve its batch work forever.

Sans-IO like the rest of :mod:`limiter`: no asyncio, every time is an injected ``now_ms``; the
async waiting and dispatch live in the caller, which also answers what this module returns
(evicted → 503, expired → timeout).

**Data layout.** One *lane* per ``(band, tenant)``: a deque kept sorted by
``(enqueued_ms, seq)``. Aging keeps a lane's order consistent with priority (an older
request is promoted at least as far as a younger one of the same band), so a lane's head is
its best request and its tail its worst. Hence ``candidates`` and eviction look at lane ends
only: O(lanes), not O(requests). Removal from the middle (disconnect, expiry) marks the slot
dead in O(1); dead slots are dropped when they reach a lane end or when a lane is compacted.
Deadlines sit in one heap with the same lazy deletion. Out-of-order ``enqueued_ms`` (rare:
the caller normally stamps ``now_ms``) is a sorted insert, O(lane).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from limiter.rates import require_int

__all__ = ["FairQueue", "Offer", "QueuedRequest"]

_COMPACT_MIN_DEAD = 32


@dataclass(eq=False)
class QueuedRequest:
    """One held request. Compared by identity: two requests with equal fields are still two.

    ``cost`` is the KV it needs, in tokens; ``price`` what dispatching it charges its
    tenant's fairness counter, in token units (prompt and output priced apart; None: the
    cost); ``weight`` is the tenant's weight, carried per request so the queue needs no
    tenant table; ``payload`` is the caller's (e.g. the future its stream awaits) and is
    never looked at.
    """

    id: str
    tenant: str
    band: int
    cost: int
    weight: float
    enqueued_ms: int
    deadline_ms: int
    payload: object = None
    price: int | None = None


@dataclass(slots=True)
class Offer:
    """A tenant's request offered to the selector: its effective band, and whether it fits
    (may run now)."""

    item: QueuedRequest
    band: int
    fits: bool


class _Slot:
    """A request's place in its lane; ``alive`` goes False on removal (lazy deletion)."""

    __slots__ = ("alive", "item", "seq")

    def __init__(self, item: QueuedRequest, seq: int) -> None:
        self.item = item
        self.seq = seq
        self.alive = True

    @property
    def key(self) -> tuple[int, int]:
        """FCFS order: enqueue time, then insertion order for equal times."""
        return (self.item.enqueued_ms, self.seq)


class _Lane:
    """One ``(band, tenant)``'s requests in FCFS order, dead slots trimmed from both ends."""

    __slots__ = ("dead", "slots")

    def __init__(self) -> None:
        self.slots: deque[_Slot] = deque()
        self.dead = 0

    def add(self, slot: _Slot) -> None:
        if not self.slots or self.slots[-1].key <= slot.key:
            self.slots.append(slot)
        else:
            self.slots.insert(bisect_right(self.slots, slot.key, key=_slot_key), slot)

    def head(self) -> _Slot:
        return self.slots[0]

    def tail(self) -> _Slot:
        return self.slots[-1]

    def live(self) -> int:
        return len(self.slots) - self.dead

    def drop(self, slot: _Slot) -> None:
        """``slot`` was just marked dead: trim the ends, compact if mostly dead."""
        self.dead += 1
        while self.slots and not self.slots[0].alive:
            self.slots.popleft()
            self.dead -= 1
        while self.slots and not self.slots[-1].alive:
            self.slots.pop()
            self.dead -= 1
        if self.dead > _COMPACT_MIN_DEAD and self.dead > self.live():
            self.slots = deque(s for s in self.slots if s.alive)
            self.dead = 0


def _slot_key(slot: _Slot) -> tuple[int, int]:
    return slot.key


def _check_item(item: QueuedRequest) -> None:
    """Reject what would silently break ordering or charging later."""
    require_int("band", item.band, 0)
    require_int("cost", item.cost, 0)
    if item.price is not None:
        require_int("price", item.price, 0)
    require_int("enqueued_ms", item.enqueued_ms, -(2**62))
    require_int("deadline_ms", item.deadline_ms, -(2**62))
    if not isinstance(item.weight, int | float) or not math.isfinite(item.weight):
        raise TypeError(f"weight must be a finite number, got {item.weight!r}")
    if item.weight <= 0:
        raise ValueError(f"weight must be > 0, got {item.weight}")


class FairQueue:
    """Bounded multi-band queue; see the module docstring for the order it implements.

    ``aging_ms=None`` disables aging; ``band_aging_ms`` overrides it per band.
    """

    def __init__(
        self,
        *,
        max_size: int = 1024,
        aging_ms: int | None = 5000,
        band_aging_ms: dict[int, int | None] | None = None,
    ) -> None:
        self.max_size = require_int("max_size", max_size, 1)
        self.aging_ms = None if aging_ms is None else require_int("aging_ms", aging_ms, 1)
        # per-band overrides (None: that band never ages): under sustained load, batch work
        # promoted after a few seconds would crowd the interactive band
        self.band_aging_ms = {
            band: None if ms is None else require_int(f"band_aging_ms[{band}]", ms, 1)
            for band, ms in (band_aging_ms or {}).items()
        }
        self._slots: dict[str, _Slot] = {}
        self._lanes: dict[tuple[int, str], _Lane] = {}
        self._depth: Counter[tuple[int, str]] = Counter()
        self._tenants: Counter[str] = Counter()
        self._deadlines: list[tuple[int, int, _Slot]] = []
        self._seq = 0

    # --- size and introspection ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._slots

    def get(self, item_id: str) -> QueuedRequest | None:
        """The queued request with this id, if any (no side effect)."""
        slot = self._slots.get(item_id)
        return None if slot is None else slot.item

    def items(self) -> list[QueuedRequest]:
        """Every queued request, oldest first (for inspection, e.g. ``/debug/queues``)."""
        return [slot.item for slot in sorted(self._slots.values(), key=_slot_key)]

    def depth(self) -> dict[tuple[int, str], int]:
        """``(band, tenant) → queued count``, by the band requests were queued in (the class
        the client asked for; aging is a property of time, see :meth:`effective_band`)."""
        return dict(self._depth)

    def queued(self, tenant: str) -> int:
        """How many requests ``tenant`` has queued. The caller checks ``queued(t) == 0``
        before a push to know when to call ``Fairness.activate(t)``."""
        return self._tenants.get(tenant, 0)

    # --- priority ------------------------------------------------------------------------

    def aging_for(self, band: int) -> int | None:
        """How long a request queued in ``band`` waits per promotion (None: never)."""
        return self.band_aging_ms.get(band, self.aging_ms)

    def effective_band(self, item: QueuedRequest, now_ms: int) -> int:
        """``item.band`` less one per whole aging period of its band waited, never below 0."""
        waited = now_ms - item.enqueued_ms
        aging = self.aging_for(item.band)
        if aging is None or item.band == 0 or waited <= 0:
            return item.band
        return max(0, item.band - waited // aging)

    # --- push and eviction ---------------------------------------------------------------

    def push(self, item: QueuedRequest, now_ms: int) -> list[QueuedRequest]:
        """Queue ``item``; returns what had to go to keep the bound (for the caller's 503).

        When full, the least important request goes: the largest effective band, then the
        latest enqueued. That may be ``item`` itself (then it is not queued and ``[item]``
        comes back), so a flood of offline work can never push out interactive requests.
        A request whose deadline has already passed is queued anyway: the caller's next
        :meth:`expire` answers it, so every request leaves by exactly one door.
        """
        _check_item(item)
        if item.id in self._slots:
            raise ValueError(f"request {item.id!r} is already queued")
        slot = _Slot(item, self._seq)
        self._seq += 1
        if len(self._slots) < self.max_size:
            self._insert(slot)
            return []
        victim = self._worst(now_ms)
        if self._rank(slot, now_ms) >= self._rank(victim, now_ms):
            return [item]
        self._unlink(victim)
        self._insert(slot)
        return [victim.item]

    def _rank(self, slot: _Slot, now_ms: int) -> tuple[int, int, int]:
        """Eviction rank: larger is less important (worse band, then newer)."""
        return (self.effective_band(slot.item, now_ms), *slot.key)

    def _worst(self, now_ms: int) -> _Slot:
        """The least important queued request: the worst of the lane tails (a lane's tail
        has both its worst effective band and its latest enqueue time)."""
        return max((lane.tail() for lane in self._lanes.values()),
                   key=lambda slot: self._rank(slot, now_ms))

    def _insert(self, slot: _Slot) -> None:
        item = slot.item
        self._slots[item.id] = slot
        self._lanes.setdefault((item.band, item.tenant), _Lane()).add(slot)
        self._depth[(item.band, item.tenant)] += 1
        self._tenants[item.tenant] += 1
        heapq.heappush(self._deadlines, (item.deadline_ms, slot.seq, slot))

    # --- removal -------------------------------------------------------------------------

    def take(self, item_id: str) -> QueuedRequest:
        """Remove the request the selector chose (KeyError if it is not queued)."""
        return self._unlink(self._slots[item_id])

    def remove(self, item_id: str) -> QueuedRequest | None:
        """Drop a request whose client went away; nobody is charged for it."""
        slot = self._slots.get(item_id)
        return None if slot is None else self._unlink(slot)

    def expire(self, now_ms: int) -> list[QueuedRequest]:
        """Remove and return every request with ``deadline_ms <= now_ms`` (earliest first).

        Call it before :meth:`candidates` on every event, so nothing is dispatched after its
        deadline."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            slot = heapq.heappop(self._deadlines)[2]
            if slot.alive:
                out.append(self._unlink(slot))
        return out

    def _unlink(self, slot: _Slot) -> QueuedRequest:
        item = slot.item
        slot.alive = False
        del self._slots[item.id]
        key = (item.band, item.tenant)
        lane = self._lanes[key]
        lane.drop(slot)
        if not lane.slots:
            del self._lanes[key]
        _decrement(self._depth, key)
        _decrement(self._tenants, item.tenant)
        if len(self._deadlines) > 2 * len(self._slots) + 64:
            self._deadlines = [entry for entry in self._deadlines if entry[2].alive]
            heapq.heapify(self._deadlines)
        return item

    # --- dispatch ------------------------------------------------------------------------

    def candidates(
        self, now_ms: int, fits: Callable[[QueuedRequest], bool] = lambda r: True
    ) -> list[Offer]:
        """One offer per tenant, in FCFS order: its best head that ``fits`` (e.g. "some
        endpoint has room for it"), else its best head marked as not fitting.

        A tenant's heads are its lanes' heads ranked by ``(effective band, FCFS)``. So a
        tenant's batch request is offered when its interactive head fits nowhere, but its
        own later request never overtakes an earlier one of the same band. Heads that do not
        fit are offered too: the selector may have to wait for them rather than let tenants
        with smaller requests run ahead of their share.
        """
        offered = []
        for heads in self._heads_by_tenant(now_ms).values():
            offer = next((Offer(slot.item, band, True) for band, slot in heads
                          if fits(slot.item)), None)
            if offer is None:
                band, slot = heads[0]
                offer = Offer(slot.item, band, False)
            offered.append((self._slots[offer.item.id].key, offer))
        return [offer for _, offer in sorted(offered, key=lambda entry: entry[0])]

    def best_band(self, now_ms: int) -> int | None:
        """The best effective band of any queued request (None: the queue is empty)."""
        return min((self.effective_band(lane.head().item, now_ms)
                    for lane in self._lanes.values()), default=None)

    def _heads_by_tenant(self, now_ms: int) -> dict[str, list[tuple[int, _Slot]]]:
        """``tenant → its lane heads as (effective band, slot)``, best first."""
        tenants: dict[str, list[tuple[int, _Slot]]] = {}
        for (_band, tenant), lane in self._lanes.items():
            head = lane.head()
            tenants.setdefault(tenant, []).append((self.effective_band(head.item, now_ms), head))
        for heads in tenants.values():
            heads.sort(key=lambda entry: (entry[0], entry[1].key))
        return tenants

    # --- timers --------------------------------------------------------------------------

    def next_deadline_ms(self) -> int | None:
        """The earliest deadline still queued (when the caller must next :meth:`expire`)."""
        while self._deadlines and not self._deadlines[0][2].alive:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def next_aging_ms(self, now_ms: int) -> int | None:
        """The first time after ``now_ms`` that a lane head is promoted a band, or None.

        Only lane heads matter: they are the only requests :meth:`candidates` offers, so this
        is the next time aging alone can change what it returns.
        """
        times = [
            self._next_promotion(lane.head().item, now_ms)
            for lane in self._lanes.values()
            if self.aging_for(lane.head().item.band) is not None
            and self.effective_band(lane.head().item, now_ms) > 0
        ]
        return min(times, default=None)

    def _next_promotion(self, item: QueuedRequest, now_ms: int) -> int:
        aging = self.aging_for(item.band)
        assert aging is not None
        steps = max(0, now_ms - item.enqueued_ms) // aging
        return item.enqueued_ms + (steps + 1) * aging


def _decrement(counter: Counter, key: object) -> None:
    """Decrement and forget zeros, so ``depth()`` lists only non-empty entries."""
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
