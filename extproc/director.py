"""The director: may this request run now, at what priority, and where — one pipeline.

Headers phase: ``authenticate`` (the API key names the tenant) and ``precheck`` (is the tenant
already over its request rate or concurrency?). Body phase, :meth:`Director.admit`:

    price → classify → route (place now, degrade, or queue) → take the tenant's limits
          → (queued: wait for capacity) → admission

A tenant with a shaper (``limits.shaping``) takes its limits first, waits for the departure
slot they give it, and is routed when it leaves (:meth:`Director._paced`).

Every refusal on the way is a :class:`limiter.Reject`; ``extproc.rejections`` turns it into
HTTP. Whatever was taken before a later step says no is given back at once. The parts are
passed in (``extproc.wiring.build_director`` builds them from the configuration); this
module knows nothing of Envoy messages (``stream.py`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from extproc.classify import Classifier, RequestClass
from extproc.config import Config, Tenant
from extproc.counting import PromptCosts
from extproc.datalayer.endpoints import EndpointStore, StoreSnapshot
from extproc.flow import FlowController, Waiter
from extproc.leases import LeaseBook
from extproc.openai import BadRequest, InferenceRequest
from extproc.pricing import Pricer, output_cap
from extproc.rejections import RecentRejections
from extproc.scheduler import FAIR_REPRICE_S, Placement, PoolScheduler
from extproc.tenants import Tenants
from limiter.decision import never_fits
from limiter.fairness import max_price, price_of
from limiter.fairqueue import QueuedRequest
from limiter.outcome import QUEUEABLE, Admit, Cost, Reason, Reject, refuse
from limiter.stores import LimiterStore, MemoryFairness
from limiter.stores.base import Correction

Watch = Callable[[], AbstractContextManager[None]]
"""Entered while a request waits in the queue: cancels the wait if its client goes away."""

Prepared = tuple[Tenants, Classifier]


def prepare(config: Config) -> Prepared:
    """What :meth:`Director.reconfigure` builds from a configuration alone: pure, so a
    reload builds it in its worker thread (0.2 s for 10,000 tenants that would otherwise
    hold the event loop at the swap)."""
    return Tenants(config), Classifier(config)


@dataclass(slots=True)
class Admission:
    """What an admitted request holds until it finishes: released exactly once."""

    tenant: Tenant
    lease_id: str
    cost: Cost
    scheduler: PoolScheduler
    endpoints: list[str]  # the chosen one first, then fallbacks
    priority: int | None
    request_class: str
    admit: Admit
    body_overrides: dict[str, Any] = field(default_factory=dict)  # degradation rewrites
    charged: int | None = None  # the price its tenant's fair-order counter was charged
    charged_weight: float = 1.0  # … at its tenant's weight then (a reload may change it)
    charged_band0: bool = False  # … as band-0 work (its band-0 counter is corrected too)
    pool: str = field(init=False)  # the scheduler's pool (read on every release)

    def __post_init__(self) -> None:
        self.pool = self.scheduler.config.name

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]


@dataclass(slots=True)
class Route:
    """Where a request goes: ``placed`` on endpoints now, or (None) into the pool's queue."""

    scheduler: PoolScheduler
    cost: Cost
    placed: Placement | None
    queued_for: Reason = Reason.SATURATED  # why it waits: decides 503 or 429 on expiry
    overrides: dict[str, Any] = field(default_factory=dict)  # a degraded request's rewrites
    streamed: bool = True  # its first token is seen before it ends


# Retry-After for a request refused because this process is shutting down while it waited
# in the queue: another replica (or this one restarted) takes it (a held one gets the rest
# of its wait, after which its tenant's shaper had sent it)
SHUTDOWN_RETRY_MS = 1000


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _shutting_down(retry_after_ms: int) -> Reject:
    """The 503 for a request still waiting when the shutdown's grace passed."""
    return refuse(Reason.SATURATED, "this gateway replica is shutting down; retry",
                  max(1, retry_after_ms))


