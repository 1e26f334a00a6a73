"""Flow control: a pool's fair queue, and the task that dispatches from it.

While a pool is saturated, requests wait here (their ext_proc streams stay open) instead of
being rejected. Capacity events — a request completing, a fresh scrape — wake the
dispatcher, which hands freed room to the next request: tenants by weighted share of their
priced tokens, each tenant's own work in class order, and interactive work first between
tenants within a bounded lag (``limiter.fairqueue``, ``limiter.fairness``: local, or shared
through Redis). A request still queued at its class deadline gets 503 (pool saturated) or 429
(tenant over its share) with Retry-After; a client that goes away leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.config import Config
from extproc.datalayer.endpoints import EndpointStore
from extproc.metrics import Metrics
from extproc.scheduler import Placement, PoolScheduler
from extproc.tasks import cancel
from limiter.fairness import price_of
from limiter.fairqueue import FairQueue, Offer, QueuedRequest
from limiter.outcome import Reason, Reject, refuse
from limiter.stores import Fairness
from limiter.stores.base import Correction

log = logging.getLogger(__name__)


def _price_now(offers: list[Offer]) -> None:
    """Price each offer as of now, before the order charges the chosen one: the output its
    tenant's answers are expected to use is learned as answers end, and a request waits
    minutes under contention. Priced when it was queued, a request charged an estimate
    long out of date — one learned from a pool's first answers (short answers end first)
    or none at all — and the weighted shares drifted by up to ~12% (virtual time, clients
    asking one fixed ``max_tokens``: ``bench.policy_sim --asks ceiling``)."""
    for offer in offers:
        waiter: Waiter = offer.item.payload  # type: ignore[assignment]
        if waiter.price_now is not None:
            offer.item.price = waiter.price_now()


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


def fair_queue(config: Config) -> FairQueue:
    """A pool's queue as configured: its size, and each class's aging period by band."""
    return FairQueue(max_size=config.queue.max_size, aging_ms=None,
                     band_aging_ms={band: _ms(config.aging_s(name))
                                    for band, name in enumerate(config.class_order)})


@dataclass
class Waiter:
    """What the dispatcher needs to place a queued request, and where to send the answer."""

    future: asyncio.Future[Placement | Reject]
    lease_id: str
    request_class: str
    queued_for: Reason  # what queued it: decides 503 or 429 on expiry
    prompt_tokens: int | None = None  # to prefill; None: its whole cost is counted
    streamed: bool = True  # its first token will be seen before its end
    # what dispatching it charges its tenant now (None: the price it was queued with)
    price_now: Callable[[], int] | None = None
    # charged as band-0 work when dispatched (aging may have moved it there): its corrections
    # move its tenant's band-0 counter too
    charged_band0: bool = False


class FlowController:
    def __init__(
        self,
        scheduler: PoolScheduler,
        fairness: Fairness,
        config: Config,
        endpoints: EndpointStore,
        metrics: Metrics,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.scheduler = scheduler
        self.fairness = fairness
        self.endpoints = endpoints
        self.metrics = metrics
        self.rng = rng
        self.clock = clock  # monotonic seconds, the scheduler's clock; the queue counts ms
        self.pool = scheduler.config.name
        self.queue = fair_queue(config)
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._published: set[tuple[str, str]] = set()  # (band, tenant) in queue_depth now
        self._fit_nowhere: list[tuple[QueuedRequest, Reject]] = []  # found by _fits

    def clock_ms(self) -> int:
        return int(self.clock() * 1000)

    # -- the request side ------------------------------------------------------------------

    def must_queue(self) -> bool:
        """While anything waits, a new request joins the queue too: the dispatcher, not the
        order of arrival, decides who goes next (at once, when it is the one to go)."""
        return bool(len(self.queue))

    async def wait(self, item: QueuedRequest, waiter: Waiter) -> Placement | Reject:
        """Queue the request until the dispatcher places it (its KV is then reserved under
        ``waiter.lease_id``) or its deadline passes. Cancellation removes it."""
        item.payload = waiter
        if not self.queue.queued(item.tenant):
            await self.fairness.activate(item.tenant)
        for evicted in self.queue.push(item, self.clock_ms()):
            self._answer(evicted, self._refusal(evicted, "queue full"), "evicted")
        self._gauge()
        self.kick()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if self.queue.remove(item.id) is not None:
                self._counted(item, waiter, "cancelled")  # the waits clients gave up on too
                self._gauge()
            self.scheduler.release(waiter.lease_id, self.clock(), completed=False)
            raise

    async def correct(self, tenant: str, tokens: int, weight: float, *, band0: bool = False
                      ) -> None:
        """A request dispatched from this queue finished: charge its tenant the difference
        between its real price and the estimate (negative: a refund); ``band0``: it was
        dispatched as band-0 work (``Waiter.charged_band0``)."""
        await self.correct_many([(tenant, tokens, weight, band0)])

    async def correct_many(self, corrections: list[Correction]) -> None:
        """:meth:`correct` for several tenants in one step (one Redis call); a correction of
        zero tokens is dropped here, so no store call is made for nothing."""
        corrections = [c for c in corrections if c[1]]
        if corrections:
            try:
                await self.fairness.correct_many(corrections)
            except Exception:  # a lost correction only slows a share's convergence
                log.warning("pool %s: fairness correction failed", self.pool, exc_info=True)

    def kick(self) -> None:
        """A capacity event: completion, fresh scrape, released reservation. With nothing
        queued there is nothing to dispatch: the dispatcher stays asleep (hot path)."""
        if len(self.queue):
            self._kick.set()

    # -- the dispatcher --------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kvgate-flow-{self.pool}")

    async def stop(self) -> None:
        await cancel(self._task)
        self.refuse_all("shutting down")

    def refuse_all(self, why: str) -> int:
        """Answer every queued request with its refusal (a shutdown: at the end of the
        grace, while their streams are still open to carry it); returns how many."""
        items = list(self.queue.items())
        for item in items:
            self.queue.remove(item.id)
            self._answer(item, self._refusal(item, why), "shutdown")
        if items:
            self._gauge()
        return len(items)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # (not wait_for: see datalayer/nvml.py)
                async with asyncio.timeout(self._sleep_s()):
                    await self._kick.wait()
            self._kick.clear()
            try:
                self._expire()
                await self._dispatch()
            except Exception:  # the dispatcher must outlive any one failure
                log.exception("pool %s: dispatch failed", self.pool)
            self._gauge()

    def _sleep_s(self) -> float | None:
        now = self.clock_ms()
        times = [t for t in (self.queue.next_deadline_ms(), self.queue.next_aging_ms(now)) if t]
        return max(0.0, (min(times) - now) / 1000) if times else None

    def _expire(self) -> None:
        for item in self.queue.expire(self.clock_ms()):
            self._answer(item, self._refusal(item, "expired"), "expired")

    async def _dispatch(self) -> None:
        while len(self.queue):
            now = self.clock_ms()
            offers = self.queue.candidates(now, fits=self._fits)
            if self._refuse_fit_nowhere():
                continue  # the heads behind them are offered afresh
            if not any(offer.fits for offer in offers):
                return  # nothing can run: no need to ask the (maybe shared) order
            _price_now(offers)
            chosen = await self.fairness.choose(offers)
            if chosen is None:
                return
            band = self.queue.effective_band(chosen, now)  # as offered: the band charged
            if chosen.id not in self.queue:  # its client left while the choice was made
                await self._refund(chosen, band)
                continue
            placed = self._place(chosen, band)
            if isinstance(placed, Reject):  # capacity went while the choice was made
                await self._refund(chosen, band)  # charged again when it is chosen again
                return
            self.queue.take(chosen.id)
            waiter: Waiter = chosen.payload  # type: ignore[assignment]
            waiter.charged_band0 = band == 0
            prompt = chosen.cost if waiter.prompt_tokens is None else waiter.prompt_tokens
            self.scheduler.reserve(waiter.lease_id, chosen.tenant, placed.endpoints[0],
                                   chosen.cost, self.clock(), band=band,
                                   prompt_tokens=prompt, streamed=waiter.streamed)
            self._answer(chosen, placed, "dispatched")

    async def _refund(self, item: QueuedRequest, band: int) -> None:
        """Give back the charge ``choose`` made for a request that will not run now."""
        await self.correct(item.tenant, -price_of(item), item.weight, band0=band == 0)

    def _fits(self, item: QueuedRequest) -> bool:
        placed = self._place(item, self.queue.effective_band(item, self.clock_ms()))
        if isinstance(placed, Reject) and placed.reason == Reason.KV_TOO_LARGE:
            self._fit_nowhere.append((item, placed))
        return isinstance(placed, Placement)

    def _refuse_fit_nowhere(self) -> bool:
        """Answer the queued requests no endpoint the pool has now would take even empty,
        as at admission (400 ``kv_exceeds_capacity``): the pool shrank while they waited (a
        larger endpoint left DNS). Left queued, each waited for its deadline, and its tenant,
        behind with a head that fits nowhere, held every other tenant back meanwhile. Not
        charged in the fair order yet (that happens when chosen): nothing to refund."""
        found, self._fit_nowhere = self._fit_nowhere, []
        for item, refusal in found:
            if self.queue.remove(item.id) is not None:
                self._answer(item, refusal, "too_large")
        if found:
            self._gauge()
        return bool(found)

    def _place(self, item: QueuedRequest, band: int) -> Placement | Reject:
        """Placed as the band the queue ranks it in (aging included): everything ranked
        together sees the same gates, so a tenant's aged batch request cannot hold back
        its own interactive one on a gate that only batch work meets."""
        waiter: Waiter = item.payload  # type: ignore[assignment]
        return self.scheduler.place(
            item.tenant, item.cost, self.endpoints.snapshot(), self.clock(), self.rng,
            band=band, waited_s=max(0, self.clock_ms() - item.enqueued_ms) / 1000,
            prompt_tokens=waiter.prompt_tokens,
        )

    # -- answers and visibility ------------------------------------------------------------

    def _refusal(self, item: QueuedRequest, why: str) -> Reject:
        """A queued request that will not run: over its share until its deadline (429), or
        the pool stayed saturated (503: expired, queue full, shutting down)."""
        waiter: Waiter = item.payload  # type: ignore[assignment]
        retry = self.scheduler.retry_ms(item.cost, self.clock(), promise=True)
        if why == "expired" and waiter.queued_for is Reason.KV_SHARE:
            return refuse(Reason.KV_SHARE, f"tenant '{item.tenant}' stayed over its weighted "
                          f"share of pool '{self.pool}' until its deadline", retry)
        return refuse(Reason.SATURATED, f"pool '{self.pool}' stayed saturated ({why})", retry)

    def _answer(self, item: QueuedRequest, outcome: Placement | Reject, event: str) -> None:
        waiter: Waiter = item.payload  # type: ignore[assignment]
        if not waiter.future.done():
            waiter.future.set_result(outcome)
        self._counted(item, waiter, event)

    def _counted(self, item: QueuedRequest, waiter: Waiter, event: str) -> None:
        """A request left the queue: its outcome, and its wait whatever the outcome."""
        self.metrics.queue_events.labels(self.pool, event).inc()
        waited = (self.clock_ms() - item.enqueued_ms) / 1000
        self.metrics.queue_wait.labels(self.pool, waiter.request_class).observe(waited)

    def _gauge(self) -> None:
        """Publish this pool's queue depth. The gauge is shared by every pool's controller:
        only this pool's label sets that emptied are removed (clearing the gauge would
        erase every other pool's depth until its own queue next changed)."""
        depth = {(str(band), tenant): count
                 for (band, tenant), count in self.queue.depth().items()}
        for band, tenant in self._published - depth.keys():
            self.metrics.queue_depth.remove(self.pool, band, tenant)
        for (band, tenant), count in depth.items():
            self.metrics.queue_depth.labels(self.pool, band, tenant).set(count)
        self._published = set(depth)

    async def debug(self) -> dict[str, Any]:
        now = self.clock_ms()
        return {
            "pool": self.pool,
            "queued": len(self.queue),
            "depth": [{"band": band, "tenant": tenant, "count": count}
                      for (band, tenant), count in sorted(self.queue.depth().items())],
            "items": [{"id": i.id, "tenant": i.tenant, "band": i.band,
                       "effective_band": self.queue.effective_band(i, now), "tokens": i.cost,
                       "waited_ms": now - i.enqueued_ms, "deadline_in_ms": i.deadline_ms - now}
                      for i in self.queue.items()],
            "fairness_counters": await self.fairness.counters(),
            "unstarted": dict(self.scheduler.unstarted),  # endpoint → sent, not started
            "unstarted_limit_growth": dict(self.scheduler.gate_growth),
            "seq_limits": dict(self.scheduler.seq_caps),  # endpoint → learned --max-num-seqs
            # endpoint → KV tokens its requests in flight are expected to grow to, and
            # tenant → the share of reserved output that expectation counts (learned from
            # the tenant's usage; a tenant not listed: all of it)
            "committed_kv_tokens": dict(self.scheduler.committed),
            "expected_output_share": {t: round(r, 4) for t, r in
                                      sorted(self.scheduler.output_ratios.items())},
            # output tokens per second of one running sequence (0: none finished yet)
            "decode_tokens_per_s": round(self.scheduler.decode_rate, 2),
            # prompt tokens per second one endpoint prefills (0: no first token seen yet),
            # and endpoint → the prompt tokens a request sent there now would wait behind
            "prefill_tokens_per_s": round(self.scheduler.prefill_rate, 2),
            "prefill_ahead_tokens": {e: round(self.scheduler.prefill_ahead(e, self.clock()))
                                     for e in self.scheduler.prefill_tokens},
        }
