"""The director: who is asking, may it run now, at what priority, and where.

It turns configuration (pydantic) into the limiter's policies, authenticates API keys by
their sha256, prices a request in tokens, asks the store for an all-or-nothing admission,
and picks the endpoint. It knows nothing of Envoy messages; ``stream.py`` does.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from dataclasses import dataclass

from extproc.config import Config, Limits, Tenant
from extproc.openai import PER_MESSAGE_OVERHEAD_TOKENS, BadRequest, InferenceRequest
from extproc.pool import EndpointPool, PoolDirectory
from extproc.tokens import TokenCounter, make_counter
from limiter import Admit, Cost, LimiterStore, Rate, Reject, TenantPolicy


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


@dataclass
class Admission:
    """What an admitted request holds until it finishes: released exactly once."""

    tenant: Tenant
    lease_id: str
    cost: Cost
    pool: EndpointPool
    endpoint: str
    priority: int | None
    request_class: str
    admit: Admit


class Director:
    def __init__(self, config: Config, store: LimiterStore, rng: random.Random | None = None):
        self.config = config
        self.store = store
        self.rng = rng or random.Random()
        self.pools = PoolDirectory(config)
        self.active: dict[str, Admission] = {}  # by lease id, for lease renewal
        self._tenants_by_key = {key: t for t in config.tenants for key in t.api_keys}
        self._tenants_by_name = {t.name: t for t in config.tenants}
        self._policies = {t.name: policy_from_limits(config.limits_for(t)) for t in config.tenants}
        self._counters: dict[str, TokenCounter] = {
            model.name: make_counter(model.tokenizer, config.server.chars_per_token)
            for pool in config.pools
            for model in pool.models
        }

    def authenticate(self, authorization: str | None) -> Tenant:
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
        return tenant

    def policy(self, tenant: Tenant) -> TenantPolicy:
        return self._policies[tenant.name]

    async def precheck(self, tenant: Tenant) -> Reject | None:
        """Before the body arrives: is the tenant over its request rate or concurrency?"""
        return await self.store.check_requests(tenant.name, self.policy(tenant))

    async def admit(self, tenant: Tenant, request: InferenceRequest) -> Admission | Reject:
        found = self.pools.for_model(request.model)
        if found is None:
            raise BadRequest(
                f"the model '{request.model}' does not exist "
                f"(served here: {', '.join(self.pools.model_names)})",
                status=404, code="model_not_found", param="model",
            )
        pool, model = found
        prompt = self._counters[model.name].count(request.prompt_texts)
        prompt += PER_MESSAGE_OVERHEAD_TOKENS * request.message_count
        output = request.max_output_tokens
        cost = Cost(prompt, model.default_max_tokens if output is None else output)
        return await self._admit(tenant, pool, cost)

    async def admit_request_only(self, tenant: Tenant) -> Admission | Reject:
        """Requests with no inference body (GET /v1/models, …): charged one request."""
        return await self._admit(tenant, self.pools.default, Cost(0, 0))

    async def _admit(self, tenant: Tenant, pool: EndpointPool, cost: Cost) -> Admission | Reject:
        lease_id = uuid.uuid4().hex
        decision = await self.store.admit(tenant.name, self.policy(tenant), cost, lease_id)
        if isinstance(decision, Reject):
            return decision
        endpoint = pool.pick(self.rng)[0]
        pool.acquire(endpoint)
        request_class = tenant.default_class
        priority = self.config.classes[request_class].priority
        self.active[lease_id] = admission = Admission(
            tenant=tenant,
            lease_id=lease_id,
            cost=cost,
            pool=pool,
            endpoint=endpoint,
            priority=priority if pool.config.priority_scheduling else None,
            request_class=request_class,
            admit=decision,
        )
        return admission

    async def release(self, admission: Admission, used_tokens: int | None) -> None:
        self.active.pop(admission.lease_id, None)
        admission.pool.release(admission.endpoint)
        await self.store.release(
            admission.tenant.name, self.policy(admission.tenant), admission.lease_id, used_tokens
        )

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