class Director:
    def __init__(
        self,
        config: Config,
        *,
        tenants: Tenants,
        pricer: Pricer,
        costs: PromptCosts | None = None,
        classifier: Classifier,
        store: LimiterStore,
        schedulers: Mapping[str, PoolScheduler],
        flows: Mapping[str, FlowController],
        endpoints: EndpointStore,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        upstream_authorization: Mapping[str, str] | None = None,
    ):
        self.config = config
        # pool → the Authorization its engines expect (none: the header is just removed)
        self.upstream_authorization = dict(upstream_authorization or {})
        self.tenants = tenants
        self.pricer = pricer
        self.costs = costs or PromptCosts(pricer)  # long prompts counted off the loop
        self.classifier = classifier
        self.store = store
        self.schedulers = schedulers
        self.flows = flows
        # fair-order counters in this process: a release's correction never waits either
        self._fairness_in_process = all(
            isinstance(flow.fairness, MemoryFairness) for flow in flows.values())
        self._queueing = config.queue.enabled
        self.endpoints = endpoints
        self.rng = rng
        self.clock = clock
        self.leases = LeaseBook()
        self.rejections = RecentRejections()  # for the admin status page
        self.started_s = int(time.time())  # the models' "created" in GET /v1/models
        # tenant → its requests between the start of their admission and the end of their
        # release (or refusal): a tenant a reload removed is not forgotten while it has one
        self._busy: dict[str, int] = {}
        # shaped requests waiting for their departure slot: a shutdown's grace wakes them
        # (``refuse_waiting``) to answer them rather than leave gRPC to cut them
        self._holds: set[asyncio.Future[bool]] = set()
        # lease → the admissions in flight whose fair-order charge was an estimate (they
        # queued), the corrections of their prices as they run, under way, and when they
        # were last priced (``_reprice``)
        self._estimated: dict[str, Admission] = {}
        self._repricings: set[asyncio.Future[None]] = set()
        self._repriced_at = float("-inf")
        self._refusing_waits = False  # set once the shutdown's grace has passed

    def reconfigure(self, config: Config, prepared: Prepared | None = None) -> None:
        """Apply a reloaded configuration's live sections (``extproc.reload.LIVE``: tenants,
        tiers, classification) in one step: no await, so each request sees the old or the
        new. Admitted and queued requests release under their tenant's current policy (a
        removed tenant's last one, kept until :meth:`forget_retired`). ``prepared``: what
        :func:`prepare` built from ``config`` off the event loop."""
        tenants, classifier = prepared or prepare(config)
        tenants.inherit(self.tenants)
        self.config, self.tenants, self.classifier = config, tenants, classifier
        self._reweigh()

    def _reweigh(self) -> None:
        weights = self.tenants.weights
        for scheduler in self.schedulers.values():
            scheduler.weights = weights

    def forget_retired(self) -> list[str]:
        """Forget the tenants reloads removed that have nothing left: no request admitted,
        queued or on its way through admission, nothing owed to the shared store. Their
        policies, weights, the fair queue's counters, the schedulers' learned output ratios
        and this process's limits state go
        (the in-memory store keeps a tenant's limits while Redis would: see
        ``MemoryStore``); a tenant configured again later starts from what the limits store
        has. Returns the tenants forgotten; the others are asked about again next time."""
        retired = [name for name in self.tenants.retired() if name not in self._busy]
        forgotten = self.store.forget(retired)  # (also when none: it drops what has faded)
        if forgotten:
            for flow in self.flows.values():
                flow.fairness.forget(forgotten)
            for scheduler in self.schedulers.values():
                scheduler.forget(forgotten)
            self.tenants.forget(forgotten)
            self._reweigh()
        return forgotten

    def _enter(self, tenant: Tenant) -> None:
        """A request of ``tenant`` starts its way through admission: the tenant is not
        forgotten until it ends (:meth:`_leave`). One authenticated before a reload
        removed its tenant, which has since been forgotten, is refused as its key is now."""
        if not self.tenants.knows(tenant):
            raise BadRequest("incorrect API key provided", status=401, code="invalid_api_key")
        self._busy[tenant.name] = self._busy.get(tenant.name, 0) + 1

    def _leave(self, name: str) -> None:
        left = self._busy.get(name, 0) - 1
        if left > 0:
            self._busy[name] = left
        else:
            self._busy.pop(name, None)

    async def _entered(self, tenant: Tenant,
                       admission: Awaitable[Admission | Reject]) -> Admission | Reject:
        """``admission``, with ``tenant`` held from now on: until the release of what it
        admits, or at once when it refuses or fails."""
        try:
            outcome = await admission
        except BaseException:
            self._leave(tenant.name)
            raise
        if not isinstance(outcome, Admission):
            self._leave(tenant.name)
        return outcome

    @property
    def active(self) -> dict[str, str]:
        """Open leases (id → tenant): what is admitted and not yet released."""
        return self.leases.open

    # -- headers phase ---------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        return self.tenants.authenticate(authorization)

    async def precheck(self, tenant: Tenant, *, body_here: bool = False) -> Reject | None:
        """Before the body is parsed: is the tenant over its request rate or concurrency?
        ``body_here``: the body came with the headers (request attributes). A tenant with a
        token limit is then left to :meth:`admit`, which reads every limit: this peek reads
        the request counts alone, so its retry time left the token bucket out (the client,
        back then, was refused again by tokens)."""
        self._enter(tenant)  # (a tenant forgotten meanwhile: 401, as its key now is)
        try:
            policy = self.tenants.policy(tenant)
            if body_here and (policy.token_rate is not None or policy.quotas()):
                return None
            return await self.store.check_requests(tenant.name, policy)
        finally:
            self._leave(tenant.name)

    # -- body phase: the pipeline ----------------------------------------------------------

    async def admit(
        self, tenant: Tenant, request: InferenceRequest, requested_class: str | None = None,
        *, watch: Watch = contextlib.nullcontext,
    ) -> Admission | Reject:
        self._enter(tenant)
        return await self._entered(tenant, self._admit(tenant, request, requested_class, watch))

    async def _admit(
        self, tenant: Tenant, request: InferenceRequest, requested_class: str | None,
        watch: Watch,
    ) -> Admission | Reject:
        pool, model = self.pricer.resolve(request.model)
        cost = self.costs.at_once(model, request) or await self.costs.price(model, request)
        klass = self.classifier.classify(
            tenant, requested=requested_class, path=request.path, prompt_tokens=cost.prompt_tokens
        )
        request.request_class = klass.name
        scheduler = self.schedulers[pool.name]
        policy = self.tenants.policy(tenant)
        if not policy.surely_fits(cost) and never_fits(policy, cost) is not None:
            # over the tenant's own context or token budget: say so (the store refuses it,
            # charging nothing), not that it is larger than every endpoint's KV cache
            return await self.store.admit(tenant.name, policy, cost, self.leases.new_id())

        # a request that set no output cap runs to what was reserved for it, not to the
        # engine's default (the rest of its context): it cannot outgrow its KV or its price
        cap = {} if request.max_output_tokens is not None else {
            "max_tokens": output_cap(model, request)}

        def route_now() -> Route | Reject:
            route = self._route(tenant, scheduler, cost, klass, request.choices)
            if cap and isinstance(route, Route):
                route.overrides = cap | route.overrides  # a degradation's smaller cap wins
            return route

        if policy.shaping_rate is not None:
            return await self._paced(tenant, klass, cost, route_now, request.stream, watch)
        route = route_now()
        if isinstance(route, Reject):
            return route
        route.streamed = request.stream
        return await self._take(tenant, klass, route, watch)

    async def admit_request_only(
        self, tenant: Tenant, path: str, requested_class: str | None = None,
        *, watch: Watch = contextlib.nullcontext,
    ) -> Admission | Reject:
        """Requests with no inference body (GET /v1/models, …): charged one request, sent to
        any live endpoint of the first pool; they never queue."""
        self._enter(tenant)
        return await self._entered(tenant, self._admit_request_only(tenant, path,
                                                                    requested_class, watch))

    async def _admit_request_only(
        self, tenant: Tenant, path: str, requested_class: str | None, watch: Watch,
    ) -> Admission | Reject:
        klass = self.classifier.classify(
            tenant, requested=requested_class, path=path, prompt_tokens=0
        )
        scheduler = self.schedulers[self.config.pools[0].name]

        def route_now() -> Route | Reject:
            placed = scheduler.place_light(self.endpoints.snapshot(), self.clock(), self.rng)
            return placed if isinstance(placed, Reject) else Route(scheduler, Cost(0, 0), placed)

        if self.tenants.policy(tenant).shaping_rate is not None:
            return await self._paced(tenant, klass, Cost(0, 0), route_now, watch=watch)
        route = route_now()
        if isinstance(route, Reject):
            return route
        return await self._take(tenant, klass, route)

    async def list_models(
        self, tenant: Tenant, *, watch: Watch = contextlib.nullcontext,
    ) -> tuple[list[tuple[str, str]], Admit] | Reject:
        """``GET /v1/models``, answered here for every pool (no engine serves another pool's
        models): ``(model, pool)`` pairs, after charging the tenant one request (taken and
        given back at once: nothing is held while nobody runs). A shaped tenant's waits for
        its departure slot first, as every request of its does (answered at once, it left
        its slot unused and gave it back, so it was never paced)."""
        self._enter(tenant)
        try:
            return await self._list_models(tenant, watch)
        finally:
            self._leave(tenant.name)

    async def _list_models(
        self, tenant: Tenant, watch: Watch,
    ) -> tuple[list[tuple[str, str]], Admit] | Reject:
        lease_id = self.leases.new_id()
        decision = await self.store.admit(tenant.name, self.tenants.policy(tenant), Cost(0, 0),
                                          lease_id)
        if isinstance(decision, Reject):
            return decision
        if decision.hold_ms:
            self.leases.opened(lease_id, tenant.name)  # renewed in the shared store while held
            try:
                with watch():
                    await asyncio.sleep(decision.hold_ms / 1000)
            except BaseException:  # the client left: its slot goes back
                self._give_back(tenant, lease_id)
                raise
            finally:
                self.leases.closed(lease_id)
        self._give_back(tenant, lease_id, served=True)  # answered: it counts one request
        return [(m.name, pool.name) for pool in self.config.pools for m in pool.models], decision

    def _route(
        self, tenant: Tenant, scheduler: PoolScheduler, cost: Cost, klass: RequestClass,
        choices: int = 1,
    ) -> Route | Reject:
        """An endpoint with room now; else a degraded form that fits; else the pool's queue
        when waiting can help; else the scheduler's refusal. While anything is queued, the
        request queues too: the fair order, not arrival, decides who goes next. The tenant's
        overflow mode: ``reject`` never queues, ``degrade`` degrades every class."""
        placed = self._place(tenant, scheduler, cost, klass.band)
        overflow = self.tenants.overflow(tenant)
        queueing = self._queueing and overflow != "reject"
        flow = self.flows.get(scheduler.config.name) if queueing else None
        if isinstance(placed, Reject):
            degraded = self._degrade(tenant, klass, scheduler, cost, choices,
                                     every_class=overflow == "degrade")
            if degraded is not None:
                return degraded
            if flow is not None and placed.reason in QUEUEABLE:
                return Route(scheduler, cost, None, queued_for=placed.reason)
            return placed
        if flow is not None and flow.must_queue():
            return Route(scheduler, cost, None)
        return Route(scheduler, cost, placed)

    async def _take(self, tenant: Tenant, klass: RequestClass, route: Route,
                    watch: Watch = contextlib.nullcontext) -> Admission | Reject:
        """Hold the endpoint's KV (placed now: held across the limits' round trip, so no
        other request takes it meanwhile), take the tenant's limits all or nothing, then —
        when queued — wait for capacity. A later "no" gives back what was taken."""
        lease_id = self.leases.new_id()
        scheduler, cost, placed = route.scheduler, route.cost, route.placed
        if placed is not None:
            self._reserve(tenant, klass, route, lease_id)
        try:
            # a request that queues is not sent upstream until the dispatcher places it:
            # should this process die meanwhile, a shared store gives its quota charge back
            decision = await self.store.admit(tenant.name, self.tenants.policy(tenant), cost,
                                              lease_id, unsent=placed is None)
        except BaseException:
            if placed is not None:
                scheduler.release(lease_id, self.clock(), completed=False)
            raise
        if isinstance(decision, Reject):
            if placed is not None:
                scheduler.release(lease_id, self.clock(), completed=False)
            return decision
        return await self._settle(tenant, klass, route, lease_id, decision, watch,
                                  unsent=placed is None)

    def _reserve(self, tenant: Tenant, klass: RequestClass, route: Route, lease_id: str) -> None:
        """Hold the placed endpoint's KV for the request (released if it never runs)."""
        assert route.placed is not None
        cost = route.cost
        route.scheduler.reserve(lease_id, tenant.name, route.placed.endpoints[0], cost.tokens,
                                self.clock(), band=klass.band, prompt_tokens=cost.prompt_tokens,
                                streamed=route.streamed)

    async def _settle(self, tenant: Tenant, klass: RequestClass, route: Route, lease_id: str,
                      decision: Admit, watch: Watch, *, unsent: bool = False
                      ) -> Admission | Reject:
        """Admitted by the limits: wait in the queue if not placed yet, then the admission.
        ``unsent``: it was admitted as one that waits, and the store is told once it goes."""
        scheduler, placed, charged, band0 = route.scheduler, route.placed, None, False
        weight = self.tenants.weight(tenant)  # what the queue charges it at
        # renewed in the shared store from now on, also while it waits in the queue: a lease
        # left to lapse there (the lease TTL is shorter than a batch deadline) freed its
        # concurrency slot for another replica while it still held its place
        self.leases.opened(lease_id, tenant.name)
        if placed is None:
            try:
                waited = await self._wait(tenant, klass, route, lease_id, weight, watch)
            except BaseException:
                self.leases.closed(lease_id)
                raise
            if isinstance(waited, Reject):
                self.leases.closed(lease_id)
                return waited
            placed, charged, band0 = waited
            if unsent:
                self.store.mark_sent(tenant.name, lease_id)
        admission = Admission(
            tenant=tenant, lease_id=lease_id, cost=route.cost, scheduler=scheduler,
            endpoints=placed.endpoints,
            priority=scheduler.config.body_priority(klass.priority),
            request_class=klass.name, admit=decision, body_overrides=route.overrides,
            charged=charged, charged_weight=weight, charged_band0=band0,
        )
        if charged is not None:
            self._estimated[lease_id] = admission
        return admission

    async def _paced(
        self, tenant: Tenant, klass: RequestClass, cost: Cost,
        route_now: Callable[[], Route | Reject], streamed: bool = True,
        watch: Watch = contextlib.nullcontext,
    ) -> Admission | Reject:
        """A shaped tenant: its limits first (the shaper gives the request a departure slot,
        or a 429 when its backlog is full), then the wait for the slot — the ext_proc
        stream stays open, and a client that leaves gives the slot back — then routing as
        usual, so no KV is held while it waits. Anything later that says no gives the
        limits back."""
        lease_id = self.leases.new_id()
        # not sent upstream until its slot comes and it is routed (maybe through the queue):
        # should this process die meanwhile, a shared store gives its quota charge back
        decision = await self.store.admit(tenant.name, self.tenants.policy(tenant), cost,
                                          lease_id, unsent=True)
        if isinstance(decision, Reject):
            return decision
        self.leases.opened(lease_id, tenant.name)  # renewed in the shared store while held
        try:
            if decision.hold_ms:
                with watch():
                    left_ms = await self._hold(decision.hold_ms)
                if left_ms is not None:  # shutting down: answered, its slot given back
                    self.leases.closed(lease_id)
                    self._give_back(tenant, lease_id)
                    return _shutting_down(left_ms)
            route = route_now()
            if isinstance(route, Reject):
                outcome: Admission | Reject = route
                self._give_back(tenant, lease_id)
            else:
                route.streamed = streamed
                if route.placed is not None:
                    self._reserve(tenant, klass, route, lease_id)
                    self.store.mark_sent(tenant.name, lease_id)
                outcome = await self._settle(tenant, klass, route, lease_id, decision, watch,
                                             unsent=route.placed is None)
        except BaseException:
            self.leases.closed(lease_id)
            self._give_back(tenant, lease_id)
            raise
        if isinstance(outcome, Reject):
            self.leases.closed(lease_id)
        return outcome

    async def _hold(self, hold_ms: int) -> int | None:
        """Wait ``hold_ms`` for a departure slot; None once it came, or the ms still to go
        when a shutdown's grace passed first (``refuse_waiting``): the request is then
        answered, not cut."""
        loop = asyncio.get_running_loop()
        until = loop.time() + hold_ms / 1000
        if not self._refusing_waits:
            held: asyncio.Future[bool] = loop.create_future()
            timer = loop.call_later(hold_ms / 1000, _resolve, held, False)
            self._holds.add(held)
            try:
                if not await held:
                    return None
            finally:
                timer.cancel()
                self._holds.discard(held)
        return max(0, round((until - loop.time()) * 1000))

    def refuse_waiting(self) -> int:
        """Shutdown, once the grace has passed: answer every request still waiting — held
        for its departure slot, or in a pool's queue — with a 503 and its Retry-After, and
        any that comes to wait from now on. They were never sent upstream; gRPC would
        otherwise cut their streams a moment later, and their clients got Envoy's bare
        "admission control is unavailable" 503 with no Retry-After. Returns how many."""
        self._refusing_waits = True
        refused = sum(flow.refuse_all("shutting down") for flow in self.flows.values())
        for held in list(self._holds):
            if not held.done():
                held.set_result(True)
                refused += 1
        return refused

    async def _wait(
        self, tenant: Tenant, klass: RequestClass, route: Route, lease_id: str, weight: float,
        watch: Watch,
    ) -> tuple[Placement, int, bool] | Reject:
        """Queue until the dispatcher reserves KV under ``lease_id`` (charging its tenant's
        fair-order counter the :meth:`_queue_price` it has then, returned with the
        placement and whether it was charged as band-0 work) or the class deadline
        passes; the tenant's limits are given back in full if it never runs."""
        flow = self.flows[route.scheduler.config.name]
        if self._refusing_waits:  # shutting down: it would be cut before a place frees
            self._give_back(tenant, lease_id)
            return _shutting_down(SHUTDOWN_RETRY_MS)
        now = flow.clock_ms()
        deadline = now + int(self.config.classes[klass.name].deadline_s * 1000)

        def price_now() -> int:
            return self._queue_price(tenant, route, weight)

        item = QueuedRequest(lease_id, tenant.name, klass.band, route.cost.tokens, weight, now,
                             deadline, price=price_now())
        waiter = Waiter(asyncio.get_running_loop().create_future(), lease_id, klass.name,
                        route.queued_for, prompt_tokens=route.cost.prompt_tokens,
                        streamed=route.streamed, price_now=price_now)
        try:
            with watch():
                placed = await flow.wait(item, waiter)
        except BaseException:
            self._give_back(tenant, lease_id)
            raise
        if isinstance(placed, Reject):
            self._give_back(tenant, lease_id)
            return placed
        return placed, price_of(item), waiter.charged_band0

    def _give_back(self, tenant: Tenant, lease_id: str, *, served: bool = False) -> None:
        """Give back the limits of a request that never ran (it left its wait, or kvgate
        refused it after admitting it: its deadline passed in the queue, the queue was full,
        a shutdown), or of a GET kvgate answered itself (``served``: it keeps its request
        charge), under the tenant's policy *now*: a reload may have come while it waited,
        and the limits store takes a policy it is passed as the tenant's current one — the
        one read before the wait would undo the reload for the tenant (a token bucket or
        shaper the reload added dropped, then started again full or empty by the next
        admission).

        One never served gets every charge back — its request and window entry as well as
        its tokens — as if it had been refused at admission: its client retries (after the
        503's Retry-After, or on its own), and that retry was charged a second time for one
        request nobody served, and refused by the request rate for it."""
        self.store.release_soon(tenant.name, self.tenants.policy(tenant), lease_id, 0,
                                served=served)

    def _queue_price(self, tenant: Tenant, route: Route, weight: float) -> int:
        """What the fair order charges a queued request when it is dispatched: its prompt
        and the share of its ``max_tokens`` its tenant's requests are expected to produce
        (the scheduler's learned :meth:`~extproc.scheduler.PoolScheduler.output_ratio`),
        corrected to its real usage when it ends. Charging all of ``max_tokens`` made a
        tenant that sets it far above its answers swing its counter by the difference at
        every dispatch and end: refunded, it came back far behind the others and its batch
        work went ahead of their interactive work (``bench.inflated_max_tokens``). Cheaper
        only for a tenant whose answers are short: one that sends a long one is expected to
        again at once."""
        ratio = route.scheduler.fair_ratio(tenant.name)
        output = math.ceil(route.cost.max_output_tokens * ratio)
        return self._price(route.cost.prompt_tokens, output, weight)

    def _price(self, prompt_tokens: int, output_tokens: int, weight: float) -> int:
        """What the fair order charges (at admission: the expected output; at the end: the
        used one): prompt and output at their prices, at most what one charge may add to
        the counter of a tenant of ``weight`` (``max_price``): a larger one raised in the
        dispatcher, on every try, and the pool's queue placed no one (of any tenant) until
        that request's deadline."""
        return min(self.config.queue.price(prompt_tokens, output_tokens), max_price(weight))

    def _place(
        self, tenant: Tenant, scheduler: PoolScheduler, cost: Cost, band: int
    ) -> Placement | Reject:
        return scheduler.place(
            tenant.name, cost.tokens, self.endpoints.snapshot(), self.clock(), self.rng,
            band=band, prompt_tokens=cost.prompt_tokens,
        )

    def _degrade(
        self, tenant: Tenant, klass: RequestClass, scheduler: PoolScheduler, cost: Cost,
        choices: int = 1, *, every_class: bool = False,
    ) -> Route | None:
        """Under saturation, a low-priority class (or, ``every_class``, any class of a tenant
        whose overflow mode is ``degrade``) gets a smaller answer or a cheaper model rather
        than a refusal — when its pool is configured to degrade. ``max_tokens_cap`` caps
        each of the request's ``choices`` answers (``max_tokens`` is per answer): the
        capped reservation covers them all."""
        plan = scheduler.config.degradation
        if plan is None or not (every_class or klass.name in plan.classes):
            return None
        if plan.max_tokens_cap and cost.max_output_tokens > plan.max_tokens_cap * choices:
            capped = Cost(cost.prompt_tokens, plan.max_tokens_cap * choices)
            placed = self._place(tenant, scheduler, capped, klass.band)
            if isinstance(placed, Placement):
                return Route(scheduler, capped, placed,
                             overrides={"max_tokens": plan.max_tokens_cap})
        if plan.fallback_model:
            fallback_pool, _ = self.pricer.resolve(plan.fallback_model)
            fallback = self.schedulers[fallback_pool.name]
            placed = self._place(tenant, fallback, cost, klass.band)
            if isinstance(placed, Placement):
                return Route(fallback, cost, placed, overrides={"model": plan.fallback_model})
        return None

    # -- the request's life after admission ------------------------------------------------

    async def release(self, admission: Admission, used_tokens: int | None,
                      output_tokens: int | None = None, *, sent: bool = True,
                      measured: bool = True) -> None:
        """The request ended: free its KV and lease, settle its tokens with the limits, and
        correct its fair-order charge to what it really used (``output_tokens`` of
        ``used_tokens``; unknown: the estimate stands). One that was never ``sent``
        upstream (its routing reply never reached Envoy) used nothing: its KV is freed as
        a reservation that never ran (not counted as drained, nothing learned from it).
        ``measured``: the counts are the engine's usage of a whole answer, which teaches the
        scheduler what the tenant's answers use; not so a request cut off or cancelled
        before its first token (charged 0 output, it taught a cheap "short answers" that
        made a tenant's next long ones count as short)."""
        tenant = admission.tenant
        try:
            self.leases.closed(admission.lease_id)
            if sent:
                admission.scheduler.release(admission.lease_id, self.clock(),
                                            output_tokens=output_tokens if measured else None)
            else:
                admission.scheduler.release(admission.lease_id, self.clock(), completed=False)
            self.kick(admission.pool)
            self.store.release_soon(tenant.name, self.tenants.policy(tenant),
                                    admission.lease_id, used_tokens, served=sent)
            if admission.charged is not None and used_tokens is not None and (
                    output_tokens is not None):
                real = self._price(max(0, used_tokens - output_tokens), output_tokens,
                                   admission.charged_weight)
                await self.flows[admission.pool].correct(
                    tenant.name, real - admission.charged, admission.charged_weight,
                    band0=admission.charged_band0)
        finally:
            self._estimated.pop(admission.lease_id, None)
            self._leave(tenant.name)

    def release_waits(self, admission: Admission) -> bool:
        """Whether :meth:`release` may wait (else it runs to its end where it starts): only
        to correct a queued request's fair-order charge in counters shared through Redis.
        The limits store's part never waits (``release_soon``)."""
        return admission.charged is not None and not self._fairness_in_process

    def first_token(self, admission: Admission) -> None:
        """The response has started: the engine is done prefilling this request, which
        may open an endpoint to lower-band work (``prefill_clear_share``,
        ``max_num_batched_tokens``)."""
        admission.scheduler.first_token(admission.lease_id, self.clock())
        self.kick(admission.pool)

    def scraped(self, snapshot: StoreSnapshot) -> None:
        """A scrape round ended: every pool's scheduler reads it, queued requests may fit
        now, and the requests in flight are priced again (``FAIR_REPRICE_S`` apart, or at
        once when one was found running past its expected output)."""
        overran = False
        for scheduler in self.schedulers.values():
            scheduler.observe(snapshot)
            overran = bool(scheduler.take_overran()) or overran
        now = self.clock()
        if overran or now - self._repriced_at >= FAIR_REPRICE_S:
            self._reprice(now)
        self.kick()

    def _reprice(self, now: float) -> None:
        """Price every queued request in flight again at its tenant's expected output given
        what it has made so far (:meth:`~extproc.scheduler.PoolScheduler.fair_ratio`), and
        charge or refund each tenant the difference (one correction per tenant and band,
        not one per request; its end corrects to its real usage, as ever). The requests
        running at any moment are the long ones: priced once at dispatch, a tenant running
        many was under-charged (at the mean) or over-charged (at an upper envelope) until
        they ended, and the weighted shares moved with how many each ran. One running past
        every recent answer of its tenant is charged what it has made as it makes it, not
        when it ends (with too few answers known, all of its ``max_tokens`` once it runs past
        its tenant's upper envelope): else a tenant whose short answers turned long got
        ahead of the others with every long request it sent before the first of them
        ended."""
        self._repriced_at = now
        by_pool: dict[str, dict[tuple[str, float, bool], int]] = {}
        for lease_id, admission in self._estimated.items():
            ratio = admission.scheduler.fair_ratio_of(lease_id, now)
            if admission.charged is None or ratio is None:
                continue
            cost, weight = admission.cost, admission.charged_weight
            price = self._price(cost.prompt_tokens, math.ceil(cost.max_output_tokens * ratio),
                                weight)
            if price != admission.charged:
                moves = by_pool.setdefault(admission.pool, {})
                key = (admission.tenant.name, weight, admission.charged_band0)
                moves[key] = moves.get(key, 0) + price - admission.charged
                admission.charged = price
        for pool, moves in by_pool.items():  # one call a pool: not one a tenant
            corrections: list[Correction] = [(tenant, tokens, weight, band0) for
                                              (tenant, weight, band0), tokens in moves.items()]
            charge = asyncio.ensure_future(self.flows[pool].correct_many(corrections))
            self._repricings.add(charge)  # (the loop keeps only weak references)
            charge.add_done_callback(self._repricings.discard)

    def kick(self, pool: str | None = None) -> None:
        """Capacity may have freed (a completion; a fresh scrape when pool is None)."""
        if pool is not None:
            flow = self.flows.get(pool)
            if flow is not None:
                flow.kick()
            return
        for flow in self.flows.values():
            flow.kick()

    async def renew_leases(self) -> None:
        """Keep the leases of long-running streams alive in the shared store."""
        await self.leases.renew(self.store)

    async def usage(self, tenant_name: str) -> dict | None:
        """The admin view of one tenant's limits (None: no such tenant)."""
        tenant = self.tenants.get(tenant_name)
        if tenant is None:
            return None
        return {"tenant": tenant.name, "tier": tenant.tier,
                **await self.store.usage(tenant.name, self.tenants.policy(tenant))}
