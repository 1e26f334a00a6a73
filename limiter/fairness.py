"""Who goes next among the queue's offers: virtual token counters, charged by usage.

Each tenant has a **virtual counter** (its next start tag). Dispatching a request advances its
tenant's counter by its price over the tenant's weight; the least-served tenant (smallest
counter) is the reference every other is measured against (ties: earliest ``enqueued_ms``,
then offer order). Over any busy period each backlogged tenant therefore gets priced tokens
in proportion to its weight, within a bounded lag ("busy: share by weight"). The system
virtual time ``V`` is the smallest start among the offers of the latest dispatch. A tenant
whose queue goes from empty to non-empty is **activated**: ``counter = max(counter, V)``, so
time spent idle is not banked as credit ("idle: borrow" carries no debt either way). A tenant
with no counter at all starts at ``V``.

``V`` is deliberately *not* forced monotone: with several replicas, one replica's offers may
all be ahead of another's, and a monotone ``V`` would make every local activation of a tenant
that is globally behind throw its credit away.

**Exact integers.** Counters are integers in ``SCALE`` (1000) units per token per unit of
weight: a request's *charge* is ``max(1, round(cost · 1000 / weight))``, computed once in
Python, so the memory and Redis implementations add the same integers and reach the same
decisions (Lua numbers are doubles, exact below 2^53). A charge is at most ``MAX_CHARGE``
(2^40); when ``V`` reaches ``REBASE_AT`` (2^50) every counter and ``V`` are shifted down by
half of it (floored at 0), which changes no comparison between active tenants, so counters
stay exact however long a pool stays busy. (A counter lower than the shift is floored: that
changes a comparison only for a tenant activated but left out of the offers while ``V`` moved
past it by more than the shift in one dispatch — with several replicas, 2^49 units, ~5.6·10^11
tokens per unit of weight; the rebase property test activates a tenant when it comes back.)

**Charged by usage (VTC).** A request's price is its prompt and output tokens at separate
prices, estimated when it is dispatched (the caller's estimate: kvgate's director uses the
share of ``max_tokens`` the tenant's answers have lately used) and corrected by
:meth:`VirtualCounters.correct` once it finishes and its real output is known; the counter
may then go down (an answer shorter than estimated is refunded) — but a refund never takes
it more than ``lag`` below ``V``: an estimate that was too high let others go ahead while
the request ran, and a credit banked for that afterwards would let the tenant's batch work
run ahead of every other tenant's interactive work until it was spent (with the floor and
the director's estimate, a tenant sending ``max_tokens`` 30,000 for 200–1,000-token answers no
longer lengthens another tenant's interactive P99: ``bench.inflated_max_tokens``). Only a
tenant whose estimates run far above its usage loses by the floor (there: ~7% of its
share).

**Bands between tenants, within a bounded lag** (:func:`pick`). Pure WFQ over all of a
tenant's work would make a tenant's interactive request wait behind other tenants' batch
work whenever its counter is ahead — even by one small request. So among the candidates,
every tenant whose start counter is within ``lag`` (tokens per unit of weight) of the
smallest is *eligible*, and the eligible one with the best band goes first (ties: smallest
counter). A tenant's band-0 counter counts only its band-0 work (corrected, like the whole
counter, when a request charged to it ends): a tenant whose interactive
traffic fits in its share keeps it flowing whatever its batch work, and one whose interactive
traffic alone exceeds its share is held to it. A band-0 counter starts (and is lifted to) a
lag below the least-served start, so no tenant gets further ahead of the least-served
backlogged tenant than about three lags plus three requests: the share error over any busy
period is bounded, and inside that bound interactive work goes first, whoever sends it. The
band-0 counter never exceeds the tenant's whole counter, so the least-served tenant is always
eligible: when everything fits, someone goes.

**A tenant waiting for room** (none of its offers fits: the KV is full) holds the others'
batch work back at its own counter, not a lag past it, so that the KV that frees goes to its
head and it is not starved by larger requests. It holds their interactive work back only a
lag past its *finish* — its counter plus its head's charge, where its counter will be once
the head goes (:func:`floors`): interactive requests are short, and held a lag past its
start they waited for as long as the head waited for long answers to end.

This module is the pure core (:class:`VirtualCounters`, synchronous). The stores behind the
async :class:`limiter.stores.Fairness` protocol serve it: ``MemoryFairness`` (in-process, the
embedded default and the fallback when Redis fails) and ``RedisFairness`` (counters and ``V``
in Redis, so every replica serves a pool's tenants in **one global weighted order**).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from limiter.fairqueue import Offer, QueuedRequest
from limiter.rates import require_int

__all__ = ["DEFAULT_LAG", "MAX_CHARGE", "MIN_WEIGHT", "REBASE_AT", "SCALE", "VirtualCounters",
           "charge_of", "floors", "max_price", "pick", "units"]

SCALE = 1000
"""Counter units per token per unit of weight."""
MAX_CHARGE = 2**40
"""The largest charge one request may add (cost · SCALE / weight), to keep Lua exact."""
REBASE_AT = 2**50
"""When ``V`` reaches this, counters and ``V`` shift down by ``REBASE_AT // 2``."""
DEFAULT_LAG = 2048
"""Tokens per unit of weight a tenant may run ahead and still go first with a better band."""


