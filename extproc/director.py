"""The director: who is asking, may it run now, at what priority, and where.

It turns configuration (pydantic) into the limiter's policies, authenticates API keys by
their sha256, prices a request in tokens, asks the scheduler for an endpoint with room in
its KV cache and the store for an all-or-nothing admission against the tenant's limits.
It knows nothing of Envoy messages; ``stream.py`` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from extproc.classify import Classifier, RequestClass
from extproc.config import Config, Limits, Model, Pool, Tenant
from extproc.datalayer.endpoints import EndpointStore
from extproc.flow import QUEUEABLE, FlowController, Waiter
from extproc.openai import PER_MESSAGE_OVERHEAD_TOKENS, BadRequest, InferenceRequest
from extproc.scheduler import Placement, PoolScheduler, Shed
from extproc.tokens import TokenCounter, make_counter
from limiter import Admit, Cost, LimiterStore, Rate, Reject, TenantPolicy
from limiter.fairqueue import QueuedRequest

_LEASE_PREFIX = os.urandom(6).hex()  # unique per process; a counter makes each lease unique
_lease_numbers = itertools.count()
RECENT_KEYS = 4096  # authenticated Authorization values remembered


def _next_lease() -> str:
    return f"{_LEASE_PREFIX}-{next(_lease_numbers):x}"


def policy_from_limits(limits: Limits) -> TenantPolicy:
    window = limits.sliding_window
    return TenantPolicy(
        request_rate=Rate.per_second(limits.requests_per_second)
        if limits.requests_per_second
        else None,
        request_burst=limits.effective_request_burst,
        token_rate=Rate.per_minute(limits.tokens_per_minute) if limits.tokens_per_minute else None,
        token_burst=limits.effective_token_burst,
        max_concurrency=limits.max_concurrency,
        max_context_tokens=limits.max_context_tokens,
        window_limit=window.requests if window else None,
        window_ms=window.window_ms if window else None,
        daily_token_quota=limits.daily_token_quota,
        monthly_token_quota=limits.monthly_token_quota,
    )


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
    pool: str = field(init=False)  # the scheduler's pool (read on every release)

    def __post_init__(self) -> None:
        self.pool = self.scheduler.config.name

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]


Outcome = Admission | Reject | Shed


class Director:
    def __init__(
        self,
        config: Config,
        store: LimiterStore,
        endpoints: EndpointStore | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.store = store
        self.endpoints = endpoints or EndpointStore()
        self.rng = rng or random.Random()
        self.clock = clock
        self.active: dict[str, Admission] = {}  # by lease id, for lease renewal
        self.flows: dict[str, FlowController] = {}  # by pool; attached by the server
        weights = {t.name: config.tiers[t.tier].weight for t in config.tenants}
        self.schedulers = {
            p.name: PoolScheduler(p, weights, config.scrape.staleness_s) for p in config.pools
        }
        self._models: dict[str, tuple[Pool, Model]] = {
            m.name: (p, m) for p in config.pools for m in p.models
        }
        self.classifier = Classifier(config)
        self._tenants_by_key = {key: t for t in config.tenants for key in t.api_keys}
        self._recent_keys: dict[str, Tenant] = {}  # Authorization value → tenant
        self._tenants_by_name = {t.name: t for t in config.tenants}
        self._policies = {t.name: policy_from_limits(config.limits_for(t)) for t in config.tenants}
        self._counters: dict[str, TokenCounter] = {
            name: make_counter(model.tokenizer, config.server.chars_per_token)
            for name, (_, model) in self._models.items()
        }

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant owning the request's API key. Keys are configured as sha256 hashes;
        a key already seen skips the hash (OpenSSL's sha256 costs microseconds a call here)."""
        tenant = self._recent_keys.get(authorization or "")
        if tenant is not None:
            return tenant
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise BadRequest(
                "missing API key: send 'Authorization: Bearer <key>'",
                status=401, code="invalid_api_key",
            )
        tenant = self._tenants_by_key.get("sha256:" + hashlib.sha256(key.encode()).hexdigest())
        if tenant is None:
            raise BadRequest("incorrect API key provided", status=401, code="invalid_api_key")
        if len(self._recent_keys) >= RECENT_KEYS:
            self._recent_keys.clear()  # bounded: a flood of distinct valid keys only re-hashes
        self._recent_keys[authorization or ""] = tenant
        return tenant

    def policy(self, tenant: Tenant) -> TenantPolicy:
        return self._policies[tenant.name]

    async def precheck(self, tenant: Tenant) -> Reject | None:
        """Before the body arrives: is the tenant over its request rate or concurrency?"""
        return await self.store.check_requests(tenant.name, self.policy(tenant))

    async def admit(
        self, tenant: Tenant, request: InferenceRequest, requested_class: str | None = None
    ) -> Outcome:
        found = self._models.get(request.model)
        if found is None:
            raise BadRequest(
                f"the model '{request.model}' does not exist "
                f"(served here: {', '.join(sorted(self._models))})",
                status=404, code="model_not_found", param="model",
            )
        pool, model = found
        prompt = self._counters[model.name].count(request.prompt_texts)
        prompt += PER_MESSAGE_OVERHEAD_TOKENS * request.message_count
        output = request.max_output_tokens
        cost = Cost(prompt, model.default_max_tokens if output is None else output)
        klass = self.classifier.classify(
            tenant, requested=requested_class, path=request.path, prompt_tokens=prompt
        )
        return await self._admit(tenant, self.schedulers[pool.name], cost, klass)

    async def admit_request_only(
        self, tenant: Tenant, path: str, requested_class: str | None = None
    ) -> Outcome:
        """Requests with no inference body (GET /v1/models, …): charged one request."""
        klass = self.classifier.classify(
            tenant, requested=requested_class, path=path, prompt_tokens=0
        )
        scheduler = self.schedulers[self.config.pools[0].name]
        placed = scheduler.place_light(self.endpoints.snapshot(), self.clock(), self.rng)
        return await self._admit_now(tenant, scheduler, Cost(0, 0), klass, placed, {})

    async def _admit(
        self, tenant: Tenant, scheduler: PoolScheduler, cost: Cost, klass: RequestClass
    ) -> Outcome:
        placed = self._place(tenant, scheduler, cost, klass.band)
        flow = self.flows.get(scheduler.config.name) if self.config.queue.enabled else None
        overrides: dict[str, Any] = {}
        if isinstance(placed, Shed):
            degraded = self._degrade(tenant, klass, scheduler, cost)
            if degraded is not None:
                scheduler, cost, placed, overrides = degraded
            elif flow is not None and placed.code in QUEUEABLE:
                return await self._queue(tenant, flow, cost, klass, placed.code)
            else:
                return placed
        elif flow is not None and flow.must_queue(klass.band):
            return await self._queue(tenant, flow, cost, klass, "pool_saturated")
        return await self._admit_now(tenant, scheduler, cost, klass, placed, overrides)

    async def _admit_now(
        self, tenant: Tenant, scheduler: PoolScheduler, cost: Cost, klass: RequestClass,
        placed: Placement, overrides: dict[str, Any],
    ) -> Outcome:
        """Capacity is there: reserve it, then take the tenant's limits (all or nothing)."""
        lease_id = _next_lease()
        scheduler.reserve(lease_id, tenant.name, placed.endpoints[0], cost.tokens, self.clock(),
                          band=klass.band, prompt_tokens=cost.prompt_tokens)
        try:
            decision = await self.store.admit(tenant.name, self.policy(tenant), cost, lease_id)
        except BaseException:
            scheduler.release(lease_id, self.clock(), completed=False)
            raise
        if isinstance(decision, Reject):
            scheduler.release(lease_id, self.clock(), completed=False)
            return decision
        return self._admitted(tenant, lease_id, cost, scheduler, placed, klass, decision,
                              overrides)

    async def _queue(
        self, tenant: Tenant, flow: FlowController, cost: Cost, klass: RequestClass,
        queued_for: str,
    ) -> Outcome:
        """Wait for capacity. The tenant's limits are taken first (a request the tenant may
        not send is not worth queueing) and given back in full if it never runs."""
        lease_id = _next_lease()
        policy = self.policy(tenant)
        decision = await self.store.admit(tenant.name, policy, cost, lease_id)
        if isinstance(decision, Reject):
            return decision
        now = flow.clock_ms()
        deadline = now + int(self.config.classes[klass.name].deadline_s * 1000)
        item = QueuedRequest(lease_id, tenant.name, klass.band, cost.tokens,
                             self.config.tiers[tenant.tier].weight, now, deadline)
        waiter = Waiter(asyncio.get_running_loop().create_future(), lease_id, klass.name,
                        queued_for, prompt_tokens=cost.prompt_tokens)
        try:
            placed = await flow.wait(item, waiter)
        except BaseException:
            await asyncio.shield(self.store.release(tenant.name, policy, lease_id, 0))
            raise
        if isinstance(placed, Shed):
            await self.store.release(tenant.name, policy, lease_id, 0)
            return placed
        return self._admitted(tenant, lease_id, cost, flow.scheduler, placed, klass, decision, {})

    def _admitted(
        self, tenant: Tenant, lease_id: str, cost: Cost, scheduler: PoolScheduler,
        placed: Placement, klass: RequestClass, decision: Admit, overrides: dict[str, Any],
    ) -> Admission:
        self.active[lease_id] = admission = Admission(
            tenant=tenant,
            lease_id=lease_id,
            cost=cost,
            scheduler=scheduler,
            endpoints=placed.endpoints,
            priority=klass.priority if scheduler.config.priority_scheduling else None,
            request_class=klass.name,
            admit=decision,
            body_overrides=overrides,
        )
        return admission

    def _place(
        self, tenant: Tenant, scheduler: PoolScheduler, cost: Cost, band: int
    ) -> Placement | Shed:
        return scheduler.place(
            tenant.name, cost.tokens, self.endpoints.snapshot(), self.clock(), self.rng,
            band=band,
        )

    def _degrade(
        self, tenant: Tenant, klass: RequestClass, scheduler: PoolScheduler, cost: Cost
    ) -> tuple[PoolScheduler, Cost, Placement, dict[str, Any]] | None:
        """Under saturation, a low-priority class gets a smaller answer or a cheaper model
        rather than a rejection — when its pool is configured to degrade."""
        plan = scheduler.config.degradation
        if plan is None or klass.name not in plan.classes:
            return None
        if plan.max_tokens_cap and cost.max_output_tokens > plan.max_tokens_cap:
            capped = Cost(cost.prompt_tokens, plan.max_tokens_cap)
            placed = self._place(tenant, scheduler, capped, klass.band)
            if isinstance(placed, Placement):
                return scheduler, capped, placed, {"max_tokens": plan.max_tokens_cap}
        if plan.fallback_model:
            fallback_pool, _ = self._models[plan.fallback_model]
            fallback = self.schedulers[fallback_pool.name]
            placed = self._place(tenant, fallback, cost, klass.band)
            if isinstance(placed, Placement):
                return fallback, cost, placed, {"model": plan.fallback_model}
        return None

    async def release(self, admission: Admission, used_tokens: int | None) -> None:
        self.active.pop(admission.lease_id, None)
        admission.scheduler.release(admission.lease_id, self.clock())
        self.kick(admission.pool)
        await self.store.release(
            admission.tenant.name, self.policy(admission.tenant), admission.lease_id, used_tokens
        )

    def first_token(self, admission: Admission) -> None:
        """The response has started: the engine is done prefilling this request, which
        may open an endpoint kept clear of lower-band prefill (``prefill_clear_share``)."""
        admission.scheduler.first_token(admission.lease_id, self.clock())
        self.kick(admission.pool)

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
        by_tenant: dict[str, list[str]] = {}
        for admission in list(self.active.values()):
            by_tenant.setdefault(admission.tenant.name, []).append(admission.lease_id)
        for tenant, leases in by_tenant.items():
            await self.store.renew(tenant, leases)

    async def usage(self, tenant_name: str) -> dict | None:
        tenant = self._tenants_by_name.get(tenant_name)
        if tenant is None:
            return None
        return {"tenant": tenant.name, "tier": tenant.tier,
                **await self.store.usage(tenant.name, self.policy(tenant))}