def units(tokens: int, weight: float) -> int:
    """``tokens`` (may be negative) in counter units for a tenant of ``weight``."""
    return round(tokens * SCALE / weight)


MIN_WEIGHT = 1e-6
"""The smallest weight a tenant may have: one whose :func:`max_price` is a token at least
(a thousand, in fact), so its requests are never charged less than other tenants'."""


def max_price(weight: float) -> int:
    """The largest price in tokens one request of a tenant of ``weight`` may be charged:
    :func:`charge_of` refuses more than ``MAX_CHARGE`` units. A caller pricing requests caps
    them at this (a huge request, a tiny weight), rather than have the choice raise."""
    return int(MAX_CHARGE * weight) // SCALE


def price_of(item: QueuedRequest) -> int:
    """The tokens the fair order charges for ``item``: its price, or its KV cost without one."""
    return item.cost if item.price is None else item.price


def charge_of(item: QueuedRequest) -> int:
    """The counter units dispatching ``item`` costs its tenant: ``price · SCALE / weight``.

    At least 1, so even free requests take turns instead of letting one tenant run forever.
    """
    tokens = price_of(item)
    charge = max(1, units(tokens, item.weight))
    if charge > MAX_CHARGE:
        raise ValueError(
            f"request {item.id!r}: price/weight {tokens}/{item.weight} is too large for "
            f"exact virtual counters (at most {MAX_CHARGE // SCALE} tokens per unit weight)"
        )
    return charge


def pick(starts: Sequence[int], firsts: Sequence[int | None], offers: Sequence[Offer],
         lag: int, charges: Sequence[int]) -> int | None:
    """The index to dispatch, or None to wait.

    ``starts``: each offer's tenant counter (all its work); ``firsts``: its best-band counter
    (band-0 work only; None: none yet); ``charges``: each offer's :func:`charge_of`. An
    offer is eligible when its tenant's counter — its band-0 counter for a band-0 offer (its
    interactive work alone is within its share), its whole counter otherwise — is at most
    its band's floor (:func:`floors`: a lag past the smallest start, moved for tenants
    waiting for room). Among eligible offers that fit: the best band, then
    the smallest start, the earliest enqueued, the first.
    """
    batch_floor, band0_floor = floors(starts, offers, lag, charges)
    eligible = [i for i, offer in enumerate(offers)
                if offer.fits and _level(starts[i], firsts[i], offer.band)
                <= (batch_floor if offer.band else band0_floor)]
    if not eligible:
        return None
    return min(eligible, key=lambda i: (offers[i].band, starts[i], offers[i].item.enqueued_ms,
                                        i))


def floors(starts: Sequence[int], offers: Sequence[Offer], lag: int,
           charges: Sequence[int]) -> tuple[int, int]:
    """The highest counter at which batch work, and band-0 work, may go now: ``lag`` past the
    smallest start — but for a tenant *waiting for room* (none of its offers fits):

    - batch work may not go past its start: the KV that frees goes to its head rather than
      to others' larger requests running up to a lag past it (in the policy matrix's short
      contention windows the worst weighted-share error was 4.7% with that lag, 3.9%
      without: ``bench.policy_sim``);
    - band-0 work may go up to a lag past its *finish*, its start plus its cheapest offer's
      charge: where its counter will be once its head goes, so that work gets nothing it
      would not get a moment later. Held at its start, the others' interactive requests
      waited for as long as the head waited for long answers to end (seconds, beside a
      tenant with 3,000-4,000-token answers: ``bench.inflated_max_tokens``).
    """
    fitting = {offer.item.tenant for offer in offers if offer.fits}
    batch: list[int] = []
    band0: list[int] = []
    for start, offer, charge in zip(starts, offers, charges, strict=True):
        if offer.item.tenant in fitting:
            batch.append(start + lag)
            band0.append(start + lag)
        else:
            batch.append(start)
            band0.append(start + lag + charge)
    return min(batch), min(band0)


def _level(start: int, first: int | None, band: int) -> int:
    if band:
        return start
    return -(2**62) if first is None else first


def check_rebase(rebase_at: int) -> int:
    return require_int("rebase_at", rebase_at, 2 * MAX_CHARGE)


class VirtualCounters:
    """In-process virtual counters (see the module docstring for the rules): synchronous,
    no I/O. :class:`limiter.stores.MemoryFairness` serves them behind the async protocol.

    ``lag_tokens``: how far ahead (tokens per unit of weight) a tenant may be and still go
    first with a better band (0: pure WFQ over all of a tenant's work).
    """

    def __init__(self, *, lag_tokens: int = DEFAULT_LAG, rebase_at: int = REBASE_AT) -> None:
        self._lag = require_int("lag_tokens", lag_tokens, 0) * SCALE
        self._rebase_at = check_rebase(rebase_at)
        self._counters: dict[str, int] = {}  # all of a tenant's work
        self._firsts: dict[str, int] = {}  # its band-0 work only
        self._vtime = 0

    @property
    def virtual_time(self) -> float:
        """``V`` in tokens per unit of weight."""
        return self._vtime / SCALE

    def activate(self, tenant: str) -> None:
        """``tenant``'s queue went from empty to non-empty: idle time is not banked."""
        self._counters[tenant] = max(self._counters.get(tenant, 0), self._vtime)

    def choose(self, offers: Sequence[Offer]) -> QueuedRequest | None:
        """Pick one of ``offers`` and charge its tenant; None when none may go now."""
        if not offers:
            return None
        starts = [self._counters.get(offer.item.tenant, self._vtime) for offer in offers]
        firsts = [self._firsts.get(offer.item.tenant) for offer in offers]
        charges = [charge_of(offer.item) for offer in offers]
        index = pick(starts, firsts, offers, self._lag, charges)
        if index is None:
            return None
        offer = offers[index]
        self._charge(offer, starts[index], min(starts), charges[index])
        return offer.item

    def correct(self, tenant: str, tokens: int, weight: float, *, band0: bool = False
                ) -> None:
        """A dispatched request finished: add the difference between its real price and the
        estimate it was charged (negative: a refund, which stops at ``lag`` below ``V``, or
        where the counter already is if that is lower), in tokens. ``band0``: it was charged
        as band-0 work, so the tenant's band-0 counter moves by the same difference —
        otherwise a tenant whose interactive answers ran shorter than estimated had its
        interactive work held as if they had not (``bench.policy_sim --asks ceiling``)."""
        if tenant in self._counters and tokens:
            delta = units(tokens, weight)
            counter = self._counters[tenant] = max(0, self._moved(self._counters[tenant],
                                                                  delta))
            first = self._firsts.get(tenant)
            if first is not None:
                if band0:
                    first = self._moved(first, delta)
                self._firsts[tenant] = min(first, counter)  # band-0 work is part of all work

    def _moved(self, counter: int, delta: int) -> int:
        """``counter`` + ``delta``; a refund stops at ``lag`` below ``V`` (or where the
        counter already is, if that is lower)."""
        if delta >= 0:
            return counter + delta
        return max(counter + delta, min(counter, self._vtime - self._lag))

    def _charge(self, offer: Offer, start: int, floor: int, charge: int) -> None:
        tenant = offer.item.tenant
        self._counters[tenant] = start + charge
        if not offer.band:  # a burst of band-0 work is bounded by 2 × lag past the floor
            first = self._firsts.get(tenant, floor - self._lag)
            self._firsts[tenant] = max(first, floor - self._lag) + charge
        self._vtime = floor
        if self._vtime >= self._rebase_at:
            shift = self._rebase_at // 2
            self._vtime -= shift
            self._counters = {t: max(0, c - shift) for t, c in self._counters.items()}
            self._firsts = {t: c - shift for t, c in self._firsts.items()}

    def forget(self, tenants: Iterable[str]) -> None:
        """Drop the counters of tenants no longer configured, with nothing queued or
        running: configured again, such a tenant starts at ``V`` as a new one does (a debt
        it still had is forgiven — what Redis's TTL does to a tenant unseen for a while)."""
        for tenant in tenants:
            self._counters.pop(tenant, None)
            self._firsts.pop(tenant, None)

    def counters(self) -> dict[str, float]:
        """Tenant → virtual counter in tokens per unit of weight."""
        return {tenant: value / SCALE for tenant, value in self._counters.items()}
